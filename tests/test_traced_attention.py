"""Attention in styles no adapter names, read by provenance: the trace follows each softmax map
back to the parameter entries that make q, k and v and on to the output projection, and both
schemes write through what it found. Every claim is checked on the module's own forward (the
maps it records itself), not on structinit's recomputation."""

import pytest
import torch
from attention_styles import STYLES, LearnedQueries, RawLinearAttention
from styled_vit import StyledViT
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.provenance import TracedAdapter, TraceError, trace_attention
from structinit.adapters.registry import adapter_for
from structinit.functional.targets import target_index
from structinit.schemes.checks import diagonal_strength


def _images(n=4):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _as_input(model, tokens):
    """(1, 64, D) tokens in the form the model's attention takes (maps for conv-maps)."""
    return tokens.transpose(1, 2).reshape(1, -1, 8, 8) if model.maps else tokens


# Every style, and one whose projections are each a conv and a BatchNorm (two biases a channel)
TRACED = (*STYLES, "conv-norm-maps")


def _model(style, seed=0):
    torch.manual_seed(seed)
    return StyledViT(style).eval()  # a BatchNorm computes the function the init designs in eval mode


@pytest.mark.parametrize("style", TRACED)
def test_every_style_is_traced_to_its_own_parameters_with_no_adapter_registered(style):
    model = _model(style)
    assert all(adapter_for(m) is None for m in model.attns)
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["attns.0", "attns.1"]
    for (_, ad), attn in zip(layers, model.attns):
        assert isinstance(ad, TracedAdapter) and (ad.num_heads, ad.head_dim, ad.dim) == (3, 16, 48)
        owned = {p.untyped_storage().data_ptr() for p in attn.parameters()}
        for weight, bias in ad.linear_views().values():  # views of the module's own storage
            assert weight.untyped_storage().data_ptr() in owned
            assert bias is None or bias.untyped_storage().data_ptr() in owned


@pytest.mark.parametrize("style", TRACED)
def test_impulse_on_a_traced_layer_makes_the_modules_own_maps_hit_their_targets(style):
    model = _model(style)
    structinit.init_(model, "impulse", seed=0, reserve="none")  # no MLP: nothing to reserve against
    # the position-only input the papers design for: the model's own norm of its PE's grid rows
    with torch.no_grad():
        for norm, attn in zip(model.norms, model.attns):
            tokens = model.pos_embed.detach()
            x = norm(_as_input(model, tokens))
            attn(x)
            probs = attn.last_probs[0]  # (heads, 64, 64), as the module computed them
            for h, offset in enumerate(attn.structinit_impulse["offsets"]):
                target = target_index((8, 8), offset)
                rows = torch.nonzero(target >= 0).squeeze(1)
                hit = (probs[h, rows].argmax(-1) == target[rows]).float().mean()
                assert hit == 1.0, (style, h, offset, float(hit))


def _vo_product(attn, maps: bool, dim: int = 48) -> torch.Tensor:
    """x ↦ out on identical tokens (a uniform map), less its value at 0: W_v W_o as the module's
    own forward applies it, (D, D) in the row-vector convention."""
    def run(u):
        x = u.reshape(1, 1, dim).expand(1, 64, dim)
        out = attn(_as_input_maps(x) if maps else x)
        return (out.flatten(2).transpose(1, 2) if maps else out)[0, 0]
    with torch.no_grad():
        zero = run(torch.zeros(dim))
        return torch.stack([run(e) - zero for e in torch.eye(dim)])


def _as_input_maps(x):
    return x.transpose(1, 2).reshape(1, -1, 8, 8)


@pytest.mark.parametrize("style", TRACED)
def test_mimetic_on_a_traced_layer_shows_in_the_modules_own_logits_and_values(style):
    model = _model(style)
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    for attn in model.attns:
        assert (diagonal_strength(attn.last_logits) > 0.25).all()  # q kᵀ ≈ αZ + βI: the diagonal stands out
        vo = _vo_product(attn, model.maps)
        assert float(vo.diagonal().mean()) == pytest.approx(-0.4, abs=0.1)  # W_v W_o = γZ − δI, δ = 0.4
    before = _model(style)
    with torch.no_grad():
        before(_images())
    assert not (diagonal_strength(before.attns[0].last_logits) > 0.25).all()  # the default init does not


