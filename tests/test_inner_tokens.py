"""Attention on (B, D, H, W) maps whose projections do not read the module's input as it is:
they read a slice of its channels after a norm (SHViT's single head), or a copy pooled by a
strided depthwise convolution (LowFormer's, CPUBone's), whose output the module upsamples back
after its output projection; or whose q passes a convolution over the positions after its
projection (EfficientViT-MSRA's, MViT-v2's). The trace finds where the tokens are read, writes
what a structured init can set there, and names the mechanism where it cannot, leaving the model
untouched. Each model also holds a depthwise convolution, which a scheme that initialises
attention or convolutions must not take for the only kind of layer there is."""

import pytest
import torch
from attention_styles import ConvMapAttention, _Records
from hypothesis import given, settings
from hypothesis import strategies as st
from styled_vit import StyledViT
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.provenance import TokenError, trace_attention
from structinit.functional.targets import target_index

DIM, HEADS = 48, 3


class SliceAttention(_Records):
    """Attention over the first ``part`` channels of each pixel, after a GroupNorm of them; the
    output projection reads the context beside the channels left alone, after a ReLU (SHViT's
    SHSA)."""

    def __init__(self, dim, heads, part=24):
        super().__init__()
        self.h, self.part = heads, part
        self.norm = nn.GroupNorm(1, part)
        self.qkv = nn.Conv2d(part, 3 * part, 1)
        self.proj = nn.Sequential(nn.ReLU(), nn.Conv2d(dim, dim, 1))

    def forward(self, x):
        b, c, hh, ww = x.shape
        x1, x2 = x.split([self.part, c - self.part], 1)
        # contiguous: torch 2.13's GroupNorm backward to its weight crashes on a channels-last slice
        q, k, v = self.qkv(self.norm(x1.contiguous())).reshape(b, 3, self.h, self.part // self.h, hh * ww).unbind(1)
        logits = q.transpose(-2, -1) @ k * (self.part // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return self.proj(torch.cat([(v @ probs.transpose(-2, -1)).reshape(b, self.part, hh, ww), x2], 1))


class PooledAttention(_Records):
    """q, k and v from a map pooled by a strided depthwise convolution; the output projected,
    then upsampled back by a depthwise transposed convolution (LowFormer's) or by repeating each
    pixel (``nearest``: CPUBone's)."""

    def __init__(self, dim, heads, nearest=False):
        super().__init__()
        self.h = heads
        self.pool = nn.Sequential(nn.Conv2d(dim, dim, 3, stride=2, padding=1, groups=dim), nn.BatchNorm2d(dim))
        self.qkv = nn.Conv2d(dim, 3 * dim, 1, bias=False)
        self.proj = nn.Conv2d(dim, dim, 1)
        self.up = nn.Upsample(scale_factor=2) if nearest else nn.ConvTranspose2d(dim, dim, 4, 2, 1, groups=dim)

    def forward(self, x):
        b, c, hh, ww = x.shape
        y = self.pool(x)
        q, k, v = self.qkv(y).reshape(b, 3, self.h, c // self.h, -1).unbind(1)
        logits = q.transpose(-2, -1) @ k * (c // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return self.up(self.proj((v @ probs.transpose(-2, -1)).reshape(b, c, *y.shape[-2:])))[..., :hh, :ww]


class ConvolvedQueries(_Records):
    """q passes a depthwise 3×3 convolution over the map after its projection (EfficientViT-MSRA's)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, c, hh, ww = x.shape
        q, k, v = self.qkv(x).chunk(3, 1)
        q = self.dw(q)
        q, k, v = (t.reshape(b, self.h, c // self.h, hh * ww) for t in (q, k, v))
        logits = q.transpose(-2, -1) @ k * (c // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return self.proj((v @ probs.transpose(-2, -1)).reshape(b, c, hh, ww))


class NormedConvolvedQueries(ConvolvedQueries):
    """:class:`ConvolvedQueries` with q normalised after its convolution by a module of its own,
    whose input has the shape of the layer's (ZAYA's q norm after its convolved q and k)."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.dw = nn.Sequential(self.dw, nn.GroupNorm(heads, dim, affine=False))


class ConvPositionViT(StyledViT):
    """StyledViT on maps with a depthwise convolution on the tokens before the blocks (a
    conditional position encoding), and ``attention`` in every block."""

    def __init__(self, attention, seed=0):
        torch.manual_seed(seed)
        super().__init__("conv-maps")
        self.attns = nn.ModuleList(attention() for _ in self.attns)
        self.cpe = nn.Conv2d(DIM, DIM, 3, padding=1, groups=DIM)

    def forward(self, images):
        x = self.patch(images) + self.pos_embed.transpose(1, 2).reshape(1, DIM, 8, 8)
        x = x + self.cpe(x)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return self.head(x.flatten(2).mean(-1))


def _images(n=4):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _call(module):
    return (torch.randn(2, DIM, 8, 8, generator=torch.Generator().manual_seed(2)),), {}


def test_a_slice_of_the_channels_is_traced_where_its_projection_reads_it():
    module = SliceAttention(DIM, HEADS)
    ad = trace_attention(module, *_call(module))
    assert ad.input_module is module.qkv and (ad.num_heads, ad.head_dim, ad.dim) == (3, 8, 24)
    assert {"q", "k", "v"} <= set(ad.linear_views()) and "passes a nonlinearity" in ad.output_unread


def test_mimetic_refuses_the_slice_for_its_output_path_and_leaves_the_model_untouched():
    check_rejected(ConvPositionViT(lambda: SliceAttention(DIM, HEADS)),
                   lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"attns.0.*passes a nonlinearity before the output projection.*not linear token by token")


def test_impulse_refuses_tokens_its_position_embedding_is_not_as_wide_as_and_leaves_the_model_untouched():
    """The projections read 24 of the 48 channels: impulse, which designs q and k on the tokens
    the position embedding is added to, says so. No adapter claims the layer by its names, and
    the model holds a depthwise convolution too: the refusal is for the attention, not a quiet
    initialisation of the convolution instead."""
    check_rejected(ConvPositionViT(lambda: SliceAttention(DIM, HEADS)),
                   lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"read 24-wide tokens that they make inside from the model's 48-wide ones")


def test_attention_only_the_trace_reads_is_initialised_not_the_depthwise_convolution_beside_it():
    """1×1-convolution attention on maps that no adapter claims by its names, beside a depthwise
    convolution: impulse, which also initialises depthwise convolutions, initialises the
    attention (and says it left the convolution alone); each head's own map hits its target."""
    model = ConvPositionViT(lambda: ConvMapAttention(DIM, HEADS))
    cpe = model.cpe.weight.detach().clone()
    with pytest.warns(UserWarning, match="has attention and conv layers"):
        structinit.init_(model, "impulse", seed=0, reserve="none")
    assert torch.equal(model.cpe.weight, cpe)
    assert structinit.get_record(model, "init").get("target", "attention") == "attention"
    with torch.no_grad():
        x = model.pos_embed.transpose(1, 2).reshape(1, DIM, 8, 8)
        for norm, attn in zip(model.norms, model.attns):
            attn(norm(x))
            for h, offset in enumerate(attn.structinit_impulse["offsets"]):
                target = target_index((8, 8), offset)
                rows = torch.nonzero(target >= 0).squeeze(1)
                assert (attn.last_probs[0, h, rows].argmax(-1) == target[rows]).all(), (h, offset)


@pytest.mark.parametrize("nearest", [False, True])
def test_an_output_upsampled_after_its_projection_is_named_and_mimetic_refused_untouched(nearest):
    module = PooledAttention(DIM, HEADS, nearest)
    ad = trace_attention(module, *_call(module))
    assert ad.input_module is module.qkv and set(ad.linear_views()) >= {"q", "k", "v"}
    assert "to several positions" in ad.output_unread
    model = ConvPositionViT(lambda: PooledAttention(DIM, HEADS, nearest))
    check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"attns.0.*carries each token's attention context to several positions.*not linear token by token")


def test_q_convolved_over_the_positions_after_its_projection_is_named_and_refused_untouched():
    module = ConvolvedQueries(DIM, HEADS)
    with pytest.raises(TokenError, match="q reads several positions of its input per token"):
        trace_attention(module, *_call(module))
    for scheme in ("impulse", "mimetic"):
        check_rejected(ConvPositionViT(lambda: ConvolvedQueries(DIM, HEADS)),
                       lambda m, s=scheme: structinit.init_(m, s, seed=0), ValueError,
                       r"attns.0.*no product of projections of one token each")


def test_a_reading_past_the_q_projection_does_not_hide_why_the_input_reading_stopped():
    """Read at the q norm's input, no parameter projects the tokens to q: that says only that the
    norm lies past the projection, so the reason stays the one the input's reading gave."""
    module = NormedConvolvedQueries(DIM, HEADS)
    with pytest.raises(TokenError, match="q reads several positions of its input per token"):
        trace_attention(module, *_call(module))


class SequenceConvolvedQueries(nn.Module):
    """RvT's layout on (B, 1 + T, D) tokens, a class token and a square grid: q of the grid from
    a depthwise convolution over it, then a pointwise one, q of the class token from a Linear;
    heads folded into the batch, so that the (B·heads, 1 + T, 1 + T) logits an ``nn.Softmax``
    module takes have the tokens' rank."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.to_q = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim), nn.Conv2d(dim, dim, 1))
        self.cls_q, self.to_kv, self.to_out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.attend = nn.Softmax(dim=-1)

    def forward(self, x):
        b, t, d = x.shape
        side = int((t - 1) ** 0.5)
        grid = self.to_q(x[:, 1:].transpose(1, 2).reshape(b, d, side, side)).flatten(2).transpose(1, 2)
        q = torch.cat([self.cls_q(x[:, :1]), grid], 1)
        q, k, v = (u.reshape(b, t, self.h, -1).transpose(1, 2).reshape(b * self.h, t, -1)
                   for u in (q, *self.to_kv(x).chunk(2, -1)))
        out = self.attend(q @ k.transpose(1, 2) * (d // self.h) ** -0.5) @ v
        return self.to_out(out.reshape(b, self.h, t, -1).transpose(1, 2).reshape(b, t, d))


def test_a_reading_at_the_softmax_module_does_not_hide_why_the_input_reading_stopped():
    """Read at the ``nn.Softmax``'s input, the logits are the tokens and no map is made from
    them: that says only that the reading came too late, so the input's reason stands."""
    module = SequenceConvolvedQueries(DIM, HEADS)
    with pytest.raises(TokenError, match="q reads several positions of its input per token"):
        trace_attention(module, (torch.randn(2, 17, DIM, generator=torch.Generator().manual_seed(0)),), {})


class ValueFirst(nn.Module):
    """CTRL's convention: called as ``attn(v, k, q)``, one projection per role, each reading its
    own argument (the model hands the same tokens to all three)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.wq, self.wk, self.wv, self.dense = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, v, k, q):
        b, t, d = q.shape
        roles = ((self.wq, q), (self.wk, k), (self.wv, v))
        q, k, v = (w(u).reshape(b, t, self.h, -1).transpose(1, 2) for w, u in roles)
        probs = (q @ k.transpose(-2, -1) * (d // self.h) ** -0.5).softmax(-1)
        return self.dense((probs @ v).transpose(1, 2).reshape(b, t, d))


def test_a_layer_whose_roles_read_separate_copies_of_the_tokens_is_read_at_its_q_projection():
    """Handed copies of one tensor (as a probe records a call), its q reads the last: read where
    the q projection takes them, k and v come from the same tokens by other arguments."""
    module = ValueFirst(DIM, HEADS)
    x = torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(0))
    ad = trace_attention(module, (x, x.clone(), x.clone()), {})
    assert ad.input_module is module.wq and set(ad.linear_views()) >= {"q", "k", "v", "o"}
    assert (ad.num_heads, ad.dim) == (HEADS, DIM)


class Attention(nn.Module):
    """timm's names (``qkv``, ``proj``, ``num_heads``), which an adapter claims, with q
    convolved over the tokens after the projection (MViT-v2's pooling of q at stride 1)."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.pool_q = nn.Conv1d(dim // num_heads, dim // num_heads, 3, padding=1, groups=dim // num_heads)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q = self.pool_q(q.reshape(b * self.num_heads, t, -1).transpose(1, 2)).transpose(1, 2).reshape(q.shape)
        probs = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, d))


def test_a_layer_its_adapter_misreads_is_refused_with_what_the_trace_found():
    torch.manual_seed(0)
    model = StyledViT("raw-linear")
    model.attns = nn.ModuleList(Attention(DIM, HEADS) for _ in model.attns)
    check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"attns.0.*read by what it computes, its q reads several positions of its input per token")


