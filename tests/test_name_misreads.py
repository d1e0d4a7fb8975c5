"""Attention whose attribute names mislead the adapter that claims it by them: q and k in each
other's roles, and a ``scale`` attribute the forward never applies. The adapter's maps then
differ from the module's in ways that look like a rotation by position or a per-head
temperature; the survey names what it sees and reads the layer again by what it computes, so
both schemes write it. Every claim is checked on the module's own forward (the maps it records)."""

import pytest
import torch
from torch import nn
from two_block_vit import TwoBlockViT, assert_own_maps_hit

import structinit
from structinit.adapters.provenance import TraceError
from structinit.adapters.registry import adapter_for
from structinit.adapters.traced import TracedAdapter


class NamedAttention(nn.Module):
    """Hugging Face's names (``q_proj`` … ``out_proj``, ``num_heads``, ``head_dim``, ``scale``).
    ``mode``: 'plain'; 'swapped', whose forward makes its queries with ``k_proj`` and its keys
    with ``q_proj``; 'unused-scale', whose ``scale`` attribute is 0.05 while the forward applies
    head_dim^-½; 'rotary', which rotates q and k by position (1-D RoPE on the token index)."""

    def __init__(self, dim, heads, mode="plain"):
        super().__init__()
        self.num_heads, self.head_dim, self.mode = heads, dim // heads, mode
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.scale = 0.05 if mode == "unused-scale" else self.head_dim**-0.5

    def forward(self, x):
        b, t, d = x.shape
        heads = [p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                 for p in (self.q_proj, self.k_proj, self.v_proj)]
        q, k, v = heads if self.mode != "swapped" else (heads[1], heads[0], heads[2])
        if self.mode == "rotary":
            q, k = _rotate(q), _rotate(k)
        probs = ((q @ k.transpose(-2, -1)) * self.head_dim**-0.5).softmax(-1)
        self.last_probs = probs.detach()
        return self.out_proj((probs @ v).transpose(1, 2).reshape(b, t, d))


def _rotate(t):
    """Rotary positions on the token index: channel pairs (2i, 2i + 1) turned by position · ω_i."""
    omega = 100.0 ** (-torch.arange(0, t.shape[-1], 2, dtype=t.dtype) / t.shape[-1])
    angle = torch.arange(t.shape[-2], dtype=t.dtype)[:, None] * omega
    a, b = t[..., 0::2], t[..., 1::2]
    return torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1).flatten(-2)


def _model(mode):
    torch.manual_seed(0)
    return TwoBlockViT(lambda dim, heads: NamedAttention(dim, heads, mode))


MISREAD = ("swapped", "unused-scale")


@pytest.mark.parametrize("mode", MISREAD)
def test_the_trace_reads_them_by_what_they_compute(mode):
    model = _model(mode)
    claimed = adapter_for(model.attns[0])
    assert claimed is not None and not isinstance(claimed, TracedAdapter)  # the names do claim it
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["attns.0", "attns.1"]
    for (_, ad), attn in zip(layers, model.attns):
        assert isinstance(ad, TracedAdapter)
        q_weight = ad.linear_views()["q"][0]
        makes_queries = attn.k_proj if mode == "swapped" else attn.q_proj
        assert q_weight.untyped_storage().data_ptr() == makes_queries.weight.untyped_storage().data_ptr()
        assert ad.scale == pytest.approx(attn.head_dim**-0.5, rel=1e-4)  # the one applied, not the attribute


@pytest.mark.parametrize("mode", MISREAD)
def test_impulse_makes_the_modules_own_maps_hit_their_targets(mode):
    model = _model(mode)
    structinit.init_(model, "impulse", seed=0, reserve="none")  # no MLP: nothing to reserve against
    assert_own_maps_hit(model)


@pytest.mark.parametrize("mode", MISREAD)
def test_mimetic_makes_the_modules_own_products_mimetic(mode):
    model = _model(mode)
    structinit.init_(model, "mimetic", seed=0)
    attn, d = model.attns[0], 48
    makes_queries, makes_keys = (attn.k_proj, attn.q_proj) if mode == "swapped" else (attn.q_proj, attn.k_proj)
    for h in range(attn.num_heads):  # W_q W_kᵀ of each head as the forward uses them: α Z + β I, diagonal-heavy
        rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
        product = (makes_queries.weight[rows].T @ makes_keys.weight[rows]).detach()
        assert float(product.diagonal().mean()) > 3 * float(product.abs().sum() - product.diagonal().abs().sum()) / (
            d * d - d)


@pytest.mark.parametrize(("mode", "words"), [
    ("swapped", "its logits are the transpose of the q kᵀ its projections give"),
    ("unused-scale", "the same for every head: the softmax scale it applies is not the one the module names"),
])
def test_where_the_trace_cannot_read_them_the_refusal_names_the_misread(mode, words, monkeypatch):
    def unreadable(*args, **kwargs):
        raise TraceError("no trace in this test")
    monkeypatch.setattr("structinit.adapters.verify.trace_attention", unreadable)
    model = _model(mode)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="impulse cannot set") as err:
        structinit.init_(model, "impulse", seed=0, reserve="none")
    assert words in str(err.value) and "rotated by position" not in str(err.value)
    assert "temperature" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_real_rotation_under_the_same_names_is_still_a_rotation():
    model = _model("rotary")
    with pytest.raises(ValueError, match="rotated by position"):
        structinit.init_(model, "impulse", seed=0, reserve="none")
    assert not any(isinstance(ad, TracedAdapter) for _, ad in structinit.find_attention_layers(model))
