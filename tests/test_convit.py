"""GPSA (ConViT's gated positional self-attention) against the published construction,
locality at init, the gate and the renormalisation."""

import math

import pytest
import torch

import structinit
from structinit.functional.gated import relative_positions
from structinit.models.convit import GPSA


def published_rel_indices(side):
    """The published construction for a square side×side grid (repeat / repeat_interleave)."""
    ind = torch.arange(side).view(1, -1) - torch.arange(side).view(-1, 1)
    indx = ind.repeat(side, side)
    indy = ind.repeat_interleave(side, dim=0).repeat_interleave(side, dim=1)
    return torch.stack([indx, indy, indx**2 + indy**2], dim=-1).float()


def published_local_weights(num_heads, strength):
    """pos_proj weight (heads, 3) of the published local init (loop over a k×k lattice)."""
    w = torch.zeros(num_heads, 3)
    k = int(num_heads**0.5)
    centre = (k - 1) / 2 if k % 2 == 0 else k // 2
    for h1 in range(k):
        for h2 in range(k):
            pos = h1 + k * h2
            w[pos, 2] = -1
            w[pos, 1] = 2 * (h1 - centre)
            w[pos, 0] = 2 * (h2 - centre)
    return w * strength


def published_attention(m, x):
    """The published get_attention: gated mixture, then rows renormalised."""
    b, n, c = x.shape
    qk = (x @ m.qk.weight.T + m.qk.bias).reshape(b, n, 2, m.num_heads, c // m.num_heads).permute(2, 0, 3, 1, 4)
    patch = (qk[0] @ qk[1].transpose(-2, -1) * m.scale).softmax(-1)
    rel = published_rel_indices(math.isqrt(n))
    pos = (rel @ m.pos_proj.weight.T + m.pos_proj.bias).permute(2, 0, 1).softmax(-1)
    g = m.gating_param.view(1, -1, 1, 1)
    attn = (1 - torch.sigmoid(g)) * patch + torch.sigmoid(g) * pos
    return attn / attn.sum(-1, keepdim=True)


@pytest.mark.parametrize("side", [4, 8])
def test_relative_positions_match_the_published_construction(side):
    torch.testing.assert_close(relative_positions((side, side)), published_rel_indices(side), rtol=0, atol=0)


@pytest.mark.parametrize("heads, strength", [(4, 1.0), (9, 1.0), (16, 0.5), (4, 2.0)])
def test_local_init_matches_the_published_one(heads, strength):
    m = GPSA(heads * 8, heads, (6, 6), locality_strength=strength)
    torch.testing.assert_close(m.pos_proj.weight.detach(), published_local_weights(heads, strength))
    assert torch.equal(m.pos_proj.bias.detach(), torch.zeros(heads))
    assert torch.equal(m.v.weight.detach(), torch.eye(heads * 8))
    assert torch.equal(m.v.bias.detach(), torch.zeros(heads * 8))
    assert torch.equal(m.gating_param.detach(), torch.ones(heads))


def test_attention_and_forward_match_the_published_formula():
    torch.manual_seed(0)
    m = GPSA(32, 4, (8, 8))
    with torch.no_grad():
        m.gating_param.copy_(torch.tensor([-2.0, 0.0, 1.0, 3.0]))  # each head its own mix
        m.qk.weight.normal_(std=0.3)
    x = torch.randn(2, 64, 32)
    ref = published_attention(m, x)
    probs = structinit.attention_maps(torch.nn.Sequential(m), x)[0]  # the one capture path, via the adapter
    torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 64))  # renormalised rows
    v = (x @ m.v.weight.T + m.v.bias).reshape(2, 64, 4, 8).transpose(1, 2)
    expected = (ref @ v).transpose(1, 2).reshape(2, 64, 32) @ m.proj.weight.T + m.proj.bias
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


