"""The sequence models of structinit.models.sequence: MambaLM (optional mambapy) and the
causal transformer, and the attention schemes on the latter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import structinit
from structinit.models import CausalTransformer, MambaLM

PAIRS = [("mamba_seq_2x64", "gpt_seq_2x64"), ("mamba_seq_2x128", "gpt_seq_2x128")]


def needs_mambapy():
    pytest.importorskip("mambapy")


def build(name: str, vocab_size: int = 17, max_len: int = 32) -> torch.nn.Module:
    if name.startswith("mamba"):
        needs_mambapy()
    torch.manual_seed(0)
    return structinit.create_model(name, vocab_size=vocab_size, max_len=max_len).eval()


def body_params(model: torch.nn.Module) -> int:
    """Parameters other than the token embedding and the head (both vocab_size × D in each model)."""
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("embedding.", "head.")))


def test_registry_names():
    names = structinit.list_models()
    for pair in PAIRS:
        assert set(pair) <= set(names)


@pytest.mark.parametrize("name", [n for pair in PAIRS for n in pair])
def test_output_shape_and_dtype(name):
    model = build(name, vocab_size=23, max_len=40)
    tokens = torch.randint(23, (3, 40), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (3, 40, 23) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model(tokens[:, :7]).shape == (3, 7, 23)  # shorter inputs work too


@pytest.mark.parametrize("name", ["mamba_seq_2x64", "gpt_seq_2x64"])
def test_causal(name):
    """Changing the token at t changes no logit before t (and does change some at ≥ t)."""
    model = build(name, vocab_size=17, max_len=24)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(17, (2, 24), generator=g)
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 5, 23):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 1) % 17
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-5, rtol=1e-5)
            assert (out[:, t:] - base[:, t:]).abs().max() > 1e-4


def test_backward_reaches_every_parameter():
    for name in ("gpt_seq_2x64", "mamba_seq_2x64"):
        model = build(name).train()
        tokens = torch.randint(17, (2, 16), generator=torch.Generator().manual_seed(0))
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"{name}: no gradient for {missing}"


@pytest.mark.parametrize("mamba,gpt", PAIRS)
def test_parameter_counts_match(mamba, gpt):
    """At the same width the two models have within 25 % of each other's parameters (bodies,
    the transformer's position embedding for seq_len 128 included)."""
    m, t = build(mamba, vocab_size=256, max_len=128), build(gpt, vocab_size=256, max_len=128)
    ratio = body_params(t) / body_params(m)
    assert 0.8 < ratio < 1.25, (body_params(m), body_params(t))
    total = sum(p.numel() for p in t.parameters()) / sum(p.numel() for p in m.parameters())
    assert 0.8 < total < 1.25


def test_mamba_structure():
    model = build("mamba_seq_2x64", vocab_size=17)
    assert len(model.backbone.layers) == 2
    mixer = model.backbone.layers[0].mixer
    assert mixer.A_log.shape == (128, 16) and mixer.conv1d.weight.shape == (128, 1, 4)
    assert model.config.pscan and model.head.out_features == 17
    assert MambaLM(vocab_size=5, d_model=16, n_layers=1, max_len=999).config.d_model == 16  # max_len ignored


def test_transformer_structure_and_adapters():
    model = build("gpt_seq_2x64", max_len=32)
    assert isinstance(model, CausalTransformer) and model.pos_embed.shape == (1, 32, 64)
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["blocks.0.attn", "blocks.1.attn"]
    assert all(ad.num_heads == 2 and ad.head_dim == 32 for _, ad in layers)
    assert all(blk.attn.causal for blk in model.blocks)


def test_vit_attention_stays_bidirectional():
    vit = structinit.create_model("vit_micro_patch2_16")
    assert not any(blk.attn.causal for blk in vit.blocks)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_len=8"):
        build("gpt_seq_2x64", max_len=8)(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="LongTensor"):
        build("gpt_seq_2x64")(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="vocab_size=0"):
        CausalTransformer(vocab_size=0)
    with pytest.raises(ValueError, match="dim=64 is not divisible by num_heads=3"):
        CausalTransformer(vocab_size=4, num_heads=3)


