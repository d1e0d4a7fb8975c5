"""Adapters translate per-head (heads, D, r) weights to and from each module's own storage."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from attention_modules import MyAdapter, MyAttn, SepAttention
from structinit.adapters import adapter_for
from structinit.schemes.plan import Plan

# ---------------------------------------------------------------------------------------------
# read / write round trip for every adapter kind
# ---------------------------------------------------------------------------------------------


def make_module(kind, dim, heads, bias):
    if kind == "fused":
        return structinit.models.vit.Attention(dim, heads, qkv_bias=bias)
    if kind == "separate":
        m = SepAttention(dim, heads)
        if not bias:
            for lin in (m.q_proj, m.k_proj, m.v_proj):
                lin.bias = None
        return m
    if kind == "mha":
        return nn.MultiheadAttention(dim, heads, bias=bias)
    m = MyAttn(dim, heads)
    if not bias:
        for lin in (m.wq, m.wk, m.wv):
            lin.bias = None
    return m


def module_qk(kind, module, x):
    """q, k as the module itself computes them, (B, T, D)."""
    if kind == "fused":
        d = module.qkv.in_features
        qkv = module.qkv(x)
        return qkv[..., :d], qkv[..., d:2 * d]
    if kind == "separate":
        return module.q_proj(x), module.k_proj(x)
    if kind == "mha":
        d = module.embed_dim
        b = module.in_proj_bias
        q = torch.nn.functional.linear(x, module.in_proj_weight[:d], None if b is None else b[:d])
        k = torch.nn.functional.linear(x, module.in_proj_weight[d:2 * d], None if b is None else b[d:2 * d])
        return q, k
    return module.wq(x), module.wk(x)


@settings(max_examples=24, deadline=None)
@given(
    kind=st.sampled_from(["fused", "separate", "mha", "custom"]),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 4]),
    bias=st.booleans(),
    with_qk_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_qk_and_vo_write_read_round_trip(kind, heads, head_dim, bias, with_qk_bias, seed):
    dim = heads * head_dim
    structinit.register_adapter(MyAttn, MyAdapter)
    try:
        module = make_module(kind, dim, heads, bias)
        ad = adapter_for(module)
    finally:
        structinit.unregister_adapter(MyAttn)
    assert ad is not None and (ad.num_heads, ad.head_dim, ad.dim) == (heads, head_dim, dim)
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(heads, dim, head_dim, generator=g)
    wk = torch.randn(heads, dim, head_dim, generator=g)
    bq = torch.randn(heads, head_dim, generator=g) if with_qk_bias else None
    bk = torch.randn(heads, head_dim, generator=g) if with_qk_bias else None
    v_before, _, o_before, _ = ad.read_vo()

    plan = Plan()
    plan.add_qk(ad, wq, wk, bq, bk)
    plan.commit()

    rq, rbq, rk, rbk = ad.read_qk()
    torch.testing.assert_close(rq, wq)
    torch.testing.assert_close(rk, wk)
    if bias:
        expect_q = bq if with_qk_bias else torch.zeros(heads, head_dim)
        expect_k = bk if with_qk_bias else torch.zeros(heads, head_dim)
        torch.testing.assert_close(rbq, expect_q)
        torch.testing.assert_close(rbk, expect_k)
    else:
        assert rbq is None and rbk is None
    v_after, _, o_after, _ = ad.read_vo()
    assert torch.equal(v_before, v_after) and torch.equal(o_before, o_after)

    # the module's own q/k for head h are x @ wq[h] (+ bq[h]): the per-head layout is right
    x = torch.randn(3, dim, generator=g)
    with torch.no_grad():
        q, k = module_qk(kind, module, x)
    for h in range(heads):
        sl = slice(h * head_dim, (h + 1) * head_dim)
        eq = x @ wq[h] + (rbq[h] if rbq is not None else 0)
        ek = x @ wk[h] + (rbk[h] if rbk is not None else 0)
        torch.testing.assert_close(q[:, sl], eq, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(k[:, sl], ek, rtol=1e-4, atol=1e-4)

    # value/output: x ↦ o(v(x)) with zero biases is x @ wv @ wo
    wv = torch.randn(dim, dim, generator=g)
    wo = torch.randn(dim, dim, generator=g)
    plan = Plan()
    plan.add(ad.vo_writes(wv, wo))
    plan.commit()
    rv, rbv, ro, rbo = ad.read_vo()
    torch.testing.assert_close(rv, wv)
    torch.testing.assert_close(ro, wo)
    for b in (rbv, rbo):
        assert b is None or torch.equal(b, torch.zeros_like(b))


def test_plan_is_lazy_until_commit():
    module = structinit.models.vit.Attention(8, 2)
    ad = adapter_for(module)
    before = module.qkv.weight.detach().clone()
    plan = Plan()
    plan.add_qk(ad, torch.ones(2, 8, 4), torch.ones(2, 8, 4), record={"offsets": [(0, 0), (0, 0)]})
    assert torch.equal(module.qkv.weight, before)
    assert not hasattr(module, "structinit_impulse")
    plan.commit()
    assert not torch.equal(module.qkv.weight, before)
    assert module.structinit_impulse == {"offsets": [(0, 0), (0, 0)]}