class QKNormed(RawLinearAttention):
    """Raw-Parameter attention with a LayerNorm on each head's q and k after the projection."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = nn.functional.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        q, k = (nn.functional.layer_norm(y, y.shape[-1:]) for y in (q, k))
        probs = self.keep(q @ k.transpose(-2, -1), (q @ k.transpose(-2, -1)).softmax(-1))
        return nn.functional.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


class ScatteredRows(RawLinearAttention):
    """q, k, v whose projection rows are shuffled: a head's q rows follow no stride at all."""

    def forward(self, x):
        b, t, d = x.shape
        rows = torch.randperm(3 * d, generator=torch.Generator().manual_seed(0))
        qkv = nn.functional.linear(x, self.w_in[rows], self.b_in[rows]).reshape(b, t, 3, self.h, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        probs = self.keep(q @ k.transpose(-2, -1), (q @ k.transpose(-2, -1) * 0.25).softmax(-1))
        return nn.functional.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


@pytest.mark.parametrize(("cls", "words"), [
    (ScatteredRows, "evenly strided blocks"),
])
def test_what_the_trace_cannot_read_is_named_and_the_module_left_as_it_was(cls, words):
    module = cls(48, 3)
    module.register_buffer("calls", torch.zeros(()))
    module.register_forward_pre_hook(lambda m, a: m.calls.add_(1) and None)  # a buffer the forward changes
    state = {k: v.clone() for k, v in module.state_dict().items()}
    flags = [p.requires_grad for p in module.parameters()]
    with pytest.raises(TraceError, match=words):
        trace_attention(module, (torch.randn(2, 9, 48),), {})
    after = module.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state) and float(after["calls"]) == 0
    assert [p.requires_grad for p in module.parameters()] == flags


def test_queries_not_computed_from_the_input_are_named_not_an_autograd_error():
    with pytest.raises(ValueError, match="q is not computed from the tokens it is called with"):
        trace_attention(LearnedQueries(48, 3), (torch.randn(2, 9, 48),), {})


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_model_whose_attention_the_trace_cannot_read_is_refused_with_why_and_unchanged(scheme):
    model = StyledViT("raw-linear")
    model.attns[1] = ScatteredRows(48, 3)
    check_rejected(model, lambda m: structinit.init_(m, scheme, seed=0), ValueError,
                   "no adapter understands.*attns.1.*evenly strided blocks")


def test_the_trace_reads_a_scale_applied_before_or_after_the_product_and_a_kept_map():
    """q scaled before the product (the Linear-subclass style), logits scaled after (raw-linear),
    and a map computed only to be kept beside scaled_dot_product_attention (module-dict)."""
    for style in ("linear-subclass", "raw-linear", "module-dict"):
        attn = _model(style).attns[0]
        ad = trace_attention(attn, (torch.randn(2, 64, 48),), {})
        assert ad.scale == pytest.approx(16 ** -0.5, rel=1e-5)


class CachingViT(StyledViT):
    """A forward that leaves traces: a call counter buffer, a relative-index buffer rebuilt for a
    new token count, and a cached tensor attribute created on first use."""

    def __init__(self, style="raw-linear"):
        super().__init__(style)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("rel_index", torch.zeros(1, 1, dtype=torch.long))
        self.cached = None

    def forward(self, images):
        self.calls += 1
        if self.rel_index.shape[0] != 64:
            self.rel_index = torch.arange(64)[:, None] - torch.arange(64)[None]
        if self.cached is None:
            self.cached = torch.ones(3)
        return super().forward(images)


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: b for n, b in model.named_buffers()}, model.cached)


def _assert_same(model, state):
    values, buffers, cached = state
    now = model.state_dict()
    assert values.keys() == now.keys() and all(torch.equal(values[k], now[k]) for k in values)
    assert all(b is buffers[n] for n, b in model.named_buffers()) and model.cached is cached


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_refused_init_leaves_no_trace_of_its_probes_in_buffers_or_cached_attributes(scheme):
    model = CachingViT()
    model.attns[1] = ScatteredRows(48, 3)
    state = _state(model)
    with pytest.raises(ValueError, match="no adapter understands"):
        structinit.init_(model, scheme, seed=0)
    _assert_same(model, state)


def test_a_written_init_changes_the_weights_it_plans_and_no_buffer():
    model = CachingViT()
    values = _state(model)[0]
    structinit.init_(model, "mimetic", seed=0)
    assert int(model.calls) == 0 and model.rel_index.shape == (1, 1) and model.cached is None
    assert not torch.equal(values["attns.0.w_in"], model.attns[0].w_in)


