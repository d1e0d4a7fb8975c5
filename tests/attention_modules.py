"""Small attention modules and models shared by the adapter, layout and round-trip tests."""


import math

import torch
from torch import nn

import structinit


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


class ShuffledRowsAttn(MyAttn):
    """MyAttn with q, k and v from one Linear whose output rows are shuffled: a head's q rows
    follow no stride at all, so only a registered adapter can read it."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.rows = torch.randperm(3 * dim, generator=torch.Generator().manual_seed(0)).tolist()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.wqkv(x)[..., self.rows].reshape(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        self.last_attn = attn.detach()
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


class EncoderOnly(nn.Module):
    """nn.TransformerEncoder on tokens: no patch_embed, no pos_embed → grid not inferable."""

    def __init__(self, dim=16):
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)
