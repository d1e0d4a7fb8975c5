"""2-D axial rotary position embedding (RoPE) for the ViT's attention, in timm's layout.

Each head's r channels form r/2 interleaved pairs (2c, 2c+1). The first r/4 pairs turn with
the token's row, the next r/4 with its column, at the frequencies θ^(−c/(r/4)), c = 0 … r/4−1
(timm's ``RotaryEmbeddingCat`` bands, EVA-02's layout). Prefix (class) tokens are not turned.
The rotation is written here as timm writes it (x·cos + rot(x)·sin), apart from the
description :meth:`Rotary2d.rotary` hands to the adapters, so that the probe checks one
against the other.
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters.rotary import Rotary

__all__ = ["Rotary2d"]


class Rotary2d(nn.Module):
    """Rotates q or k (..., T, head_dim) by the position of each grid token.

    Args:
        grid: (h, w) of the token grid.
        head_dim: channels per head, a multiple of 4 (two axes × pairs).
        theta: the base of the frequencies; the fastest band turns 1 radian per token.
        num_prefix_tokens: tokens in front of the grid, left as they are.
    """

    def __init__(self, grid: tuple[int, int], head_dim: int, theta: float = 100.0, num_prefix_tokens: int = 0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"head_dim={head_dim}: 2-D rotary embedding needs a multiple of 4 (two axes of pairs); "
                             "choose embed_dim and num_heads so that embed_dim / num_heads is")
        bands = head_dim // 4
        self.grid, self.num_prefix_tokens = tuple(grid), num_prefix_tokens
        self.register_buffer("freqs", theta ** (-torch.arange(bands, dtype=torch.float64) / bands), persistent=False)
        h, w = self.grid
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        angle = torch.cat([y.flatten()[:, None] * self.freqs, x.flatten()[:, None] * self.freqs], 1)  # (h·w, 2·bands)
        # Each pair's angle on both of its channels, as timm repeats them.
        self.register_buffer("sin", torch.sin(angle).repeat_interleave(2, -1).float(), persistent=False)
        self.register_buffer("cos", torch.cos(angle).repeat_interleave(2, -1).float(), persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        prefix, grid = t[..., :self.num_prefix_tokens, :], t[..., self.num_prefix_tokens:, :]
        turned = torch.stack([-grid[..., 1::2], grid[..., ::2]], -1).reshape(grid.shape)  # (−x1, x0) per pair
        rotated = grid * self.cos.to(t.dtype) + turned * self.sin.to(t.dtype)
        return torch.cat([prefix, rotated], dim=-2)

    def rotary(self) -> Rotary:
        """What :meth:`forward` does, for the adapters (:mod:`structinit.adapters.rotary`)."""
        h, w = self.grid
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        freqs = self.freqs.cpu()
        angles = torch.cat([y.flatten()[:, None] * freqs, x.flatten()[:, None] * freqs], 1)  # (h·w, 2·bands)
        return Rotary(angles=angles[None], pairs=tuple((2 * c, 2 * c + 1) for c in range(angles.shape[1])),
                      grid=self.grid, num_prefix_tokens=self.num_prefix_tokens)