class WidthChangingAttention(nn.Module):
    """Hiera's multi-scale attention: tokens of width 32 in, width 64 out (q, k, v of 64)."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.qkv, self.proj = 2, nn.Linear(32, 3 * 64), nn.Linear(64, 64)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 32).permute(2, 0, 3, 1, 4)
        return self.proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 64))


def test_mimetic_refuses_a_layer_that_changes_the_width_before_writing():
    model = nn.Sequential(nn.Conv2d(3, 32, 2, stride=2), nn.Flatten(2), Transpose(), WidthChangingAttention())
    check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"output projection is 64 → 64 for input tokens of width 32.*keeps the width")


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


def test_q_and_k_normalised_after_their_projections_are_read_by_place_and_set_by_mimetic_alone():
    """A norm between the projections and the product mixes a head's channels: the trace reads
    each head's lines of weights in storage order (the same for q and k, so their product is
    unchanged); mimetic writes and its diagonal shows in the module's own logits; impulse,
    whose solvers design q kᵀ before any norm, refuses."""
    torch.manual_seed(0)
    model = StyledViT("raw-linear")
    model.attns = nn.ModuleList(QKNormed(48, 3) for _ in range(2))
    (_, ad), _ = structinit.find_attention_layers(model)
    assert isinstance(ad, TracedAdapter) and ad.linear_views()["q"][1] is None  # the bias before the norm: unread
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError, "normalised")
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    assert all((diagonal_strength(attn.last_logits) > 0.25).all() for attn in model.attns)


def test_windows_cut_inside_the_module_from_channels_last_maps_are_traced_to_their_positions():
    """The module takes (B, 8, 8, D) maps and cuts 4×4 windows itself: the trace finds which
    pixel each token of each window's map reads, and mimetic's diagonal shows in every
    window's own logits."""
    torch.manual_seed(0)
    model = StyledViT("windows")
    (_, ad), _ = structinit.find_attention_layers(model)
    assert isinstance(ad, TracedAdapter) and ad.token_map.channel_axis == 3
    expected = torch.arange(64).reshape(2, 4, 2, 4).permute(0, 2, 1, 3).reshape(4, 16)  # window-major, row-major inside
    assert torch.equal(ad.token_map.windows, expected)
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    for attn in model.attns:
        assert attn.last_logits.shape == (16, 3, 16, 16) and (diagonal_strength(attn.last_logits) > 0.25).all()
    # impulse would need each window's own grid: refused, naming the token counts, and nothing written
    check_rejected(StyledViT("windows"), lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"),
                   ValueError, r"receives 16 tokens, but the model's layout is 0 prefix \+ 64 grid")


def test_a_packed_sequence_with_a_block_diagonal_mask_built_inside_is_traced_with_its_mask():
    """Every image's tokens in one sequence, the module masking across images itself: the trace
    keeps the mask it built, the survey finds the layer plain, and mimetic's diagonal shows in
    the module's own logits, block by block; impulse is refused (the sequence is not one grid)."""
    torch.manual_seed(0)
    model = StyledViT("packed")
    (_, ad), _ = structinit.find_attention_layers(model)
    assert isinstance(ad, TracedAdapter) and ad.masked is not None and ad.masked.shape[-1] == 128
    assert {v.kind for v in structinit.adapters.attention_survey(model).verdicts} == {"self"}
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images(2))
    for attn in model.attns:
        assert torch.isneginf(attn.last_logits[0, 0, 0, 64:]).all()
        assert (diagonal_strength(attn.last_logits) > 0.25).all()
    check_rejected(StyledViT("packed"), lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"),
                   ValueError, "receives 128 tokens")


def test_the_token_order_of_a_layer_that_windows_its_own_input_is_unread_not_a_traceback():
    from structinit.adapters.token_order import token_order

    model = StyledViT("windows")

    class WindowsAsGiven:  # an adapter that hands over the (B, H, W, D) maps as the layer gets them
        input_module = model.attns[0]
        input_tokens = staticmethod(lambda args, kwargs: args[0])

    assert token_order(model, WindowsAsGiven(), model.pos_embed, 64, _images(2)) is None


def test_windows_the_model_cuts_before_the_call_are_judged_and_checked_on_their_own_maps():
    # (B·windows, h, w, D) tokens: each window's h·w tokens are the rows of its maps, so the layer is
    # judged against its recomputation (not trusted by its names) and mimetic's write is checked there.
    model = _model("cut-windows")
    from structinit.adapters.survey import attention_survey

    verdicts = attention_survey(model).verdicts
    assert [(v.name, v.kind, v.checked) for v in verdicts] == [("attns.0", "self", True), ("attns.1", "self", True)]
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    for attn in model.attns:
        assert (diagonal_strength(attn.last_logits) > 0.25).all()  # in the windows' own logits


class GlobalQuery(RawLinearAttention):
    """GCViT's global-query window attention: the queries are handed to the module, made
    elsewhere; only k and v are its own projections."""

    def forward(self, x, q_global):
        b, t, d = x.shape
        _, k, v = nn.functional.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        q = q_global.reshape(b, t, self.h, -1).transpose(1, 2)
        probs = (q @ k.transpose(-2, -1) * 0.25).softmax(-1)
        return nn.functional.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


def test_queries_handed_to_the_module_are_named_as_not_its_own():
    module = GlobalQuery(48, 3)
    with pytest.raises(TraceError, match=r"its q does not come from its own parameters \(handed to it, as a global "
                                         r"query is\)"):
        trace_attention(module, (torch.randn(2, 9, 48), torch.randn(2, 9, 48)), {})


