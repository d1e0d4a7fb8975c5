"""Every adapter kind (fused qkv, separate q/k/v, nn.MultiheadAttention, user-registered) reads
and writes the per-head layout consistently, so impulse init gives maps that peak on target."""


import pytest
import torch
from torch import nn

import structinit
from attention_modules import MyAdapter, MyAttn, SepAttention, SepViT, ShuffledRowsAttn
from rejection import check_rejected
from structinit.adapters.provenance import TracedAdapter

# ---------------------------------------------------------------------------------------------
# small models, one per adapter kind
# ---------------------------------------------------------------------------------------------


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


@pytest.fixture
def registered():
    structinit.register_adapter(MyAttn, MyAdapter)
    try:
        yield
    finally:
        structinit.unregister_adapter(MyAttn)


def test_an_unregistered_class_is_read_by_what_it_computes_until_an_adapter_is_registered():
    model = SepViT(attn_cls=MyAttn)
    assert all(isinstance(ad, TracedAdapter) for _, ad in structinit.find_attention_layers(model))
    structinit.register_adapter(MyAttn, MyAdapter)
    try:
        assert all(isinstance(ad, MyAdapter) for _, ad in structinit.find_attention_layers(SepViT(attn_cls=MyAttn)))
    finally:
        structinit.unregister_adapter(MyAttn)
    assert all(isinstance(ad, TracedAdapter) for _, ad in structinit.find_attention_layers(SepViT(attn_cls=MyAttn)))


def test_attention_nothing_reads_is_rejected_before_registration():
    model = SepViT(attn_cls=ShuffledRowsAttn)
    with pytest.raises(ValueError, match=r"register_adapter") as info:
        structinit.find_attention_layers(model)
    assert "ShuffledRowsAttn" in str(info.value) and "evenly strided blocks" in str(info.value)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"register_adapter"):
        structinit.impulse_init_(model, seed=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
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
    structinit.register_adapter(ShuffledRowsAttn, MyAdapter)
    structinit.unregister_adapter(ShuffledRowsAttn)
    with pytest.raises(ValueError, match=r"register_adapter"):
        structinit.find_attention_layers(SepViT(attn_cls=ShuffledRowsAttn))


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


class TwoAttn(nn.Module):
    """Two attention layers, of which the forward calls one (``calls_none``: neither)."""

    def __init__(self, calls_none: bool = False):
        super().__init__()
        self.calls_none = calls_none
        self.pos_embed = nn.Parameter(structinit.sincos_2d((4, 4), 32)[None])
        self.used = nn.MultiheadAttention(32, 2, batch_first=True)
        self.unused = nn.MultiheadAttention(32, 2, batch_first=True)

    def forward(self, x):
        x = x + self.pos_embed
        return x if self.calls_none else self.used(x, x, x)[0]


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_layer_the_forward_never_calls_is_left_alone_and_named(scheme):
    """A layer the forward never calls (a decoder's cross-attention with no encoder, or one
    bypassed by a fused fast path) has no maps to check a write against: by default it is left
    alone, bit for bit, and named in a warning and in the record; asked for by index, it is a
    refusal; and a model whose forward calls none of its layers is refused."""
    model, grid = TwoAttn(), {"grid": (4, 4)} if scheme == "impulse" else {}
    before = {k: v.clone() for k, v in model.unused.state_dict().items()}
    with pytest.warns(UserWarning, match=r"left alone: unused \(MultiheadAttention: not called in the model's "
                                         r"forward.*layers="):
        structinit.init_(model, scheme, seed=0, **grid)
    assert all(torch.equal(v, before[k]) for k, v in model.unused.state_dict().items())
    record = structinit.get_record(model, "init")
    assert record["layers"] == ["used"] and [n for n, _ in record["skipped"]] == ["unused"]
    check_rejected(TwoAttn(), lambda m: structinit.init_(m, scheme, seed=0, layers=[1], **grid), ValueError,
                   r"layer 'unused' .*not called in the model's forward.*nothing was written.*layers=")
    check_rejected(TwoAttn(calls_none=True), lambda m: structinit.init_(m, scheme, seed=0, **grid), ValueError,
                   r"layer 'used' .*not called in the model's forward.*nothing was written")


def test_the_maps_of_a_layer_the_forward_never_calls_cannot_be_read():
    model = TwoAttn()
    structinit.init_(model, "impulse", seed=0, grid=(4, 4), layers=[0])
    x = torch.randn(2, 16, 32)
    with pytest.raises(RuntimeError, match="unused"):
        structinit.attention_maps(model, x)
    with pytest.raises(RuntimeError, match="unused"):
        structinit.impulse_fidelity(model, x, grid=(4, 4), offsets=[(0, 0), (0, 1)])
    assert structinit.attention_maps(model, x, layers=[0])[0].shape == (2, 2, 16, 16)


def _tie(model: SepViT, tie: str) -> SepViT:
    """``model`` with two projections of each layer sharing weights: one module serving both
    (``k=v``), or one Parameter held by both modules (``q.o``, ``v.o``, ``q.k``)."""
    for block in model.blocks:
        attn = block.attn
        a, b = (getattr(attn, f"{r}_proj") for r in (tie[0], tie[2]))
        if tie[1] == "=":
            setattr(attn, f"{tie[2]}_proj", a)
        else:
            b.weight, b.bias = a.weight, a.bias
    return model


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
@pytest.mark.parametrize("tie", ["k=v", "q.o", "q.k", "v.o"])
def test_projections_that_share_weights_are_refused_untouched_not_written_half(scheme, tie):
    """A write to one of two projections that share weights changes the other as well: mimetic
    would write k, then v over it (k=v), and the layer's own logits lose the designed diagonal.
    Each scheme refuses the layer before any write, naming the two roles, whenever a role it
    writes is one of them; impulse, which leaves v and o alone, writes a model whose tied pair is
    v and o, and its heads hit their targets in the model's own maps."""
    torch.manual_seed(0)
    model = _tie(SepViT(), tie)
    roles = {tie[0], tie[2]}
    if scheme == "impulse" and roles == {"v", "o"}:
        structinit.init_(model, scheme, seed=0)
        assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())
        return
    check_rejected(model, lambda m: structinit.init_(m, scheme, seed=0), ValueError,
                   rf"its {min(roles, key='qkvo'.index)} and {max(roles, key='qkvo'.index)} projections share their "
                   "weights .* nothing was written")


def test_a_fused_qkv_weight_is_no_tie():
    """The q, k and v slices of one fused weight share a storage but no element: written."""
    from structinit.schemes.checks import shared_roles

    weight = torch.zeros(12, 4)
    views = {"q": (weight[0:4], None), "k": (weight[4:8], None), "v": (weight[8:12], None),
             "o": (torch.zeros(4, 4), None)}
    assert shared_roles(views, "qkvo") is None
    interleaved = weight.view(4, 3, 4)  # q, k, v packed per head: strided, interleaved, still apart
    views = {"q": (interleaved[:, 0], None), "k": (interleaved[:, 1], None), "v": (interleaved[:, 2], None)}
    assert shared_roles(views, "qkvo") is None
    views["v"] = (interleaved[:, 1], None)
    assert shared_roles(views, "qkvo") == ("k", "v")
    assert shared_roles(views, "q") is None  # a tie among roles the scheme does not write
