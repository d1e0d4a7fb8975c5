"""Attention modules written in styles no adapter names: raw Parameters through ``F.linear``,
``einsum`` on a (3, heads, r, D) weight, 1×1 convolutions on image maps (alone, or each followed
by a BatchNorm), projections in a ``ModuleDict``, a ``Linear`` subclass, q, k and v packed per
head, heads before the token blocks, values wider than queries and keys, one softmax per segment
of a packed sequence, q and k normalised over every head's channels at once, heads folded into
the batch with the scale as ``baddbmm``'s ``alpha`` (and regrouped around the softmax, as Bloom
does) (``styled_vit.StyledViT`` puts any of them in a small ViT). Each records the softmax input
and output its own forward formed (``last_logits``, ``last_probs``), the ground truth the tests
compare structinit against."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class _Records(nn.Module):
    def keep(self, logits, probs):
        self.last_logits, self.last_probs = logits.detach(), probs.detach()
        return probs


class RawLinearAttention(_Records):
    """q, k, v from one raw (3D, D) Parameter through ``F.linear``; the output from another."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.w_in = nn.Parameter(torch.randn(3 * dim, dim) * dim**-0.5)
        self.b_in = nn.Parameter(torch.zeros(3 * dim))
        self.w_out = nn.Parameter(torch.randn(dim, dim) * dim**-0.5)
        self.b_out = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(dim=-1))
        return F.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


