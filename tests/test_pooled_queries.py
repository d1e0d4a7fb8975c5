"""Attention whose queries are pooled inside the layer, window by window (Hiera's mask-unit
attention, SAM 2's Hiera at each stage's first block): its maps are (B, heads, windows, q, k)
with fewer queries than keys. No scheme shapes such a map as self-attention: it is left alone,
and said so, whether an adapter claims the layer or only the trace finds it; the layers around it
are written. Later stages of such a model, whose tokens carry no position of their own, are
refused by impulse with that mechanism, and nothing is written."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import structinit
from rejection import check_rejected


class PooledWindowAttention(nn.Module):
    """q, k, v of (B, N, D) tokens laid out as ``windows`` windows of row-major 4×4 tokens (the
    windows cut after the projection); with ``pool``, each window's queries max-pooled 2×2 (16 →
    4), the output 4 tokens per window of width ``out``; with ``pool='qkv'`` (one window of 8×8),
    q, k and v pooled 2×2 alike (64 → 16: MViT's stage change). ``claimed``: ``qkv``/``proj``
    Linears and ``F.scaled_dot_product_attention`` (names an adapter knows); else raw Parameters
    and an explicit softmax (only the trace reads it)."""

    def __init__(self, dim, out, heads, windows, pool, claimed):
        super().__init__()
        self.h, self.windows, self.pool, self.claimed, self.out = heads, windows, pool, claimed, out
        if claimed:  # block 0 then looks like timm's attention by its names: windows of 16 tokens, heads of 16
            self.qkv, self.proj, self.num_heads = nn.Linear(dim, 3 * out), nn.Linear(out, out), heads
        else:
            self.w_in = nn.Parameter(torch.randn(3 * out, dim) * dim**-0.5)
            self.w_out = nn.Parameter(torch.randn(out, out) * out**-0.5)

    def forward(self, x):
        b, n, _ = x.shape
        w_in = self.qkv.weight if self.claimed else self.w_in
        qkv = F.linear(x, w_in, self.qkv.bias if self.claimed else None)
        q, k, v = qkv.reshape(b, self.windows, n // self.windows, 3, self.h, -1).permute(3, 0, 4, 1, 2, 5)
        if self.pool == "qkv":  # (B, h, 1, 64, d) → (B, h, 1, 16, d), each of q, k and v
            q, k, v = (t.reshape(b, self.h, 1, 4, 2, 4, 2, -1).amax(dim=(4, 6)).reshape(b, self.h, 1, 16, -1)
                       for t in (q, k, v))
        elif self.pool:  # (B, h, W, 16, d) → (B, h, W, 4, d): each window's 4×4 queries pooled 2×2
            d = q.shape[-1]
            q = q.reshape(b, self.h, self.windows, 2, 2, 2, 2, d).amax(dim=(4, 6))
            q = q.reshape(b, self.h, self.windows, 4, d)
        if self.claimed:
            context = F.scaled_dot_product_attention(q, k, v)
        else:
            context = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1) @ v
        context = context.permute(0, 2, 3, 1, 4).reshape(b, -1, self.out)
        return self.proj(context) if self.claimed else F.linear(context, self.w_out)


class PooledStages(nn.Module):
    """A two-stage Hiera in small on 16×16 images: an 8×8 grid (a learned PE) in 4 windows of 16
    tokens in window order; block 0 attends within windows; block 1 pools each window's queries to
    a 2×2 grid and widens 48 → 96 (its shortcut the tokens widened and pooled alike); block 2
    attends over the 16 pooled tokens, which carry no position of their own."""

    def __init__(self, claimed, pool="q"):
        super().__init__()
        self.pool = pool
        self.patch = nn.Conv2d(3, 48, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 64, 48) * 0.02)
        self.norms = nn.ModuleList([nn.LayerNorm(48), nn.LayerNorm(48), nn.LayerNorm(96)])
        self.blocks = nn.ModuleList([PooledWindowAttention(48, 48, 3, 4, False, claimed),
                                     PooledWindowAttention(48, 96, 3, 4 if pool == "q" else 1, pool, claimed),
                                     PooledWindowAttention(96, 96, 3, 1, False, claimed)])
        self.widen = nn.Linear(48, 96)
        self.head = nn.Linear(96, 10)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos_embed  # (B, 64, 48), row-major
        b = x.shape[0]
        x = x.reshape(b, 2, 4, 2, 4, 48).permute(0, 1, 3, 2, 4, 5).reshape(b, 64, 48)  # window order
        x = x + self.blocks[0](self.norms[0](x))
        if self.pool == "qkv":  # back to row-major: block 1 pools the 8×8 grid as one window
            x = x.reshape(b, 2, 2, 4, 4, 48).permute(0, 1, 3, 2, 4, 5).reshape(b, 64, 48)
            short = self.widen(x).reshape(b, 4, 2, 4, 2, 96).amax(dim=(2, 4)).reshape(b, 16, 96)
        else:
            short = self.widen(x).reshape(b, 4, 2, 2, 2, 2, 96).amax(dim=(3, 5)).reshape(b, 16, 96)
        x = short + self.blocks[1](self.norms[1](x))
        x = x + self.blocks[2](self.norms[2](x))
        return self.head(x.mean(1))


@pytest.mark.parametrize("pool", ["q", "qkv"])
@pytest.mark.parametrize("claimed", [True, False])
def test_queries_pooled_within_windows_are_left_alone_and_said_so(claimed, pool):
    """Block 0's windows are cut after its projections: an adapter that claims it by name reads
    no map over its tokens, and the trace reads it; block 1 is left alone and listed, whether its
    queries alone are pooled (cross-attention) or q, k and v alike (a map over fewer tokens)."""
    torch.manual_seed(0)
    model = PooledStages(claimed, pool)
    pooled = {k: v.clone() for k, v in model.blocks[1].state_dict().items()}
    others = [{k: v.clone() for k, v in model.blocks[i].state_dict().items()} for i in (0, 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        structinit.init_(model, "mimetic", seed=0)
    said = " ".join(str(w.message) for w in caught)
    words = "cross-attention of 4 queries over 16 tokens" if pool == "q" else "pooled inside it to 16 of its 64 tokens"
    assert "blocks.1 " in said and words in said, said
    assert all(torch.equal(v, model.blocks[1].state_dict()[k]) for k, v in pooled.items())
    for i, before in zip((0, 2), others):  # the layers around it are written
        assert any(not torch.equal(v, model.blocks[i].state_dict()[k]) for k, v in before.items()), i


@pytest.mark.parametrize("claimed", [True, False])
def test_impulse_refuses_a_later_stage_whose_tokens_carry_no_position_of_their_own(claimed):
    torch.manual_seed(0)
    check_rejected(PooledStages(claimed), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"1 attention layer\(s\) \(the first 'blocks\.2'.*16 tokens of width 96\).*carry no position "
                   r"of their own.*no tensor of width 96.*nothing was written")



@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_an_image_map_whose_attention_is_over_fewer_tokens_is_pooled_inside(layout):
    """A layer called with a 4×4 map of width 32 whose maps are over 4 tokens (EfficientFormer-V2's
    stage-2 attention strides its map before q, k and v) is a stage change, named as one; a 2×2
    map attended over its own 4 tokens is not."""
    from structinit.adapters.observe import AttentionMap, ModuleCall
    from structinit.adapters.provenance_tokens import pooled_inside

    def call(side):
        x = torch.randn(2, 32, side, side) if layout == "channels_first" else torch.randn(2, side, side, 32)
        maps = [AttentionMap(torch.rand(2, 2, 4, 4).softmax(-1), None, "softmax")]  # (B, heads, 4, 4)
        return ModuleCall(args=(x,), maps=maps, done=True)

    assert "q and k pooled inside it to 4 of its 16 tokens" in pooled_inside(call(4))
    assert pooled_inside(call(2)) == ""
