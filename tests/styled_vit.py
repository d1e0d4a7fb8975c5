"""A small ViT around any attention style of :mod:`attention_styles`, its tokens laid out as
the style needs: a sequence, (B, D, H, W) maps, (B, H, W, D) windows, one packed sequence of
every image's tokens, or windows cut by the model before each call."""

import torch
from attention_styles import (
    STYLES,
    ConvNormMapAttention,
    CutWindowsAttention,
    FullWidthNormAttention,
    PackedAttention,
    SegmentAttention,
    ShiftedWindowAttention,
    WindowAttention,
)
from torch import nn


class ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of each pixel of a (B, D, H, W) map: each token normalised alone."""

    def forward(self, x):
        return super().forward(x.movedim(1, -1)).movedim(-1, 1)


class StyledViT(nn.Module):
    """A small pre-norm ViT on 16×16 images (patch 2: an 8×8 grid, a learned PE) whose attention
    is one of :data:`STYLES`, ``windows``, ``shifted-windows``, ``packed`` or ``conv-norm-maps``;
    ``conv-maps`` and ``conv-norm-maps`` keep the tokens as (B, D, H, W) maps throughout,
    ``windows`` and ``shifted-windows`` as (B, H, W, D),
    ``packed`` as one sequence of every image's tokens."""

    def __init__(self, style, dim=48, heads=3, depth=2, classes=10):
        super().__init__()
        self.maps, self.packed = style in ("conv-maps", "conv-norm-maps"), style == "packed"
        self.grid = style in ("windows", "shifted-windows")
        self.cut = style == "cut-windows"  # 2×2 windows of 4×4 tokens, cut by the model before each call
        self.segments = style == "segments"  # the same windows as segments of one sequence, window by window
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 64, dim) * 0.02)
        self.norms = nn.ModuleList(ChannelNorm(dim) if self.maps else nn.LayerNorm(dim) for _ in range(depth))
        make = (WindowAttention if self.grid else PackedAttention if self.packed
                else CutWindowsAttention if self.cut else SegmentAttention if self.segments
                else FullWidthNormAttention if style == "full-width-norm"
                else ConvNormMapAttention if style == "conv-norm-maps" else STYLES[style])
        self.attns = nn.ModuleList(ShiftedWindowAttention(dim, heads, shift=i % 2) if style == "shifted-windows"
                                   else make(dim, heads) for i in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos_embed
        if self.maps:
            x = x.transpose(1, 2).reshape(x.shape[0], -1, 8, 8)
        if self.grid:
            x = x.reshape(x.shape[0], 8, 8, -1)
        if self.packed:  # every image's 64 tokens one after the other in one sequence
            b = x.shape[0]
            x, seqlens = x.reshape(1, b * 64, -1), torch.arange(0, (b + 1) * 64, 64)
            for norm, attn in zip(self.norms, self.attns):
                x = x + attn(norm(x), cu_seqlens=seqlens)
            return self.head(x.reshape(b, 64, -1).mean(1))
        if self.segments:  # tokens put in window order, each window one segment
            order = torch.arange(64).reshape(2, 4, 2, 4).permute(0, 2, 1, 3).flatten()
            x, seqlens = x[:, order], torch.arange(0, 65, 16)
            for norm, attn in zip(self.norms, self.attns):
                x = x + attn(norm(x), cu_seqlens=seqlens)
            return self.head(x.mean(1))
        if self.cut:
            b, d = x.shape[0], x.shape[-1]
            cut = lambda y: y.reshape(b, 2, 4, 2, 4, d).permute(0, 1, 3, 2, 4, 5).reshape(b * 4, 4, 4, d)
            back = lambda y: y.reshape(b, 2, 2, 4, 4, d).permute(0, 1, 3, 2, 4, 5).reshape(b, 64, d)
            for norm, attn in zip(self.norms, self.attns):
                x = x + back(attn(cut(norm(x))))
            return self.head(x.mean(1))
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return self.head(x.flatten(2).mean(-1) if self.maps else x.flatten(1, -2).mean(1))
