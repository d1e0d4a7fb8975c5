"""Attention modules that look like timm's (a fused ``qkv``, ``proj`` and ``num_heads``, so the
name-based adapter claims them) but compute something else, one broken assumption each, and
the helpers to put them into structinit's micro ViT."""

import torch
import torch.nn.functional as F
from torch import nn

import structinit


class Variant(nn.Module):
    """timm's attention with one change in how the map or the output is computed (``kind``)."""

    def __init__(self, attn: nn.Module, kind: str):
        super().__init__()
        self.qkv, self.proj, self.num_heads, self.kind = attn.qkv, attn.proj, attn.num_heads, kind
        h, dim = attn.num_heads, attn.qkv.in_features
        self.head_dim = dim // h
        if kind in ("talking_heads", "mix_after"):
            self.proj_l, self.proj_w = nn.Linear(h, h), nn.Linear(h, h)
        if kind == "conv_heads":  # EfficientFormerV2's: 1×1 convolutions with the heads as the maps' channels
            self.talking_head1, self.talking_head2 = nn.Conv2d(h, h, 1), nn.Conv2d(h, h, 1)
        if kind == "mix_params":  # vit-pytorch's CaiT: (h, h) Parameters in an einsum, before and after
            self.mix_pre, self.mix_post = nn.Parameter(torch.randn(h, h)), nn.Parameter(torch.randn(h, h))
        if kind == "qk_norm":
            self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        if kind == "extra_bias":
            self.pos_logits = nn.Parameter(torch.randn(h, 64, 64))
        self.scale = self.head_dim**-0.5

    def _qkv(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if self.kind == "per_head_packed":  # [q1 k1 v1 q2 k2 v2 …]: another layout of the same Linear
            return qkv.reshape(b, t, self.num_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        return qkv.reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self._qkv(x)
        if self.kind == "qk_norm":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kind == "linear":  # softmax over features and over tokens, then kᵀv: no T×T map
            context = q.softmax(-1) @ (k.softmax(-2).transpose(-2, -1) @ v)
            return self.proj(context.transpose(1, 2).reshape(b, t, d))
        if self.kind == "rotary":
            q, k = rotate(q), rotate(k)
            return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        logits = q @ k.transpose(-2, -1) * self.scale
        if self.kind == "talking_heads":
            logits = self.proj_l(logits.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        if self.kind == "conv_heads":
            logits = self.talking_head1(logits)
        if self.kind == "mix_params":
            logits = torch.einsum("bhij,hg->bgij", logits, self.mix_pre)
        if self.kind == "roll_heads":  # each head takes the next head's logits: mixing with no mixer to set
            logits = logits.roll(1, dims=1)
        if self.kind == "extra_bias":
            logits = logits + self.pos_logits[:, :t, :t]
        if self.kind == "flip_large":  # what a probe cannot see at init, where every logit is small
            logits = torch.where(logits.abs() < 3, logits, -logits)
        attn = logits.softmax(-1)
        if self.kind in ("talking_heads", "mix_after"):
            attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        if self.kind == "conv_heads":
            attn = self.talking_head2(attn)
        if self.kind == "mix_params":
            attn = torch.einsum("bhij,hg->bgij", attn, self.mix_post)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, H, T, r): pairs of channels rotated by an angle that grows with the position."""
    t, r = x.shape[-2], x.shape[-1]
    freq = 1.0 / (100 ** (torch.arange(0, r, 2, dtype=x.dtype) / r))
    angle = torch.arange(t, dtype=x.dtype)[:, None] * freq[None]
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


def micro_vit_with(kind: str | None, seed: int = 0) -> nn.Module:
    """structinit's micro ViT (8×8 grid, no class token) with every attention a :class:`Variant`
    (``None``: as built)."""
    torch.manual_seed(seed)
    model = structinit.create_model("vit_micro_patch2_16")
    if kind is not None:
        for block in model.blocks:
            block.attn = Variant(block.attn, kind)
    return model


class AttentionPool(nn.Module):
    """One learned query attending to every token (timm's AttentionPoolLatent, SigLIP's MAP
    head): separate q/k/v projections, an output projection and a head count, so the
    name-based adapter claims it."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.latent = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        h = self.num_heads
        q = self.q(self.latent.expand(b, -1, -1)).reshape(b, 1, h, -1).transpose(1, 2)
        k = self.k(x).reshape(b, t, h, -1).transpose(1, 2)
        v = self.v(x).reshape(b, t, h, -1).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1) * (d // h) ** -0.5).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, 1, d))[:, 0]


class PooledViT(nn.Module):
    """The micro ViT's blocks, then an attention-pooling head instead of average pooling."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        vit = structinit.create_model("vit_micro_patch2_16", num_classes=0)
        self.vit, self.pool = vit, AttentionPool(vit.embed_dim, 2)
        self.head = nn.Linear(vit.embed_dim, 10)

    def forward(self, img):
        return self.head(self.pool(self.vit.forward_features(img)))


class UnknownAttention(nn.Module):
    """Self-attention that neither a built-in adapter nor the trace reads: its projections are
    called ``to_qk`` and ``values``, and the rows of ``to_qk``'s output are shuffled, so a head's
    q rows follow no stride at all."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_qk, self.values, self.out = nn.Linear(dim, 2 * dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        rows = torch.randperm(2 * d, generator=torch.Generator().manual_seed(0))
        q, k = self.to_qk(x)[..., rows].reshape(b, t, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        v = self.values(x).reshape(b, t, self.heads, -1).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1)).softmax(-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, t, d))