def test_mambapy_missing_raises_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "mambapy.mamba", None)  # import mambapy.mamba → ImportError
    with pytest.raises(ImportError, match=r"MambaLM.*mambapy"):
        MambaLM(vocab_size=5)


def test_import_structinit_does_not_import_mambapy():
    code = "import sys, structinit; assert 'mambapy' not in sys.modules, 'mambapy imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


# ------------------------------------------------------------------ schemes on the transformer
def test_mimetic_on_causal_transformer():
    """QKᵀ per head is the rank-r truncation of αZ + βI (diagonal-dominant), W_v W_o = γZ − δI,
    biases zero; the embeddings, PE, norms, MLPs and head are untouched."""
    model = build("gpt_seq_2x128", max_len=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, "mimetic", seed=0)
    after = model.state_dict()
    d, r = 128, 32
    for _, ad in structinit.find_attention_layers(model):
        wq, bq, wk, bk = ad.read_qk()
        assert wq.shape == wk.shape == (4, d, r)
        assert torch.count_nonzero(bq) == 0 and torch.count_nonzero(bk) == 0
        for h in range(4):
            p = wq[h].double() @ wk[h].double().T
            diag, off = p.diagonal(), p - torch.diag(p.diagonal())
            assert diag.mean() > 5 * off.abs().sum() / (d * (d - 1))
            assert (p.argmax(1) == torch.arange(d)).double().mean() >= 0.95
            s = torch.linalg.svdvals(p)
            assert s[r:].max() < 1e-5 * s[0]  # rank r
        wv, bv, wo, bo = ad.read_vo()
        c = wv.double() @ wo.double()
        assert abs(c.trace().item() + 0.4 * d) < 0.03 * 0.4 * d  # γZ − δI, δ = 0.4
        assert (c.diagonal() < 0).all()
        assert torch.count_nonzero(bv) == 0 and torch.count_nonzero(bo) == 0
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {f"blocks.{i}.attn.{p}" for i in range(2) for p in ("qkv.weight", "qkv.bias", "proj.weight",
                                                                           "proj.bias")}


def test_mimetic_reproducible_and_model_still_causal():
    a, b = build("gpt_seq_2x64"), build("gpt_seq_2x64")
    torch.manual_seed(123)  # a different global state must not matter
    structinit.init_(a, "mimetic", seed=7)
    structinit.init_(b, "mimetic", seed=7)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    tokens = torch.randint(17, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 17
    with torch.no_grad():
        torch.testing.assert_close(a(changed)[:, :8], a(tokens)[:, :8])


@pytest.mark.parametrize("scheme", ["pytorch", "timm"])
def test_baseline_schemes_on_causal_transformer(scheme):
    model = build("gpt_seq_2x64")
    structinit.init_(model, scheme, seed=0)
    tokens = torch.randint(17, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(tokens)).all()


def test_attention_maps_of_the_causal_transformer_are_causal_and_match_its_forward():
    """structinit.attention_maps recomputes each layer's map from q/k: on a causal model it must
    apply the mask the forward applies (and on a ViT none)."""
    torch.manual_seed(0)
    model = CausalTransformer(vocab_size=11, max_len=12, embed_dim=32, depth=2, num_heads=2).eval()
    tokens = torch.randint(0, 11, (3, 12))
    maps = structinit.attention_maps(model, tokens)
    assert len(maps) == 2 and maps[0].shape == (3, 2, 12, 12)
    for m in maps:
        assert torch.equal(m.triu(1), torch.zeros_like(m))
        assert torch.allclose(m.sum(-1), torch.ones(3, 2, 12), atol=1e-6)
    # the map reproduces the block's attention output: softmax-weighted values, then proj
    attn = model.blocks[0].attn
    x = model.blocks[0].norm1(model.embedding(tokens) + model.pos_embed[:, :12])
    _, _, v = attn._qkv(x)
    out = attn.proj((maps[0] @ v).transpose(1, 2).reshape(3, 12, -1))
    assert torch.allclose(out, attn(x), atol=1e-5)
    vit = structinit.create_model("vit_micro_patch2_16")
    assert float(structinit.attention_maps(vit, torch.randn(1, 3, 16, 16))[0].triu(1).sum()) > 0