@pytest.mark.parametrize("scale", [1e-10, 1e4])
def test_the_trace_reads_a_layer_whatever_the_scale_of_its_weights(scale):
    """BLIP's vision towers are built with weights of 1e-10 (logits of 1e-17): the trace's fit of
    the module's logits to its projections' q kᵀ is scale-free, so the layer is read and written."""
    torch.manual_seed(0)
    model = StyledViT("raw-linear")
    with torch.no_grad():
        for attn in model.attns:
            for p in attn.parameters():
                p.mul_(scale)
    assert all(isinstance(ad, TracedAdapter) for _, ad in structinit.find_attention_layers(model))
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    assert all((diagonal_strength(attn.last_logits) > 0.25).all() for attn in model.attns)


class _GlobalQueryViT(nn.Module):
    """GCViT's alternation: a self-attention layer, then one whose queries a global token makes
    outside it and hands to it."""

    def __init__(self, dim=48, heads=3):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 64, dim) * 0.02)
        self.local, self.glob = RawLinearAttention(dim, heads), GlobalQuery(dim, heads)
        self.make_query = nn.Linear(dim, dim)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos_embed
        x = x + self.local(x)
        q_global = self.make_query(x.mean(1, keepdim=True)).expand_as(x)
        return (x + self.glob(x, q_global)).mean(1)


def test_a_layer_whose_queries_are_handed_to_it_is_left_alone_as_cross_attention():
    """Its map is cross-attention from queries made elsewhere, not self-attention over its tokens:
    the init writes the other layers and leaves it alone, saying so, as it does a pooling head
    (the model was refused whole: 'no adapter understands')."""
    model = _GlobalQueryViT()
    kept = {k: v.clone() for k, v in model.glob.state_dict().items()}
    local = model.local.w_in.detach().clone()
    with pytest.warns(UserWarning, match=r"left alone: glob \(GlobalQuery: .*cross-attention from queries made "
                                         r"outside it"):
        structinit.init_(model, "mimetic", seed=0)
    assert all(torch.equal(v, model.glob.state_dict()[k]) for k, v in kept.items())
    assert not torch.equal(model.local.w_in, local)
    assert [n for n, _ in structinit.get_record(model, "init")["skipped"]] == ["glob"]


def test_q_and_k_normalised_over_every_heads_channels_at_once_are_read_head_by_head():
    """OLMo-2's norm of q (and k) over the full width, before the heads are split, in float32: each
    head's q depends on every head's projection rows, but only through the norm's one scale per
    token. The trace still reads each head's own rows (a cotangent along no token's own q passes
    no such norm), the survey finds the layers plain self-attention checked on their own maps,
    mimetic's diagonal shows in the module's own logits, and impulse is refused for the norm,
    the model left as it was."""
    torch.manual_seed(0)
    model = StyledViT("full-width-norm")
    verdicts = structinit.adapters.attention_survey(model).verdicts
    assert [(v.kind, v.checked) for v in verdicts] == [("self", True)] * 2
    assert all(isinstance(v.adapter, TracedAdapter) and v.adapter.head_dim == 16 for v in verdicts)
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    assert all((diagonal_strength(attn.last_logits) > 0.25).all() for attn in model.attns)
    assert [(v.kind, v.checked) for v in structinit.adapters.attention_survey(model).verdicts] == [("self", True)] * 2
    check_rejected(_model("full-width-norm"), lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"),
                   ValueError, r"q and k are normalised after their projections")


class _ZeroClassToken(nn.Module):
    """A pre-norm ViT whose class token and its position row start at zero (InternVL's at init):
    the first token every attention layer reads is all zeros, so no parameter entry feeds its q."""

    def __init__(self, attention):
        super().__init__()
        self.patch = nn.Conv2d(3, 48, 2, stride=2)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 48))
        self.pos_embed = nn.Parameter(torch.cat([torch.zeros(1, 1, 48), torch.randn(1, 64, 48) * 0.02], 1))
        self.norms = nn.ModuleList(nn.LayerNorm(48) for _ in range(2))
        self.attns = nn.ModuleList(attention(48, 3) for _ in range(2))

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return x[:, 0]


@pytest.mark.parametrize("style", ["raw-linear", "full-width-norm"])
def test_a_first_token_of_zeros_does_not_hide_which_entries_feed_each_head(style):
    from attention_styles import FullWidthNormAttention

    torch.manual_seed(0)
    model = _ZeroClassToken(STYLES["raw-linear"] if style == "raw-linear" else FullWidthNormAttention)
    verdicts = structinit.adapters.attention_survey(model).verdicts
    assert [(v.kind, v.checked) for v in verdicts] == [("self", True)] * 2
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    assert all((diagonal_strength(attn.last_logits[..., 1:, 1:]) > 0.25).all() for attn in model.attns)