class EinsumAttention(_Records):
    """``einsum`` on a (3, heads, r, D) weight and a (heads, r, D) output weight, no biases."""

    def __init__(self, dim, heads):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, heads, dim // heads, dim) * dim**-0.5)
        self.o = nn.Parameter(torch.randn(heads, dim // heads, dim) * dim**-0.5)

    def forward(self, x):
        q, k, v = torch.einsum("btd,shcd->sbhtc", x, self.w)
        logits = torch.einsum("bhic,bhjc->bhij", q, k) / math.sqrt(q.shape[-1])
        probs = self.keep(logits, F.softmax(logits, dim=-1))
        return torch.einsum("bhtc,hcd->btd", torch.einsum("bhij,bhjc->bhic", probs, v), self.o)


class ConvMapAttention(_Records):
    """1×1 convolutions on (B, D, H, W) maps; the map applied as v · mapᵀ, channels first."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.out = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, c, hh, ww = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.h, c // self.h, hh * ww).unbind(1)
        logits = q.transpose(-2, -1) @ k * (c // self.h) ** -0.5
        probs = self.keep(logits, torch.softmax(logits, -1))
        return self.out((v @ probs.transpose(-2, -1)).reshape(b, c, hh, ww))


class ConvNormMapAttention(_Records):
    """EfficientFormer-V2's projections: on (B, D, H, W) maps, q, k and v each a 1×1 convolution
    with a bias followed by a BatchNorm with its own, so two biases shift each channel; the output
    a 1×1 convolution."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v = (nn.Sequential(nn.Conv2d(dim, dim, 1), nn.BatchNorm2d(dim)) for _ in range(3))
        self.out = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, c, hh, ww = x.shape
        q, k, v = (f(x).reshape(b, self.h, c // self.h, hh * ww) for f in (self.q, self.k, self.v))
        logits = q.transpose(-2, -1) @ k * (c // self.h) ** -0.5
        probs = self.keep(logits, torch.softmax(logits, -1))
        return self.out((v @ probs.transpose(-2, -1)).reshape(b, c, hh, ww))


class ModuleDictAttention(_Records):
    """q, k, v and the output in a ``ModuleDict``, through ``scaled_dot_product_attention``
    (whose map the module does not see: it records the same softmax, recomputed)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.proj = nn.ModuleDict({n: nn.Linear(dim, dim) for n in ("query", "key", "value", "mix")})

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (self.proj[n](x).view(b, t, self.h, -1).transpose(1, 2) for n in ("query", "key", "value"))
        logits = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        self.keep(logits, logits.softmax(-1))
        return self.proj["mix"](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class ScaledLinear(nn.Linear):
    """A Linear subclass with a fixed gain of one: the kind of wrapper quantisation or LoRA code ships."""

    def forward(self, x):
        return F.linear(x, self.weight * 1.0, self.bias)


class SubclassAttention(_Records):
    """Linear-subclass projections named nothing an adapter knows, scaled on q before the product."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.a, self.b, self.c, self.d = (ScaledLinear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.h, -1).transpose(1, 2)
        q = split(self.a(x)) * (d // self.h) ** -0.5
        k, v = split(self.b(x)), split(self.c(x))
        logits = q @ k.transpose(-2, -1)
        probs = self.keep(logits, logits.softmax(-1))
        return self.d((probs @ v).transpose(1, 2).reshape(b, t, d))


class WindowAttention(_Records):
    """Swin-style attention on (B, H, W, D) maps, channels last, cut into ``window``×``window``
    windows inside the module (no relative bias), then put back in place."""

    def __init__(self, dim, heads, window=4):
        super().__init__()
        self.h, self.window = heads, window
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, hh, ww, c = x.shape
        s = self.window
        win = x.view(b, hh // s, s, ww // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        n = win.shape[0]
        q, k, v = self.qkv(win).reshape(n, s * s, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) * (c // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        out = self.proj((probs @ v).transpose(1, 2).reshape(n, s * s, c))
        return out.view(b, hh // s, ww // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, c)


class ShiftedWindowAttention(_Records):
    """torchvision's Swin: (B, H, W, D) maps padded to whole ``window``×``window`` windows, rolled
    by ``shift``, cut into windows inside the module and put back after; its projections applied
    with ``F.linear`` on their weights (no submodule call), and the pairs the roll brought together
    masked with −100, a mask built inside the forward. ``misread`` offsets every key by one token,
    a layer whose maps are not softmax(q kᵀ) of its tokens."""

    def __init__(self, dim, heads, window=3, shift=0):
        super().__init__()
        self.h, self.window, self.shift, self.misread = heads, window, shift, False
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, hh, ww, c = x.shape
        s, t = self.window, self.window ** 2
        x = F.pad(x, (0, 0, 0, (-ww) % s, 0, (-hh) % s))
        big_h, big_w = x.shape[1:3]
        x = torch.roll(x, (-self.shift, -self.shift), (1, 2)) if self.shift else x
        win = x.view(b, big_h // s, s, big_w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, t, c)
        n = win.shape[0]
        q, k, v = F.linear(win, self.qkv.weight, self.qkv.bias).reshape(n, t, 3, self.h, c // self.h).permute(2, 0, 3,
                                                                                                              1, 4)
        if self.misread:
            k = k.roll(1, -2)
        logits = q @ k.transpose(-2, -1) * (c // self.h) ** -0.5
        if self.shift:  # regions the roll brought into one window do not see each other
            edges = (slice(0, -s), slice(-s, -self.shift), slice(-self.shift, None))
            region = torch.zeros(big_h, big_w)
            for i, (ys, xs) in enumerate((ys, xs) for ys in edges for xs in edges):
                region[ys, xs] = i
            region = region.view(big_h // s, s, big_w // s, s).permute(0, 2, 1, 3).reshape(-1, t)
            apart = (region[:, :, None] != region[:, None, :]).repeat(b, 1, 1)[:, None]
            logits = logits.masked_fill(apart, -100.0)
        probs = self.keep(logits, logits.softmax(-1))
        out = F.linear((probs @ v).transpose(1, 2).reshape(n, t, c), self.proj.weight, self.proj.bias)
        out = out.view(b, big_h // s, big_w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, big_h, big_w, c)
        out = torch.roll(out, (self.shift, self.shift), (1, 2)) if self.shift else out
        return out[:, :hh, :ww]


class PackedAttention(_Records):
    """Several images' tokens packed into one (1, ΣT, D) sequence, their boundaries in
    ``cu_seqlens``; the module builds a block-diagonal mask from them and hands it to
    scaled_dot_product_attention (the vision towers of recent multimodal models)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens):
        _, t, c = x.shape
        segment = torch.bucketize(torch.arange(t), cu_seqlens[1:], right=True)
        allowed = segment[:, None] == segment[None, :]
        q, k, v = self.qkv(x).reshape(1, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1) * (c // self.h) ** -0.5).masked_fill(~allowed, float("-inf"))
        self.keep(logits, logits.softmax(-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(out.transpose(1, 2).reshape(1, t, c))


class SegmentAttention(PackedAttention):
    """Attention within segments of its tokens (``cu_seqlens``), one softmax per segment, as eager
    attention over a packed sequence computes it (MiniCPM-V's window merger). Records each
    segment's logits and map, in order (``last_logits``, ``last_probs``: lists). Laid out as
    timm's attention (``qkv``, ``proj``, ``num_heads``), so that its name adapter claims it."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.num_heads = heads

    def forward(self, x, cu_seqlens):
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        k = k.roll(1, dims=-2) if getattr(self, "misread", False) else k  # keys of the neighbouring tokens
        outs, self.last_logits, self.last_probs = [], [], []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            logits = q[..., start:end, :] @ k[..., start:end, :].transpose(-2, -1) * (c // self.num_heads) ** -0.5
            probs = logits.softmax(-1)
            self.last_logits.append(logits.detach())
            self.last_probs.append(probs.detach())
            outs.append(probs @ v[..., start:end, :])
        return self.proj(torch.cat(outs, -2).transpose(1, 2).reshape(b, t, c))


class PerHeadPackedAttention(_Records):
    """q, k and v from one Linear packed per head, (B, T, heads, 3·r) (MaxViT's and Hiera's
    layout): each role's rows are one block per head, the heads 3·r rows apart."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, self.h, 3 * (d // self.h)).transpose(1, 2).chunk(3, dim=-1)
        logits = q @ k.transpose(-2, -1) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, d))


class HeadsFirstAttention(PerHeadPackedAttention):
    """NesT's layout: the tokens in blocks (one here), q, k and v (B, heads, blocks, T, r) with the
    heads before the blocks, and the context read back head-minor (channel c of head h at
    c·heads + h) by the output projection. Records the maps of the one block, (B, heads, T, T)."""

    def forward(self, x):
        b, t, d = x.shape
        blocks = x.reshape(b, 1, t, d)
        q, k, v = self.qkv(blocks).reshape(b, 1, t, 3, self.h, d // self.h).permute(3, 0, 4, 1, 2, 5)
        logits = q @ k.transpose(-2, -1) * (d // self.h) ** -0.5  # (B, heads, blocks, T, T)
        probs = logits.softmax(-1)
        self.keep(logits[:, :, 0], probs[:, :, 0])
        return self.proj((probs @ v).permute(0, 2, 3, 4, 1).reshape(b, t, d))


class CutWindowsAttention(PerHeadPackedAttention):
    """MaxViT's block attention: windows the model cut before the call, channels last,
    (B·windows, h, w, D), and q, k, v packed per head."""

    def forward(self, x):
        n, h, w, c = x.shape
        return super().forward(x.reshape(n, h * w, c)).reshape(n, h, w, c)


class WideValuesAttention(_Records):
    """LeViT's and EfficientFormer's layout: one Linear without a bias, then a per-channel gain and
    shift (their BatchNorm in eval mode, fresh: a gain of one), packed per head as (B, T, heads,
    r + r + 2·r): values twice as wide as queries and keys, an output projection from heads·2·r."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.r = heads, dim // heads
        self.qkv, self.proj = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(2 * dim, dim)
        self.gain, self.shift = nn.Parameter(torch.ones(4 * dim)), nn.Parameter(torch.zeros(4 * dim))

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x) * self.gain + self.shift
        q, k, v = qkv.reshape(b, t, self.h, 4 * self.r).transpose(1, 2).split([self.r, self.r, 2 * self.r], -1)
        logits = q @ k.transpose(-2, -1) * self.r ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class FullWidthNormAttention(_Records):
    """q and k each normalised over every head's channels at once, before the heads are split
    (OLMo-2's ``q_norm``/``k_norm``: an RMSNorm of the full width, computed in float32)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x):
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.h, d // self.h).transpose(1, 2)
        q = split(self.q_norm(self.q_proj(x).float()).to(x.dtype))
        k = split(self.k_norm(self.k_proj(x).float()).to(x.dtype))
        logits = q @ k.transpose(-2, -1) * (d // self.h) ** -0.5
        probs = self.keep(logits, logits.softmax(-1))
        return self.o_proj((probs @ split(self.v_proj(x))).transpose(1, 2).reshape(b, t, d))


class BatchHeadsAttention(_Records):
    """Heads folded into the batch, (B·heads, T, r), as ``rearrange(q, 'b n (h d) -> (b h) n d')``
    leaves them; the logits from ``torch.baddbmm`` with the scale as its ``alpha``."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        r = d // self.h
        q, k, v = (u.reshape(b, t, self.h, r).transpose(1, 2).reshape(b * self.h, t, r)
                   for u in self.qkv(x).chunk(3, dim=-1))
        logits = torch.baddbmm(torch.zeros(b * self.h, t, t, dtype=x.dtype), q, k.transpose(1, 2), alpha=r**-0.5)
        probs = logits.softmax(-1)
        self.keep(logits.view(b, self.h, t, t), probs.view(b, self.h, t, t))
        return self.proj(torch.bmm(probs, v).view(b, self.h, t, r).transpose(1, 2).reshape(b, t, d))


class RegroupedHeadsAttention(BatchHeadsAttention):
    """The heads folded into the batch as Bloom writes them: ``baddbmm`` given q and kᵀ by keyword,
    the softmax on the (B, heads, T, T) view, ``torch.masked_fill`` after it, and the map folded
    back to (B·heads, T, T) for ``torch.bmm``."""

    def forward(self, x):
        b, t, d = x.shape
        r = d // self.h
        q, k, v = (u.reshape(b, t, self.h, r).transpose(1, 2).reshape(b * self.h, t, r)
                   for u in self.qkv(x).chunk(3, dim=-1))
        logits = torch.zeros(b * self.h, t, t, dtype=x.dtype).baddbmm(batch1=q, batch2=k.transpose(1, 2), alpha=r**-0.5)
        logits = logits.view(b, self.h, t, t)
        probs = self.keep(logits, torch.masked_fill(logits.softmax(-1), torch.zeros(t, t, dtype=torch.bool), 0.0))
        context = torch.bmm(probs.view(b * self.h, t, t), v)
        return self.proj(context.view(b, self.h, t, r).transpose(1, 2).reshape(b, t, d))


STYLES = {"raw-linear": RawLinearAttention, "einsum": EinsumAttention, "conv-maps": ConvMapAttention,
          "module-dict": ModuleDictAttention, "linear-subclass": SubclassAttention,
          "packed-per-head": PerHeadPackedAttention, "heads-first": HeadsFirstAttention,
          "wide-values": WideValuesAttention, "batch-heads": BatchHeadsAttention,
          "regrouped-heads": RegroupedHeadsAttention}


class LearnedQueries(RawLinearAttention):
    """Queries made from a learned (T, D) Parameter, keys and values from the tokens: its q is not
    computed from its input at all."""

    def __init__(self, dim, heads, tokens=9):
        super().__init__(dim, heads)
        self.queries = nn.Parameter(torch.randn(tokens, dim))

    def forward(self, x):
        b, t, d = x.shape
        w = self.w_in.reshape(3, self.h, d // self.h, d)
        q = torch.einsum("td,hrd->htr", self.queries, w[0]).expand(b, -1, -1, -1)
        k, v = (torch.einsum("btd,hrd->bhtr", x, w[i]) for i in (1, 2))
        probs = self.keep(q @ k.transpose(-2, -1), (q @ k.transpose(-2, -1) * 0.25).softmax(-1))
        return nn.functional.linear((probs @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)
