"""Rotary position embeddings (2-D axial RoPE), described so that an adapter can recompute them.

A RoPE attention layer rotates q and k after their projections: pair f of a head's channels,
(c0, c1) = ``pairs[f]``, is turned by the angle ``freqs[f]`` · p, where p is the token's row
(``axes[f] = 0``) or column (1) on the grid; prefix (class) tokens are not rotated. In complex
form z = x_{c0} + i·x_{c1} ↦ z·e^{iθ}. Channels in no pair are left as they are.

A module declares its rotation by holding a submodule with a ``rotary()`` method that returns
a :class:`Rotary` (structinit's own :class:`~structinit.models.rope.Rotary2d` does); the
adapter then applies it in :meth:`~structinit.adapters.AttentionAdapter.qk_features`, and the
probe compares that recomputation with the model's own logits as for any other layer, so a
description that does not match what the module computes is refused, not trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Rotary", "find_rotary"]


@dataclass(frozen=True)
class Rotary:
    """What a layer's 2-D rotary embedding does to each head's q and k (module doc)."""

    freqs: torch.Tensor                    # (F,) radians per token
    axes: tuple[int, ...]                  # (F,) 0: rotates with the row, 1: with the column
    pairs: tuple[tuple[int, int], ...]     # (F,) the two channels of each pair, within a head
    grid: tuple[int, int]
    num_prefix_tokens: int = 0

    def angles(self) -> torch.Tensor:
        """(h·w, F): the angle of every pair at every grid token, row-major."""
        h, w = self.grid
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pos = torch.stack([y.flatten(), x.flatten()], 1).to(self.freqs.dtype)
        return pos[:, list(self.axes)] * self.freqs

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (..., T, r) with its grid tokens (after the prefix) rotated; T must be the
        prefix plus h·w tokens."""
        n = self.grid[0] * self.grid[1]
        if t.shape[-2] != self.num_prefix_tokens + n:
            raise ValueError(f"rotary: {t.shape[-2]} tokens, but the embedding is for {self.num_prefix_tokens} "
                             f"prefix + {self.grid[0]}×{self.grid[1]} grid tokens")
        angle = self.angles().to(t.device, t.dtype)
        cos, sin = torch.cos(angle), torch.sin(angle)  # (n, F)
        c0 = torch.tensor([p[0] for p in self.pairs], device=t.device)
        c1 = torch.tensor([p[1] for p in self.pairs], device=t.device)
        grid = t[..., self.num_prefix_tokens:, :]
        x0, x1 = grid[..., c0], grid[..., c1]
        out = grid.clone()
        out[..., c0] = x0 * cos - x1 * sin
        out[..., c1] = x0 * sin + x1 * cos
        return torch.cat([t[..., :self.num_prefix_tokens, :], out], dim=-2)


def find_rotary(module: nn.Module) -> Rotary | None:
    """The :class:`Rotary` a direct submodule of ``module`` declares (its ``rotary()``), or None."""
    for child in module.children():
        describe = getattr(child, "rotary", None)
        if callable(describe):
            found = describe()
            if isinstance(found, Rotary):
                return found
    return None