class ConvPositionViT(nn.Module):
    """Patch conv, a depthwise positional conv (PCPVT's PEG), then blocks of unknown attention."""

    def __init__(self, dim: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.image_size, self.patch_size = 16, 2
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.peg = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.attn = UnknownAttention(dim, 2)
        self.head = nn.Linear(dim, 10)

    def forward(self, img):
        x = self.patch(img)
        x = (x + self.peg(x)).flatten(2).transpose(1, 2)
        x = x + self.attn(self.norm(x))
        return self.head(x.mean(1))


class ReorderedViT(nn.Module):
    """structinit's micro ViT whose tokens leave the [prefix, grid] order after the position
    embedding: ``shuffle`` puts them in a random order (MAE's masking at ratio 0), ``registers``
    appends learned tokens after the grid (vit-pytorch's registers)."""

    def __init__(self, shuffle: bool = False, registers: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.vit = structinit.create_model("vit_micro_patch2_16", depth=2)
        self.shuffle = shuffle
        self.registers = nn.Parameter(torch.randn(1, registers, self.vit.embed_dim) * 0.02) if registers else None

    def forward(self, img):
        vit = self.vit
        x = vit.patch_embed(img) + vit.pos_embed
        if self.shuffle:
            order = torch.rand(x.shape[0], x.shape[1]).argsort(1)
            x = torch.gather(x, 1, order[..., None].expand_as(x))
        if self.registers is not None:
            x = torch.cat([x, self.registers.expand(len(x), -1, -1)], 1)
        return vit.head(vit.norm(vit.blocks(x)).mean(1))


class SelfAttentionOnly(nn.Module):
    """Hugging Face's older layout: query/key/value and a head count in one module, which returns
    the per-head context; the output projection sits in a sibling (``output.dense``)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_attention_heads = heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).reshape(b, t, self.num_attention_heads, -1).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        attn = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        return ((attn @ v).transpose(1, 2).reshape(b, t, d),)


class SelfOutput(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim)

    def forward(self, x):
        return self.dense(x)


class SiblingAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention, self.output = SelfAttentionOnly(dim, heads), SelfOutput(dim)

    def forward(self, x):
        return self.output(self.attention(x)[0])


def micro_vit_with_sibling_output(seed: int = 0) -> nn.Module:
    """structinit's micro ViT whose attention keeps its output projection in a sibling module."""
    torch.manual_seed(seed)
    model = structinit.create_model("vit_micro_patch2_16")
    for block in model.blocks:
        block.attn = SiblingAttention(model.embed_dim, 2)
    return model


class SelfMaskedAttention(nn.Module):
    """vit-pytorch's LSA, written out: a fused ``to_qkv`` and ``to_out`` (no name-based adapter
    claims them), a learned temperature as the softmax scale, and each token's logit on itself
    masked."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(torch.log(torch.tensor((dim // heads) ** -0.5)) + 0.3)
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim))

    def forward(self, x):
        x = self.norm(x)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = q @ k.transpose(-1, -2) * self.temperature.exp()
        eye = torch.eye(dots.shape[-1], dtype=torch.bool, device=dots.device)
        attn = dots.masked_fill(eye, -torch.finfo(dots.dtype).max).softmax(-1)
        return self.to_out((attn @ v).transpose(1, 2).flatten(2))


class PublishedGPSA(nn.Module):
    """ConViT's gated positional self-attention as its published code (and timm) writes it:
    ``rel_indices`` of shape (1, N, N, 3) built in the forward, the two softmaxes mixed by a
    sigmoid gate, under a class name structinit does not know."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads, self.scale = heads, (dim // heads) ** -0.5
        self.qk = nn.Linear(dim, 2 * dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.pos_proj = nn.Linear(3, heads)
        self.gating_param = nn.Parameter(torch.ones(heads))
        self.register_buffer("rel_indices", torch.zeros(1, 1, 1, 3), persistent=False)

    def rel(self, n: int) -> torch.Tensor:
        side = int(n**0.5)
        ind = torch.arange(side).view(1, -1) - torch.arange(side).view(-1, 1)
        indx = ind.repeat(side, side)
        indy = ind.repeat_interleave(side, dim=0).repeat_interleave(side, dim=1)
        return torch.stack([indx, indy, indx**2 + indy**2], -1).float().unsqueeze(0)

    def forward(self, x):
        b, n, c = x.shape
        if self.rel_indices.shape[1] != n:
            self.rel_indices = self.rel(n)
        q, k = self.qk(x).reshape(b, n, 2, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        pos = self.pos_proj(self.rel_indices.expand(b, -1, -1, -1)).permute(0, 3, 1, 2).softmax(-1)
        content = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
        gate = torch.sigmoid(self.gating_param).view(1, -1, 1, 1)
        attn = (1.0 - gate) * content + gate * pos
        attn = attn / attn.sum(-1, keepdim=True)
        v = self.v(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


def micro_vit_with_module(make, seed: int = 0) -> nn.Module:
    """structinit's micro ViT (8×8 grid, no class token) with every attention ``make(dim, heads)``."""
    torch.manual_seed(seed)
    model = structinit.create_model("vit_micro_patch2_16")
    for block in model.blocks:
        block.attn = make(model.embed_dim, block.attn.num_heads)
    return model


class LateClassViT(nn.Module):
    """A ViT laid out as timm's ConViT (``patch_embed``, ``pos_embed`` of grid rows, ``cls_token``,
    ``blocks``), whose class token joins in front of the grid after its first block; ``joins``
    copies of it join (one is the model's; two make a count no token explains)."""

    def __init__(self, joins: int = 1):
        super().__init__()
        torch.manual_seed(0)
        vit = structinit.create_model("vit_micro_patch2_16", depth=3)
        self.patch_embed, self.pos_embed, self.blocks = vit.patch_embed, vit.pos_embed, vit.blocks
        self.norm, self.head = vit.norm, vit.head
        self.cls_token = nn.Parameter(torch.randn(1, 1, vit.embed_dim) * 0.02)
        self.joins = joins

    def forward(self, img):
        x = self.blocks[0](self.patch_embed(img) + self.pos_embed)
        x = torch.cat([self.cls_token.expand(len(x), self.joins, -1), x], 1)
        return self.head(self.norm(self.blocks[1:](x))[:, 0])