def test_values_read_by_place_name_their_norm_whatever_its_weights():
    """A value norm with its own weight and bias (Gemma's v norm has none): v is read by place,
    and the norm named as a nonlinearity after the projection, not as an unreadable layer."""
    class VNormAffine(_Records):
        def __init__(self, dim, heads):
            super().__init__()
            self.h, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.v_norm = nn.LayerNorm(dim // heads)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).reshape(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
            logits = q @ k.transpose(-2, -1) * 0.25
            probs = self.keep(logits, logits.softmax(-1))
            return self.proj((probs @ self.v_norm(v)).transpose(1, 2).reshape(b, t, d))

    ad = trace_attention(VNormAffine(DIM, HEADS), (torch.randn(2, 9, DIM),), {})
    assert "values pass a nonlinearity" in ad.output_unread


def test_a_grid_side_as_long_as_the_slice_is_not_taken_for_its_width():
    """A normalised slice of 8 channels on an 8×8 map: every axis of 8 is fed whole, and only
    the channels read one position per token."""
    torch.manual_seed(0)
    module = SliceAttention(16, 2, part=8)
    ad = trace_attention(module, (torch.randn(2, 16, 8, 8),), {})
    assert ad.input_module is module.qkv and (ad.num_heads, ad.head_dim, ad.dim) == (2, 4, 8)


@settings(max_examples=8, deadline=None)
@given(heads=st.sampled_from([1, 2, 3, 4]), per_head=st.sampled_from([4, 6]), side=st.sampled_from([3, 5, 8]),
       seed=st.integers(0, 2**16))
def test_the_slice_is_read_whatever_its_heads_width_and_grid(heads, per_head, side, seed):
    """The tokens are found at the projection that reads the slice, as many heads of as many
    channels as the module has, over every position of the map; the output path named."""
    torch.manual_seed(seed)
    part = heads * per_head
    module = SliceAttention(part + 8, heads, part=part)
    ad = trace_attention(module, (torch.randn(2, part + 8, side, side),), {})
    assert ad.input_module is module.qkv and (ad.num_heads, ad.head_dim, ad.dim) == (heads, per_head, part)
    assert "passes a nonlinearity" in ad.output_unread


@settings(max_examples=6, deadline=None)
@given(side=st.sampled_from([4, 6, 8]), nearest=st.booleans(), seed=st.integers(0, 2**16))
def test_an_upsampled_output_is_named_whatever_the_grid(side, nearest, seed):
    torch.manual_seed(seed)
    ad = trace_attention(PooledAttention(DIM, HEADS, nearest), (torch.randn(2, DIM, side, side),), {})
    assert "to several positions" in ad.output_unread
