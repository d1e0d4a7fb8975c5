"""Attention the trace reads but no structured init can write as it is laid out: each refusal
names the layout (heads made by softmaxes of their own, no output projection, a gated output)
and leaves the model bit-identical. The same layer written the usual way is initialised."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

import structinit


class _PerHeadLoop(nn.Module):
    """One q, k and v Linear per head, of ``widths`` channels each, a softmax per head in a loop,
    the heads joined and projected (``fused=True``: the same maths with one Linear per role)."""

    def __init__(self, dim, widths, bias=True, fused=False):
        super().__init__()
        self.widths, self.fused = list(widths), fused
        if fused:
            self.q, self.k, self.v = (nn.Linear(dim, sum(widths), bias=bias) for _ in range(3))
        else:
            self.qs, self.ks, self.vs = (nn.ModuleList(nn.Linear(dim, w, bias=bias) for w in widths) for _ in range(3))
        self.proj = nn.Linear(sum(widths), dim)

    def forward(self, x):
        if self.fused:
            parts = zip(*(t.split(self.widths, -1) for t in (self.q(x), self.k(x), self.v(x))))
        else:
            parts = ((q(x), k(x), v(x)) for q, k, v in zip(self.qs, self.ks, self.vs))
        heads = [(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ v for q, k, v in parts]
        return self.proj(torch.cat(heads, -1))


class _Head(nn.Module):
    """One head in a module of its own, as 'Let's build GPT' writes it: its own key, query and
    value, its own softmax, and no output projection."""

    def __init__(self, dim, width):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(dim, width, bias=False) for _ in range(3))

    def forward(self, x):
        q, k = self.query(x), self.key(x)
        return (q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5).softmax(-1) @ self.value(x)


class _HeadModules(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = nn.ModuleList(_Head(dim, dim // heads) for _ in range(heads))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(torch.cat([head(x) for head in self.heads], -1))


class _Fused(nn.Module):
    """Multi-head attention with one qkv Linear; ``output`` 'none' returns the joined heads with no
    projection, 'gated' multiplies them by sigmoid(gate(x)) before it; ``combine`` 'differential'
    weights the values by the map less λ times a second one (differential attention), 'self'
    by the map plus a learned share of each token's own value, 'reattention' by the maps mixed
    across heads by a (heads, heads) parameter and normalised across heads (DeepViT's), 'sampled'
    by the map's rows gathered in the order of the first token's attention (adaptive token
    sampling, keeping every token); ``dropout`` drops map entries even in eval mode (``F.dropout``
    called without ``training=``)."""

    def __init__(self, dim, heads, output="plain", combine="plain", dropout=0.0):
        super().__init__()
        self.h, self.output, self.combine, self.dropout = heads, output, combine, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.qk2 = nn.Linear(dim, 2 * dim) if combine == "differential" else None
        self.lam = nn.Parameter(torch.tensor(0.5)) if combine in ("differential", "self") else None
        mixer = torch.eye(heads) + 0.1 * torch.randn(heads, heads)
        self.mix = nn.Parameter(mixer) if combine == "reattention" else None
        self.proj = nn.Linear(dim, dim) if output != "none" else None
        self.gate = nn.Linear(dim, dim) if output == "gated" else None

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        probs = (q @ k.transpose(-2, -1) * (d // self.h) ** -0.5).softmax(-1)
        if self.combine == "differential":
            q2, k2 = self.qk2(x).reshape(b, t, 2, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            probs = probs - self.lam * (q2 @ k2.transpose(-2, -1) * (d // self.h) ** -0.5).softmax(-1)
        elif self.combine == "self":
            probs = (probs + self.lam * torch.eye(t)) / (1 + self.lam)
        elif self.combine == "reattention":
            probs = torch.einsum("bhij,hg->bgij", probs, self.mix)
            probs = nn.functional.layer_norm(probs.permute(0, 2, 3, 1), (self.h,)).permute(0, 3, 1, 2)
        elif self.combine == "sampled":
            order = probs[..., 0, :].argsort(-1, descending=True)  # (b, h, t): rows by the first token's attention
            probs = probs.gather(2, order[..., None].expand(-1, -1, -1, t))
        if self.dropout:
            probs = nn.functional.dropout(probs, self.dropout)  # training=True, the default: random in eval too
        out = (probs @ v).transpose(1, 2).reshape(b, t, d)
        if self.output == "none":
            return out
        return self.proj(out * torch.sigmoid(self.gate(x)) if self.gate is not None else out)


def _spectral(module):
    """``module`` with torch's hook-based spectral norm on its qkv projection (the weight remade
    from ``weight_orig`` before every forward; in train mode, a power iteration too)."""
    nn.utils.spectral_norm(module.qkv)
    return module


def _vit(attn):
    from attention_modules import SepViT

    torch.manual_seed(0)
    return SepViT(attn_cls=attn)


CASES = {
    "per-head loop": (lambda d, h: _PerHeadLoop(d, [d // h] * h),
                      r"it makes each head's map by a softmax of its own \(2 maps a call, of 16 channels each, as a "
                      r"loop over heads does\), where structinit reads a layer whose heads' maps one product of q and "
                      r"kᵀ makes, from one projection per role"),
    "per-head loop, no biases": (lambda d, h: _PerHeadLoop(d, [d // h] * h, bias=False),
                                 r"it makes each head's map by a softmax of its own \(2 maps a call, of 16 channels"),
    "a loop over the heads of one projection per role": (
        lambda d, h: _PerHeadLoop(d, [d // h] * h, fused=True), r"\(2 maps a call, of 16 channels each, as a loop"),
    "heads of different widths": (lambda d, h: _PerHeadLoop(d, [8, 24], fused=True),
                                  r"\(2 maps a call, of 8 and 24 channels, as a loop"),
    "a module per head": (_HeadModules,
                          r"blocks\.0\.attn\.heads\.0 \(_Head: a 64×64 softmax map; it has no output projection of its "
                          r"own: its output is its attention's context, which no parameter of the module acts on; if "
                          r"it is one head of several whose outputs another module joins and projects"),
    "no output projection": (lambda d, h: _Fused(d, h, "none"),
                             r"\(_Fused: a 64×64 softmax map; it has no output projection of its own: its output is "
                             r"its attention's context, which no parameter of the module acts on\)"),
    "a gated output": (lambda d, h: _Fused(d, h, "gated"),
                       r"its output multiplies the attention's context by a function of its tokens \(a gate: "
                       r"'proj\.weight', 'gate\.weight', 'gate\.bias' read both\), so the value path is not linear"),
    "a second map subtracted": (lambda d, h: _Fused(d, h, combine="differential"),
                                r"its softmax map goes through `sub` with another tensor before it weights the values "
                                r"\(another map subtracted, as differential attention does"),
    "each token's own value added to the map": (lambda d, h: _Fused(d, h, combine="self"),
                                                r"its softmax map goes through `add` with another tensor"),
    "maps mixed across heads by a parameter": (
        lambda d, h: _Fused(d, h, combine="reattention"),
        r"its softmax map is mixed across its heads by a \(2, 2\) parameter before it weights the values \(as "
        r"re-attention does\), so what weights them is no softmax\(q kᵀ\) map of its projections"),
    "rows of the map sampled": (lambda d, h: _Fused(d, h, combine="sampled"),
                                r"its softmax map has its rows gathered by indices its forward computes \(tokens "
                                r"sampled from it, as adaptive token sampling does\)"),
    "a weight a spectral_norm hook remakes each forward": (
        lambda d, h: _spectral(_Fused(d, h)), r"it computes weights from other parameters in its forward \(qkv\.weight "
                                              r"by spectral_norm\).*remove_spectral_norm\) and apply it again after"),
    "a dropout left on in eval mode": (lambda d, h: _Fused(d, h, dropout=0.3),
                                       r"it drops entries at random even in eval mode: `dropout\(…, p=0\.3\)` is "
                                       r"called with training=True \(F\.dropout's default\).*training=self\.training"),
}


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_layout_no_init_can_write_is_refused_by_name(case, scheme):
    """Each was refused, but for another reason than its own: a per-head loop for 'two biases' or
    'not its map applied to v', a module per head and a missing output projection for an output
    'that does not depend on the context', a gate as 'the sum of several projections'."""
    from rejection import check_rejected

    make, words = CASES[case]
    check_rejected(_vit(make), lambda m: structinit.init_(m, scheme, seed=0), ValueError, words)


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_the_same_attention_with_one_product_for_all_heads_is_written_and_checked(scheme):
    """Positive control: the same maths as one batched product of one projection per role is
    one layer the trace reads; both inits write it and check it in its own forward."""
    model = _vit(lambda d, h: _Fused(d, h))
    with pytest.warns(UserWarning, match="reserves nothing here") if scheme == "impulse" else contextlib.nullcontext():
        structinit.init_(model, scheme, seed=0)
    assert structinit.get_record(model, "init")["layers"] == ["blocks.0.attn", "blocks.1.attn"]
