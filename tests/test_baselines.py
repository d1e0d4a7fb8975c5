"""Baseline initialisations: the statistics each scheme documents.

Every test first scrambles all trainable parameters (non-zero mean, large std), so that the
checked statistics can only come from the scheme, not from the model's constructor (which
already uses PyTorch's defaults)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import structinit
from rejection import check_rejected
from structinit.schemes.registry import SCHEMES

BASELINES = ["pytorch", "timm", "jax", "xavier", "xavier_fused", "trunc_normal", "kaiming_uniform"]
D = 192


def vit(**kw):
    opts = dict(img_size=32, patch_size=4, embed_dim=D, depth=2, num_heads=3, num_classes=10,
                class_token=True, global_pool="token", pos_embed="learn")
    opts.update(kw)
    return structinit.VisionTransformer(**opts)


def scramble(model: nn.Module, seed: int = 123) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 1.3 + 0.37)
    return model


def init(scheme, seed=0, model=None, **opts):
    model = scramble(vit() if model is None else model)
    structinit.init_(model, scheme, seed=seed, **opts)
    return model


def linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def assert_std(t: torch.Tensor, expected: float, rel: float = 0.05, what: str = ""):
    std = t.detach().double().std().item()
    assert abs(std - expected) <= rel * expected, f"{what}: std {std:.6g}, expected {expected:.6g}"


def assert_uniform(t: torch.Tensor, bound: float, what: str = "", rel: float = 0.05):
    """U(−bound, bound): inside the bound, std bound/√3, and reaching close to the bound."""
    a = t.detach().double()
    assert a.abs().max().item() <= bound * (1 + 1e-6), what
    assert a.abs().max().item() >= 0.9 * bound, what
    assert abs(a.mean().item()) < 0.1 * bound, what
    assert_std(a, bound / math.sqrt(3), rel, what)


def assert_layernorms_reset(model):
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms
    for m in norms:
        assert torch.equal(m.weight.detach(), torch.ones_like(m.weight))
        assert torch.equal(m.bias.detach(), torch.zeros_like(m.bias))


def truncated_normal_std(std: float, a: float, b: float) -> float:
    """Std of N(0, std²) truncated to [a, b]."""
    phi = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    al, be = a / std, b / std
    z = cdf(be) - cdf(al)
    mean = (phi(al) - phi(be)) / z
    var = 1 + (al * phi(al) - be * phi(be)) / z - mean**2
    return std * math.sqrt(var)


# --------------------------------------------------------------------------- per scheme
def test_pytorch_defaults():
    model = init("pytorch")
    for name, m in linears(model):
        bound = 1 / math.sqrt(m.in_features)
        assert_uniform(m.weight, bound, name)
        b = m.bias.detach()
        assert b.abs().max().item() <= bound and torch.count_nonzero(b) == b.numel(), name
        if b.numel() >= 192:
            assert_std(b, bound / math.sqrt(3), 0.15, name + ".bias")
    conv = model.patch_embed.proj
    bound = 1 / math.sqrt(3 * 4 * 4)
    assert_uniform(conv.weight, bound, "conv")
    assert conv.bias.abs().max().item() <= bound and torch.count_nonzero(conv.bias) == D
    assert_layernorms_reset(model)
    assert_std(model.pos_embed, 0.02, what="pos_embed")
    assert abs(model.pos_embed.mean().item()) < 0.002
    assert torch.count_nonzero(model.cls_token) == 0


def test_timm():
    model = init("timm")
    for name, m in linears(model):
        assert_std(m.weight, 0.02, what=name)
        assert abs(m.weight.mean().item()) < 0.002, name
        assert torch.count_nonzero(m.bias) == 0, name
    conv = model.patch_embed.proj  # timm leaves the patch embedding at PyTorch's default
    bound = 1 / math.sqrt(3 * 4 * 4)
    assert_uniform(conv.weight, bound, "conv")
    assert conv.bias.abs().max().item() <= bound
    assert_std(model.pos_embed, 0.02, what="pos_embed")
    cls = model.cls_token.detach()
    assert torch.count_nonzero(cls) == cls.numel()
    assert 1e-7 < cls.std().item() < 1e-5
    assert_layernorms_reset(model)


def test_jax():
    model = init("jax")
    assert torch.count_nonzero(model.head.weight) == 0
    assert torch.count_nonzero(model.head.bias) == 0
    for name, m in linears(model):
        if name == "head":
            continue
        fan_in, fan_out = m.in_features, m.out_features  # the fused qkv counts as one 3D×D matrix
        assert_uniform(m.weight, math.sqrt(6 / (fan_in + fan_out)), name)
        assert_std(m.weight, math.sqrt(2 / (fan_in + fan_out)), what=name)
        b = m.bias.detach()
        if ".mlp." in name:  # N(0, 1e-6²)
            assert torch.count_nonzero(b) == b.numel(), name
            assert b.abs().max().item() < 1e-5, name
            assert_std(b, 1e-6, 0.25, name + ".bias")
        else:
            assert torch.count_nonzero(b) == 0, name
    qkv = model.blocks[0].attn.qkv.weight
    assert_std(qkv, math.sqrt(2 / (D + 3 * D)), what="fused qkv")
    conv = model.patch_embed.proj  # LeCun normal: std √(1/fan_in) after truncation at ±2σ'
    fan_in = 3 * 4 * 4
    assert_std(conv.weight, math.sqrt(1 / fan_in), what="conv")
    assert conv.weight.abs().max().item() <= 2 * math.sqrt(1 / fan_in) / 0.87962566103423978 + 1e-6
    assert torch.count_nonzero(conv.bias) == 0
    assert_std(model.pos_embed, 0.02, what="pos_embed")
    assert_layernorms_reset(model)


def _qkv_blocks(model):
    for i, blk in enumerate(model.blocks):
        w = blk.attn.qkv.weight.detach()
        yield i, [w[j * D:(j + 1) * D] for j in range(3)]


def test_xavier_fused():
    model = init("xavier_fused")
    for i, blocks in _qkv_blocks(model):
        for j, w in enumerate(blocks):
            assert_uniform(w, math.sqrt(6 / (D + 3 * D)), f"block {i} {'qkv'[j]}")
    for name, m in linears(model):
        if not name.endswith("qkv"):
            assert_uniform(m.weight, math.sqrt(6 / (m.in_features + m.out_features)), name)
        assert torch.count_nonzero(m.bias) == 0, name


def test_xavier_per_block():
    model = init("xavier")
    for i, blocks in _qkv_blocks(model):
        for j, w in enumerate(blocks):
            assert_uniform(w, math.sqrt(6 / (D + D)), f"block {i} {'qkv'[j]}")
        assert not torch.equal(blocks[0], blocks[1])  # independent draws
    for name, m in linears(model):
        if not name.endswith("qkv"):
            assert_uniform(m.weight, math.sqrt(6 / (m.in_features + m.out_features)), name)
        assert torch.count_nonzero(m.bias) == 0, name
    assert_layernorms_reset(model)


def test_xavier_and_xavier_fused_differ_only_in_qkv_scale():
    fused, per_block = init("xavier_fused"), init("xavier")
    ratio = per_block.blocks[0].attn.qkv.weight.std() / fused.blocks[0].attn.qkv.weight.std()
    assert abs(ratio.item() - math.sqrt(2)) < 0.05  # √(2/(2D)) / √(2/(4D))


def test_trunc_normal_default_bounds():
    model = init("trunc_normal", std=0.05)
    for name, m in linears(model):
        assert_std(m.weight, 0.05, what=name)
        assert m.weight.abs().max().item() <= 2.0
        assert torch.count_nonzero(m.bias) == 0, name
    assert_std(model.pos_embed, 0.02, what="pos_embed")


@pytest.mark.parametrize("a,b", [(-0.06, 0.06), (-0.02, 0.1)])
def test_trunc_normal_tight_bounds(a, b):
    model = init("trunc_normal", std=0.05, a=a, b=b)
    expected = truncated_normal_std(0.05, a, b)
    for name, m in linears(model):
        w = m.weight.detach()
        assert w.min().item() >= a and w.max().item() <= b, name
        assert w.min().item() < a + 0.1 * (b - a) and w.max().item() > b - 0.1 * (b - a), name
        if w.numel() > 10_000:
            assert_std(w, expected, what=name)
    if a + b > 0:
        assert model.blocks[0].mlp.fc1.weight.mean().item() > 0


@pytest.mark.parametrize("opts, match", [(dict(std=0.0), r"std=0\.0"), (dict(std=-1), r"std=-1"),
                                         (dict(std=0.02, a=0.1, b=-0.1), r"a=0\.1, b=-0\.1.*a < b"),
                                         (dict(std="wide"), r"std='wide'")])
def test_trunc_normal_rejects_bad_parameters(opts, match):
    check_rejected(scramble(vit()), lambda m: structinit.init_(m, "trunc_normal", seed=0, **opts), ValueError, match)


@pytest.mark.parametrize("opts,bound_fn", [
    (dict(a=0, nonlinearity="relu"), lambda fi, fo: math.sqrt(6 / fi)),
    (dict(a=0, nonlinearity="relu", mode="fan_out"), lambda fi, fo: math.sqrt(6 / fo)),
    ({}, lambda fi, fo: 1 / math.sqrt(fi)),  # PyTorch's Linear default: a = √5, leaky_relu
])
def test_kaiming_uniform(opts, bound_fn):
    model = init("kaiming_uniform", **opts)
    for name, m in linears(model):
        assert_uniform(m.weight, bound_fn(m.in_features, m.out_features), name)
        assert torch.count_nonzero(m.bias) == 0, name
    assert_layernorms_reset(model)


@pytest.mark.parametrize("opts, match", [(dict(mode="fan_avg"), r"mode='fan_avg'.*fan_in"),
                                         (dict(nonlinearity="swish"), r"nonlinearity='swish'.*relu")])
def test_kaiming_uniform_rejects_bad_options(opts, match):
    check_rejected(vit(), lambda m: structinit.init_(m, "kaiming_uniform", seed=0, **opts), ValueError, match)


# --------------------------------------------------------------------------- all baselines
@pytest.mark.parametrize("scheme", BASELINES)
def test_fixed_sincos_pos_embed_untouched(scheme):
    model = scramble(vit(class_token=False, global_pool="avg", pos_embed="sincos"))
    table = structinit.sincos_2d((8, 8), D)
    assert torch.equal(model.pos_embed[0].detach(), table)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, scheme, seed=0)
    assert torch.equal(model.pos_embed[0].detach(), table)
    assert not model.pos_embed.requires_grad
    after = model.state_dict()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert set(changed) == set(after) - {"pos_embed"}  # every trainable tensor is written


@pytest.mark.parametrize("scheme", BASELINES)
def test_every_trainable_tensor_written_and_forward_finite(scheme):
    model = scramble(vit())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, scheme, seed=0)
    for k, v in model.state_dict().items():
        assert not torch.equal(v, before[k]), k
        assert torch.isfinite(v).all(), k
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("scheme", BASELINES)
def test_baselines_clear_impulse_records(scheme):
    model = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(model, "impulse", seed=0)
    structinit.init_(model, scheme, seed=0)
    assert not any(hasattr(b.attn, "structinit_impulse") for b in model.blocks)


# --------------------------------------------------------------------------- torch.nn attention
def encoder(d=64, heads=4, layers=2):
    layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


@pytest.mark.parametrize("scheme", BASELINES)
def test_transformer_encoder_layer_with_every_baseline(scheme):
    model = scramble(encoder())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, scheme, seed=0)
    after = model.state_dict()
    for k in after:
        assert torch.isfinite(after[k]).all(), k
        assert not torch.equal(after[k], before[k]), k
    for layer in model.layers:
        norm = layer.norm1
        assert torch.equal(norm.weight.detach(), torch.ones(64)) and torch.count_nonzero(norm.bias) == 0
        assert torch.count_nonzero(layer.self_attn.in_proj_bias) == 0
    w = model.layers[0].self_attn.in_proj_weight.detach()
    blocks = [w[i * 64:(i + 1) * 64] for i in range(3)]
    expected = {
        "xavier": math.sqrt(2 / (64 + 64)), "xavier_fused": math.sqrt(2 / (64 + 192)),
        "jax": math.sqrt(2 / (64 + 192)), "pytorch": math.sqrt(2 / (64 + 192)),
        "timm": 0.02, "trunc_normal": 0.02, "kaiming_uniform": 1 / math.sqrt(3 * 64),
    }[scheme]
    for blk in blocks:
        assert_std(blk, expected, rel=0.1, what=f"{scheme} in_proj block")
    x = torch.randn(2, 9, 64)
    y = model(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("scheme", BASELINES)
def test_bare_multihead_attention_as_the_model(scheme):
    """A bare nn.MultiheadAttention is a valid model (its adapter is found at the root)."""
    mha = scramble(nn.MultiheadAttention(64, 4, batch_first=True))
    assert [name for name, _ in structinit.find_attention_layers(mha)] == [""]
    before = {k: v.clone() for k, v in mha.state_dict().items()}
    structinit.init_(mha, scheme, seed=0)
    for k, v in mha.state_dict().items():
        assert torch.isfinite(v).all(), k
        assert not torch.equal(v, before[k]), k
    assert torch.count_nonzero(mha.in_proj_bias) == 0
    assert mha.in_proj_weight.std().item() < 0.2  # no longer the scrambled N(0.37, 1.3²)
    x = torch.randn(2, 5, 64)
    out, _ = mha(x, x, x)
    assert torch.isfinite(out).all()


def test_pytorch_scheme_zero_out_proj_bias_like_fresh_multihead_attention():
    """'pytorch' documents "PyTorch's own defaults … MultiheadAttention Xavier + zero bias":
    a freshly constructed nn.MultiheadAttention has zero in_proj_bias *and* zero out_proj.bias
    (MultiheadAttention._reset_parameters zeroes both after out_proj's own Linear init)."""
    fresh = encoder()
    for m in fresh.modules():
        if isinstance(m, nn.MultiheadAttention):
            assert torch.count_nonzero(m.in_proj_bias) == 0 and torch.count_nonzero(m.out_proj.bias) == 0
    model = scramble(encoder())
    structinit.init_(model, "pytorch", seed=0)
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            assert_uniform(m.in_proj_weight, math.sqrt(6 / (64 + 192)), "in_proj (xavier, fused)")
            assert_uniform(m.out_proj.weight, 1 / math.sqrt(64), "out_proj")
            assert torch.count_nonzero(m.in_proj_bias) == 0
            assert torch.count_nonzero(m.out_proj.bias) == 0, "out_proj.bias re-drawn after the MHA reset"


class _ResetsThenFails(nn.Module):
    """A module whose own reset_parameters fails after its children have been reset (the
    ``pytorch`` scheme resets children before parents), with a counter buffer it bumps first."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        self.register_buffer("resets", torch.zeros((), dtype=torch.long))

    def reset_parameters(self):
        self.resets += 1
        raise RuntimeError("this model's own init failed")


def test_a_reset_that_raises_leaves_the_model_as_it_was():
    """Module code the ``pytorch`` scheme runs at commit can fail halfway; every tensor it had
    already written (the children's resets, the buffer) is restored, so nothing is half-done."""
    check_rejected(scramble(_ResetsThenFails()), lambda m: structinit.init_(m, "pytorch", seed=0),
                   RuntimeError, "own init failed")


def test_a_registered_scheme_that_raises_leaves_the_model_as_it_was():
    @structinit.register_scheme("test_half_then_fail")
    def half_then_fail(model, value: float = 1.0):
        with torch.no_grad():
            next(model.parameters()).fill_(value)
        raise ValueError("failed after its first write")

    try:
        model = scramble(encoder())
        check_rejected(model, lambda m: structinit.init_(m, "test_half_then_fail"), ValueError, "first write")
    finally:
        SCHEMES.pop(("model", "test_half_then_fail"))