def test_locality_at_init():
    """Each head's positional attention is a Gaussian around its lattice centre: with 4 heads
    the centres are (±½, ±½), so the mass sits on the 2×2 block of tokens around it."""
    m = GPSA(32, 4, (8, 8))
    pos = m.positional_probs()  # (heads, N, N)
    q = 3 * 8 + 3  # an interior query at (3, 3)
    for h, (cx, cy) in enumerate([(-0.5, -0.5), (-0.5, 0.5), (0.5, -0.5), (0.5, 0.5)]):
        block = [(3 + cy + sy) * 8 + (3 + cx + sx) for sy in (-0.5, 0.5) for sx in (-0.5, 0.5)]
        mass = pos[h, q, [int(t) for t in block]].sum()
        assert mass > 0.5, (h, float(mass))  # four tokens at distance √½ hold most of the row
    rel = relative_positions((8, 8))
    mean_distance = (pos * rel[..., 2].sqrt()).sum(-1).mean()
    assert mean_distance < 1.5  # a uniform row averages about 4 on this grid
    # the gate: σ(1) ≈ 0.73 of every row comes from position at init
    gate = torch.sigmoid(torch.tensor(1.0))
    content = torch.full((4, 64, 64), 1 / 64)
    torch.testing.assert_close(m.mix(content), gate * pos + (1 - gate) / 64)


def test_convit_model_and_the_pytorch_scheme_keep_the_local_init():
    model = structinit.create_model("convit_cpu_patch4_32")
    assert sum(isinstance(b.attn, GPSA) for b in model.blocks) == 5
    structinit.init_(model, "pytorch", seed=0)  # children first, then GPSA's local init
    attn = model.blocks[0].attn
    torch.testing.assert_close(attn.pos_proj.weight.detach(), published_local_weights(4, 1.0))
    assert torch.equal(attn.v.weight.detach(), torch.eye(128))
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert "blocks.0.attn.gating_param" in model.state_dict() and "blocks.0.attn.rel_indices" not in model.state_dict()
    assert len(structinit.attention_maps(model, torch.randn(1, 3, 32, 32))) == 6


def test_convit_needs_average_pooling():
    with pytest.raises(ValueError, match=r"class_token=False, global_pool='avg'"):
        structinit.models.ConViT(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    with pytest.raises(ValueError, match=r"local_up_to_layer=3"):
        structinit.create_model("convit_cpu_patch4_32", depth=2, local_up_to_layer=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_local_init_in_any_dtype(dtype):
    """The local init (at construction, and again through the ``pytorch`` scheme, which runs
    every module's reset_parameters) writes the Gaussian rows in the weight's own dtype."""
    reference = GPSA(16, 4, grid=(4, 4), locality_strength=1.0)
    gpsa = GPSA(16, 4, grid=(4, 4), locality_strength=1.0).to(dtype)
    gpsa.reset_parameters()
    assert torch.equal(gpsa.pos_proj.weight, reference.pos_proj.weight.to(dtype))
    model = structinit.create_model("convit_cpu_patch4_32").to(dtype)
    structinit.init_(model, "pytorch", seed=0)
    for m in model.modules():
        if isinstance(m, GPSA):
            assert torch.equal(m.v.weight, torch.eye(m.v.in_features, dtype=dtype))
            assert torch.equal(m.gating_param, torch.ones_like(m.gating_param))


def test_mimetic_checks_a_gated_mixture_against_the_mixture_it_models():
    """GPSA's map is a gated mixture of its content softmax and a positional one, and no logits of
    the mixture exist: the check after a mimetic write compares the diagonal of the log of the
    model's own map with that of the mixture the adapter models for the q kᵀ written (on a 4×4
    grid the positional part dominates; compared with the bare q kᵀ the write used to be undone)."""
    from structinit.adapters.survey import ModelSurvey

    model = structinit.create_model("convit_cpu_patch4_32", img_size=16)
    structinit.init_(model, "mimetic", seed=0)
    gpsa = [v for v in ModelSurvey(model).attention.verdicts if isinstance(v.adapter.module, GPSA)]
    assert gpsa and all(v.kind == "self" and v.checked for v in gpsa)
