"""A nested hierarchical transformer in NesT's style, written out: the patch grid is cut into
blocks, each level adds its own position embedding to the blocks, (1, blocks, n, D), rows
running block by block and not row by row over the image, and attends within each block; a
3×3 convolution and a max-pool between levels halve the grid. Each attention records the softmax
its own forward formed (``last_probs``, (B, H, blocks, n, n)), the ground truth tests compare
structinit against."""

import torch
from torch import nn


def blockify(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, H, W, C) → (B, blocks, size², C), blocks row-major over the image, tokens row-major inside."""
    b, h, w, c = x.shape
    return x.reshape(b, h // size, size, w // size, size, c).transpose(2, 3).reshape(b, -1, size * size, c)


def deblockify(x: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of :func:`blockify`, back to (B, H, W, C)."""
    b, t, _, c = x.shape
    side = round(t**0.5)
    return x.reshape(b, side, side, size, size, c).transpose(2, 3).reshape(b, side * size, side * size, c)


class BlockAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.h, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):  # (B, blocks, n, D)
        b, t, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, n, 3, self.h, d // self.h).permute(3, 0, 4, 1, 2, 5)
        probs = ((q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5).softmax(-1)
        self.last_probs = probs.detach()
        return self.proj((probs @ v).permute(0, 2, 3, 4, 1).reshape(b, t, n, d))


class Level(nn.Module):
    def __init__(self, blocks: int, size: int, dim: int, heads: int, prev: int | None):
        super().__init__()
        self.size = size
        self.pool = nn.Identity() if prev is None else nn.Sequential(nn.Conv2d(prev, dim, 3, padding=1),
                                                                     nn.MaxPool2d(3, 2, padding=1))
        self.pos_embed = nn.Parameter(torch.randn(1, blocks, size * size, dim) * 0.02)
        self.norm, self.attn = nn.LayerNorm(dim), BlockAttention(dim, heads)

    def forward(self, x):  # (B, C, H, W) → (B, D, H', W')
        x = blockify(self.pool(x).permute(0, 2, 3, 1), self.size) + self.pos_embed
        x = x + self.attn(self.norm(x))
        return deblockify(x, self.size).permute(0, 3, 1, 2)


class NestedViT(nn.Module):
    """32×32 images, 2-pixel patches: a 16×16 grid in 16 blocks of 4×4, then 8×8 in 4 blocks."""

    def __init__(self, dims=(24, 48), heads=(3, 6), classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dims[0], 2, stride=2)
        self.levels = nn.Sequential(Level(16, 4, dims[0], heads[0], None), Level(4, 4, dims[1], heads[1], dims[0]))
        self.head = nn.Linear(dims[1], classes)

    def forward(self, images):
        return self.head(self.levels(self.patch(images)).mean((2, 3)))
