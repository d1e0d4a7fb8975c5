"""Attention that takes its tokens sequence first, (T, B, D), with its heads folded into the
batch as fairseq's does: read by what it computes whether an adapter claims it by its names
(Hugging Face's) or none does, and written by both schemes. Every claim is checked on the
module's own forward (the maps it records)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from two_block_vit import TwoBlockViT, assert_own_maps_hit

import structinit
from rejection import check_rejected
from structinit.adapters.provenance import TraceError
from structinit.adapters.registry import adapter_for
from structinit.adapters.traced import TracedAdapter


class SequenceFirstAttention(nn.Module):
    """fairseq's layout: (T, B, D) in and out, q scaled before the product, (B·H, T, hd) maps by
    ``bmm``. ``named``: Hugging Face's attribute names (``q_proj`` … ``out_proj``), which an
    adapter claims; otherwise names none does."""

    def __init__(self, dim, heads, named):
        super().__init__()
        self.groups, self.head_dim = heads, dim // heads
        projections = [nn.Linear(dim, dim) for _ in range(4)]
        names = ("q_proj", "k_proj", "v_proj", "out_proj") if named else ("make_q", "make_k", "make_v", "merge")
        for name, projection in zip(names, projections):
            setattr(self, name, projection)
        self.roles = dict(zip("qkvo", names))
        if named:
            self.num_heads = heads

    def projection(self, role):
        return getattr(self, self.roles[role])

    def forward(self, x):
        t, b, d = x.shape
        q = self.projection("q")(x) * self.head_dim**-0.5
        q, k, v = (p.reshape(t, b * self.groups, self.head_dim).transpose(0, 1)
                   for p in (q, self.projection("k")(x), self.projection("v")(x)))
        probs = F.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
        self.last_probs = probs.detach().reshape(b, self.groups, t, t)
        return self.projection("o")(torch.bmm(probs, v).transpose(0, 1).reshape(t, b, d))


def _model(named):
    torch.manual_seed(0)
    return TwoBlockViT(lambda dim, heads: SequenceFirstAttention(dim, heads, named), sequence_first=True)


NAMED = pytest.mark.parametrize("named", [True, False], ids=["claimed-by-names", "no-adapter"])


@NAMED
def test_the_trace_reads_its_tokens_sequence_first(named):
    model = _model(named)
    assert (adapter_for(model.attns[0]) is not None) == named
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["attns.0", "attns.1"]
    for (_, ad), attn in zip(layers, model.attns):
        assert isinstance(ad, TracedAdapter) and ad.token_map.batch_axis == 1
        assert (ad.num_heads, ad.head_dim, ad.dim) == (3, 16, 48)
        x = torch.randn(64, 2, 48)
        assert torch.equal(ad.input_tokens((x,), {}), x.transpose(0, 1))
        assert ad.linear_views()["q"][0].data_ptr() == attn.projection("q").weight.data_ptr()


@NAMED
def test_impulse_makes_the_modules_own_maps_hit_their_targets(named):
    model = _model(named)
    structinit.init_(model, "impulse", seed=0, reserve="none")  # no MLP: nothing to reserve against
    assert_own_maps_hit(model)


@NAMED
def test_mimetic_makes_each_heads_product_diagonal_heavy(named):
    model = _model(named)
    structinit.init_(model, "mimetic", seed=0)
    attn = model.attns[0]
    for h in range(attn.groups):  # W_q W_kᵀ of each head: α Z + β I, its diagonal well above the rest
        rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
        product = (attn.projection("q").weight[rows].T @ attn.projection("k").weight[rows]).detach()
        off = (product.abs().sum() - product.diagonal().abs().sum()) / (48 * 47)
        assert float(product.diagonal().mean()) > 3 * float(off)


def test_where_the_trace_cannot_read_it_the_refusal_says_sequence_first(monkeypatch):
    def unreadable(*args, **kwargs):
        raise TraceError("no trace in this test")
    monkeypatch.setattr("structinit.adapters.verify.trace_attention", unreadable)
    message = check_rejected(_model(True), lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"),
                             ValueError, "impulse cannot set")
    assert "sequence first, (T, B, D)" in message and "linear or factorised" not in message


def test_its_token_map_reads_a_batch_and_an_unbatched_call_alike():
    model = _model(False)
    (_, ad), *_ = structinit.find_attention_layers(model)
    x = torch.randn(64, 2, 48)
    assert torch.equal(ad.token_map.tokens(x[:, 1]), x[:, 1][None])  # (T, D): one image, its tokens as they are
    assert torch.equal(ad.token_map.tokens(x)[1], x[:, 1])
