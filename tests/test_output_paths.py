"""Attention whose output is no projection of its context: LeViT's passes an activation before
its output projection, and a BatchNorm with a weight of zero after it; Gemma's values pass a norm
and iFormer's a sigmoid after their projection, or a gate made from the tokens; the values reach
the output besides through the map (exclusive self-attention, a convolution of the values). The
trace still reads q,
k and v, and names the output path: mimetic, whose W_v W_o has no product to set there, refuses
the layer for that mechanism and leaves the model untouched; impulse, which sets q and k alone,
writes them, and the layer's own maps hit each head's target."""

import math

import pytest
import torch
import torch.nn.functional as F
from attention_styles import RawLinearAttention
from styled_vit import StyledViT
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.provenance import trace_attention
from structinit.functional.targets import target_index


class ActivatedOutput(RawLinearAttention):
    """The context passes a Hardswish, then the output projection (LeViT's ``proj``)."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return F.linear(F.hardswish((probs @ v).transpose(1, 2).reshape(b, t, d)), self.w_out, self.b_out)


class ZeroScaledOutput(RawLinearAttention):
    """The output projection followed by a per-channel scale that starts at zero (a BatchNorm
    whose weight starts at zero, in eval mode), and a shift."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.gain, self.shift = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return super().forward(x) * self.gain + self.shift


class NormedValues(RawLinearAttention):
    """Each head's values pass a LayerNorm after the projection (Gemma's v norm)."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        v = F.layer_norm(v, v.shape[-1:])
        return F.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


class GatedValues(RawLinearAttention):
    """The values pass a sigmoid after the projection (iFormer's gated values)."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return F.linear((probs @ v.sigmoid()).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


class ExclusiveOutput(RawLinearAttention):
    """Exclusive self-attention (vit-pytorch's LoopedViT): each token's context loses its
    component along the token's own value, then a gate from the tokens scales each head."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.gate = nn.Linear(dim, heads, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5
        out = self.keep(logits, logits.softmax(-1)) @ v
        unit = F.normalize(v, dim=-1)
        out = (out - (out * unit).sum(-1, keepdim=True) * unit) * self.gate(x).sigmoid().transpose(1, 2)[..., None]
        return F.linear(out.transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


class ConvolvedValues(RawLinearAttention):
    """A depthwise 3×3 convolution of the values over the square grid of the tokens joins the
    context before the output projection (ScalableViT's local interactive module)."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.local = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5
        out = (self.keep(logits, logits.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        grid = v.transpose(1, 2).reshape(b, t, d).transpose(1, 2).reshape(b, d, math.isqrt(t), -1)
        return F.linear(out + self.local(grid).flatten(2).transpose(1, 2), self.w_out, self.b_out)


class TokenGatedValues(RawLinearAttention):
    """A LayerNorm inside, then values scaled per head by a sigmoid gate made from the normed
    tokens (vit-pytorch's value residual, without the other layer's values)."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.norm, self.mix = nn.LayerNorm(dim), nn.Linear(dim, heads)

    def forward(self, x):
        x = self.norm(x)
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        v = v * self.mix(x).sigmoid().transpose(1, 2)[..., None]
        logits = (q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return F.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


BESIDE = "reads its values besides through its attention map"
PATHS = [(ActivatedOutput, "passes a nonlinearity"), (ZeroScaledOutput, "does not depend on its attention's context"),
         (NormedValues, "values pass a nonlinearity"), (GatedValues, "values pass a nonlinearity"),
         (ExclusiveOutput, BESIDE), (ConvolvedValues, BESIDE), (TokenGatedValues, "values pass a nonlinearity")]
# their output is a projection of the context: the trace reads it
READ_OUTPUT = (NormedValues, GatedValues, TokenGatedValues)


def _model(cls):
    torch.manual_seed(0)
    model = StyledViT("raw-linear")
    model.attns = nn.ModuleList(cls(48, 3) for _ in model.attns)
    return model


@pytest.mark.parametrize(("cls", "words"), PATHS)
def test_the_trace_reads_q_k_and_v_and_names_an_output_that_is_no_projection(cls, words):
    ad = trace_attention(cls(48, 3), (torch.randn(2, 9, 48),), {})
    views = {"q", "k", "v", "o"} if cls in READ_OUTPUT else {"q", "k", "v"}
    assert set(ad.linear_views()) == views and words in ad.output_unread


@pytest.mark.parametrize("cls", [cls for cls, _ in PATHS])
def test_mimetic_refuses_a_value_path_that_is_not_linear_and_leaves_the_model_as_it_was(cls):
    check_rejected(_model(cls), lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"mimetic cannot set the attention of layer 'attns.0'.*the value path is not linear.*impulse")


@pytest.mark.parametrize("cls", [cls for cls, _ in PATHS])
def test_impulse_sets_q_and_k_of_such_a_layer_and_its_own_maps_hit(cls):
    model = _model(cls)
    # reserve='auto': nothing reserved, for want of an output projection, or of an MLP beside the one read
    with pytest.warns(UserWarning, match="no MLP output" if cls in READ_OUTPUT else "no output projection structinit"):
        structinit.init_(model, "impulse", seed=0)
    with torch.no_grad():
        for norm, attn in zip(model.norms, model.attns):
            attn(norm(model.pos_embed.detach()))
            for h, offset in enumerate(attn.structinit_impulse["offsets"]):
                target = target_index((8, 8), offset)
                rows = torch.nonzero(target >= 0).squeeze(1)
                assert (attn.last_probs[0, h, rows].argmax(-1) == target[rows]).all()
    with pytest.raises(ValueError, match="value_init='keep'"):
        structinit.init_(_model(cls), "impulse", seed=0, reserve="none", value_init="mimetic")


class AllNormed(RawLinearAttention):
    """q, k and v each pass a LayerNorm per head after the projection (Gemma's vision tower): the
    probe finds the q/k norm first, which mimetic accepts; the values' norm still refuses it."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        q, k, v = (F.layer_norm(y, y.shape[-1:]) for y in (q, k, v))
        logits = q @ k.transpose(-2, -1) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return F.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


def test_mimetic_refuses_normalised_values_behind_normalised_queries_and_keys():
    check_rejected(_model(AllNormed), lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"layer 'attns.0'.*values pass a nonlinearity after their projection.*no W_v W_o to set")
