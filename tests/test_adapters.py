"""Every adapter kind (fused qkv, separate q/k/v, nn.MultiheadAttention, user-registered) reads
and writes the per-head layout consistently, so impulse init gives maps that peak on target."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from structinit.adapters import adapter_for
from structinit.schemes.base import Plan

# ---------------------------------------------------------------------------------------------
# small models, one per adapter kind
# ---------------------------------------------------------------------------------------------


def mha_probs(q, k, heads):
    """(B, T, D) q/k → (B, heads, T, T) softmax(q kᵀ/√r), heads contiguous."""
    b, t, d = q.shape
    r = d // heads
    q = q.reshape(b, t, heads, r).transpose(1, 2)
    k = k.reshape(b, t, heads, r).transpose(1, 2)
    return (q @ k.transpose(-2, -1) / math.sqrt(r)).softmax(-1)


class SepAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        self.last_attn = None

    def forward(self, x):
        b, t, d = x.shape
        attn = mha_probs(self.q_proj(x), self.k_proj(x), self.num_heads)
        self.last_attn = attn.detach()
        v = self.v_proj(x).reshape(b, t, self.num_heads, -1).transpose(1, 2)
        return self.o_proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class Patchify(nn.Module):
    def __init__(self, img, patch, dim, chans=3):
        super().__init__()
        self.proj = nn.Conv2d(chans, dim, patch, stride=patch)
        self.grid_size = (img[0] // patch, img[1] // patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, attn, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = attn

    def forward(self, x):
        return x + self.attn(self.norm(x))


class SepViT(nn.Module):
    """ViT-like model whose attention has separate q/k/v projections."""

    def __init__(self, img=(16, 16), patch=2, dim=32, heads=2, depth=2, attn_cls=SepAttention):
        super().__init__()
        self.patch_embed = Patchify(img, patch, dim)
        self.pos_embed = nn.Parameter(structinit.sincos_2d(self.patch_embed.grid_size, dim)[None])
        self.blocks = nn.Sequential(*[Block(attn_cls(dim, heads), dim) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.patch_embed(x) + self.pos_embed).mean(1)


class EncoderNet(nn.Module):
    """Conv patchify + pos_embed + nn.TransformerEncoder (nn.MultiheadAttention inside); the
    grid is 4×6 (not square), so it is not inferable and must be given."""

    def __init__(self, batch_first=True, dim=32, heads=2, depth=2):
        super().__init__()
        self.batch_first = batch_first
        self.proj = nn.Conv2d(3, dim, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 24, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=batch_first, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)

    def forward(self, img):
        x = self.proj(img).flatten(2).transpose(1, 2) + self.pos_embed
        if not self.batch_first:
            x = x.transpose(0, 1)
        x = self.encoder(x)
        return x.mean(1 if self.batch_first else 0)


GRID46 = (4, 6)
IMG46 = (8, 12)


def all_hit(fid):
    return bool((fid["hit"] == 1).all())


# ---------------------------------------------------------------------------------------------
# fused qkv (our ViT)
# ---------------------------------------------------------------------------------------------


def test_fused_vit_impulse_hits_every_head():
    model = structinit.create_model("vit_micro_patch2_16")
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["blocks.0.attn", "blocks.1.attn"]
    assert all(isinstance(ad, structinit.FusedQKVAdapter) for _, ad in layers)
    structinit.init_(model, "impulse", seed=0)
    fid = structinit.impulse_fidelity(model)
    assert fid["hit"].shape == (2, 2)
    assert all_hit(fid), fid


# ---------------------------------------------------------------------------------------------
# separate q/k/v
# ---------------------------------------------------------------------------------------------


def test_separate_qkv_impulse_and_maps_match_forward():
    torch.manual_seed(0)
    model = SepViT()
    layers = structinit.find_attention_layers(model)
    assert len(layers) == 2
    assert all(isinstance(ad, structinit.SeparateQKVAdapter) for _, ad in layers)
    structinit.impulse_init_(model, seed=0, offsets=[(0, 1), (-1, -1)])
    fid = structinit.impulse_fidelity(model, images=None)
    assert all_hit(fid), fid
    x = torch.randn(2, 3, 16, 16)
    maps = structinit.attention_maps(model, x)
    for m, (_, ad) in zip(maps, layers):
        assert m.shape == (2, 2, 64, 64)
        torch.testing.assert_close(m, ad.module.last_attn, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention inside nn.TransformerEncoderLayer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_impulse_hits_every_head(batch_first):
    torch.manual_seed(1)
    model = EncoderNet(batch_first=batch_first)
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert all(isinstance(ad, structinit.MultiheadAttentionAdapter) for _, ad in layers)
    with pytest.raises(ValueError, match=r"grid="):
        structinit.impulse_init_(model, seed=0)
    structinit.impulse_init_(model, grid=GRID46, seed=3)
    fid = structinit.impulse_fidelity(model, images=None, grid=GRID46)
    assert fid["hit"].shape == (2, 2)
    assert all_hit(fid), fid


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_maps_equal_mha_weights(batch_first):
    torch.manual_seed(2)
    model = EncoderNet(batch_first=batch_first)
    structinit.impulse_init_(model, grid=GRID46, seed=0)
    model.eval()
    captured = []
    mhas = [layer.self_attn for layer in model.encoder.layers]
    handles = [m.register_forward_pre_hook(lambda mod, args: captured.append(args[0].detach())) for m in mhas]
    x = torch.randn(3, 3, *IMG46)
    try:
        maps = structinit.attention_maps(model, x)
    finally:
        for h in handles:
            h.remove()
    assert len(captured) == 2
    for m, mha, inp in zip(maps, mhas, captured):
        with torch.no_grad():
            _, w = mha(inp, inp, inp, need_weights=True, average_attn_weights=False)
        assert m.shape == w.shape == (3, 2, 24, 24)
        torch.testing.assert_close(m, w, rtol=1e-5, atol=1e-6)


def test_multihead_attention_maps_single_layer_direct():
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x)[0]

    x = torch.randn(2, 5, 16)
    maps = structinit.attention_maps(One(), x)
    _, w = mha(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(maps[0], w.detach(), rtol=1e-5, atol=1e-6)


class KdimNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.randn(1, 16, 32))
        self.mha = nn.MultiheadAttention(32, 2, kdim=16, vdim=16, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x)[0]


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_multihead_attention_with_kdim_is_not_self_attention(scheme):
    """The MHA adapter claims to handle separate in-projections, which torch only creates when
    kdim/vdim ≠ embed_dim, i.e. for cross-attention. Such a module cannot be initialised as
    self-attention: the request must fail with a clear (ValueError) message naming the
    problem, and the model must be untouched."""
    model = KdimNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"kdim|vdim|self-attention"):
        structinit.init_(model, scheme, seed=0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------
# user-registered adapters
# ---------------------------------------------------------------------------------------------


class MyAttn(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)
        self.last_attn = None

    def forward(self, x):
        b, t, d = x.shape
        attn = mha_probs(self.wq(x), self.wk(x), self.h)
        self.last_attn = attn.detach()
        v = self.wv(x).reshape(b, t, self.h, -1).transpose(1, 2)
        return self.wo((attn @ v).transpose(1, 2).reshape(b, t, d))


class MyAdapter(structinit.AttentionAdapter):
    def __init__(self, module):
        self.module = module
        self.num_heads = module.h
        self.dim = module.wq.in_features
        self.head_dim = module.wq.out_features // module.h
        self.scale = self.head_dim**-0.5

    def linear_views(self):
        m = self.module
        return {n: (lin.weight, lin.bias) for n, lin in zip("qkvo", (m.wq, m.wk, m.wv, m.wo))}


@pytest.fixture
def registered():
    structinit.register_adapter(MyAttn, MyAdapter)
    try:
        yield
    finally:
        structinit.unregister_adapter(MyAttn)


def test_unknown_attention_class_is_rejected_before_registration():
    model = SepViT(attn_cls=MyAttn)
    with pytest.raises(ValueError, match=r"register_adapter") as info:
        structinit.find_attention_layers(model)
    assert "MyAttn" in str(info.value)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"register_adapter"):
        structinit.impulse_init_(model, seed=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_registered_adapter_impulse_and_fidelity(registered):
    model = SepViT(attn_cls=MyAttn)
    layers = structinit.find_attention_layers(model)
    assert len(layers) == 2 and all(isinstance(ad, MyAdapter) for _, ad in layers)
    structinit.impulse_init_(model, seed=0, offsets=[(1, 0), (0, -1)])
    assert all_hit(structinit.impulse_fidelity(model))
    x = torch.randn(2, 3, 16, 16)
    for m, (_, ad) in zip(structinit.attention_maps(model, x), layers):
        torch.testing.assert_close(m, ad.module.last_attn, rtol=1e-5, atol=1e-6)


def test_unregister_restores_rejection():
    structinit.register_adapter(MyAttn, MyAdapter)
    structinit.unregister_adapter(MyAttn)
    with pytest.raises(ValueError, match=r"register_adapter"):
        structinit.find_attention_layers(SepViT(attn_cls=MyAttn))


def test_register_adapter_with_predicate(registered):
    calls = []

    def is_my_attn(m):
        calls.append(type(m).__name__)
        return isinstance(m, MyAttn)

    structinit.register_adapter(is_my_attn, MyAdapter)
    try:
        assert len(structinit.find_attention_layers(SepViT(attn_cls=MyAttn))) == 2
        assert "MyAttn" in calls
    finally:
        structinit.unregister_adapter(is_my_attn)


def test_register_adapter_rejects_non_callable_target():
    with pytest.raises(TypeError, match=r"target="):
        structinit.register_adapter(42, MyAdapter)


# ---------------------------------------------------------------------------------------------
# what is and is not attention
# ---------------------------------------------------------------------------------------------


def test_model_without_attention_names_type_and_suggests_register_adapter():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"Sequential") as info:
        structinit.find_attention_layers(model)
    assert "register_adapter" in str(info.value)


class AttentionBlock(nn.Module):
    """Class name says attention, has its own weights, but merely wraps a supported module."""

    def __init__(self, dim=16):
        super().__init__()
        self.gate = nn.Linear(dim, dim)
        self.scale_param = nn.Parameter(torch.ones(dim))
        self.mha = nn.MultiheadAttention(dim, 2, batch_first=True)

    def forward(self, x):
        return self.mha(self.gate(x), x, x)[0] * self.scale_param


def test_wrapper_named_attention_containing_mha_is_not_flagged():
    model = nn.Sequential(AttentionBlock(), AttentionBlock())
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["0.mha", "1.mha"]


def test_root_model_named_attention_containing_mha_is_not_flagged():
    """The same wrapper used as the model itself (the root module, whose name is '')."""
    layers = structinit.find_attention_layers(AttentionBlock())
    assert [n for n, _ in layers] == ["mha"]


def test_children_of_a_matched_module_are_not_searched():
    # SepAttention matches; an inner module that would also match must not be listed twice
    outer = SepAttention(16, 2)
    outer.inner = nn.MultiheadAttention(16, 2)
    layers = structinit.find_attention_layers(nn.Sequential(outer))
    assert [n for n, _ in layers] == ["0"]


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


# ---------------------------------------------------------------------------------------------
# layout inference
# ---------------------------------------------------------------------------------------------


class PosOnly(nn.Module):
    def __init__(self, rows, dim=8, cls=False, reg=0, no_embed_class=False):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, rows, dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if cls else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg, dim)) if reg else None
        self.no_embed_class = no_embed_class


def test_layout_from_patch_embed_grid_size():
    model = structinit.create_model("vit_micro_patch2_16")
    assert structinit.infer_layout(model) == structinit.TokenLayout((8, 8), 0)
    cls = structinit.create_model("vit_micro_patch2_16", img_size=12, class_token=True, global_pool="token")
    lay = structinit.infer_layout(cls)
    assert lay.grid == (6, 6) and lay.num_prefix_tokens == 1 and lay.num_patches == 36


def test_layout_patch_embed_wins_over_pos_embed_shape():
    model = SepViT(img=(8, 12))  # grid 4×6 from patch_embed, pos_embed has 24 rows
    assert structinit.infer_layout(model).grid == (4, 6)


@settings(max_examples=20, deadline=None)
@given(side=st.integers(1, 12), cls=st.booleans(), reg=st.integers(0, 3), no_embed_class=st.booleans())
def test_layout_from_square_pos_embed(side, cls, reg, no_embed_class):
    prefix = int(cls) + reg
    rows = side * side + (0 if no_embed_class else prefix)
    model = PosOnly(rows, cls=cls, reg=reg, no_embed_class=no_embed_class)
    lay = structinit.infer_layout(model)
    assert lay.grid == (side, side)
    assert lay.num_prefix_tokens == prefix


def test_explicit_grid_and_prefix_win():
    model = structinit.create_model("vit_micro_patch2_16")
    assert structinit.infer_layout(model, grid=(4, 16)).grid == (4, 16)
    assert structinit.infer_layout(model, num_prefix_tokens=2).num_prefix_tokens == 2
    assert structinit.infer_layout(PosOnly(24), grid=(4, 6)).grid == (4, 6)


@settings(max_examples=20, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9))
def test_non_square_pos_embed_without_grid_raises(h, w):
    n = h * w
    if math.isqrt(n) ** 2 == n:
        n += 1  # make it non-square
    with pytest.raises(ValueError, match=r"grid=") as info:
        structinit.infer_layout(PosOnly(n))
    assert "PosOnly" in str(info.value)


def test_no_pos_embed_no_patch_embed_raises():
    with pytest.raises(ValueError, match=r"grid="):
        structinit.infer_layout(nn.Linear(3, 3))


@pytest.mark.parametrize("grid", [(0, 4), (4, -1), (4,), (1, 2, 3)])
def test_invalid_explicit_grid_raises(grid):
    with pytest.raises(ValueError, match=r"grid="):
        structinit.infer_layout(nn.Linear(3, 3), grid=grid)


@pytest.mark.parametrize("grid", [(4.5, 4), (4, 3.9)])
def test_non_integer_explicit_grid_is_rejected_not_truncated(grid):
    """The message promises 'two positive ints'; a float grid must not be silently truncated."""
    with pytest.raises((TypeError, ValueError), match=r"grid="):
        structinit.infer_layout(nn.Linear(3, 3), grid=grid)


def test_layer_skipped_by_forward_is_an_error_not_a_silent_gap():
    """A registered attention layer that the forward pass never calls (unused, or bypassed by a
    fused fast path) cannot have its maps captured: both diagnostics must say so by name."""

    class TwoAttn(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_embed = nn.Parameter(structinit.sincos_2d((4, 4), 32)[None])
            self.used = nn.MultiheadAttention(32, 2, batch_first=True)
            self.unused = nn.MultiheadAttention(32, 2, batch_first=True)

        def forward(self, x):
            x = x + self.pos_embed
            return self.used(x, x, x)[0]

    model = TwoAttn()
    structinit.init_(model, "impulse", seed=0, grid=(4, 4))
    x = torch.randn(2, 16, 32)
    with pytest.raises(RuntimeError, match="unused"):
        structinit.attention_maps(model, x)
    with pytest.raises(RuntimeError, match="unused"):
        structinit.impulse_fidelity(model, x, grid=(4, 4))
    assert structinit.attention_maps(model, x, layers=[0])[0].shape == (2, 2, 16, 16)
