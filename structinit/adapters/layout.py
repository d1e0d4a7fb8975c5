"""Where the image tokens are: the token grid, the prefix (class/register) tokens, and the
position embedding rows that belong to the grid."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from structinit.utils import is_int


@dataclass(frozen=True)
class TokenLayout:
    """Tokens are ``num_prefix_tokens`` prefix tokens followed by an h×w grid, row-major."""

    grid: tuple[int, int]
    num_prefix_tokens: int = 0

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


def infer_layout(
    model: nn.Module, grid: tuple[int, int] | None = None, num_prefix_tokens: int | None = None
) -> TokenLayout:
    """Token layout of ``model``; explicit ``grid`` / ``num_prefix_tokens`` take precedence.

    The grid comes from ``patch_embed.grid_size`` (timm, structinit) or else from a square
    ``pos_embed``; prefix tokens from ``num_prefix_tokens`` or ``cls_token`` / ``reg_token``.
    """
    if num_prefix_tokens is None:
        num_prefix_tokens = getattr(model, "num_prefix_tokens", None)
    if num_prefix_tokens is None:
        num_prefix_tokens = int(getattr(model, "cls_token", None) is not None)
        reg = getattr(model, "reg_token", None)
        num_prefix_tokens += 0 if reg is None else reg.shape[1]
    if not is_int(num_prefix_tokens) or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens={num_prefix_tokens!r}: expected an int ≥ 0")
    num_prefix_tokens = int(num_prefix_tokens)
    if grid is None:
        pe_grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
        if pe_grid is not None:
            grid = tuple(int(g) for g in pe_grid)
        else:
            pos = getattr(model, "pos_embed", None)
            if isinstance(pos, torch.Tensor) and pos.ndim >= 2:
                n = pos.shape[-2] - (0 if getattr(model, "no_embed_class", False) else num_prefix_tokens)
                side = math.isqrt(max(n, 0))
                if side > 0 and side * side == n:
                    grid = (side, side)
    if grid is None:
        raise ValueError(
            f"cannot infer the token grid of {type(model).__name__}: it has no "
            "`patch_embed.grid_size` and no square `pos_embed`; pass grid=(h, w)"
        )
    if len(grid) != 2 or not all(is_int(g) and g > 0 for g in grid):
        raise ValueError(f"grid={grid!r}: expected two positive ints (h, w)")
    return TokenLayout((int(grid[0]), int(grid[1])), num_prefix_tokens)


def grid_pos_embed(model: nn.Module, layout: TokenLayout) -> torch.Tensor | None:
    """View (N, D) of the rows of ``model.pos_embed`` that belong to the grid, or None.

    timm's ``no_embed_class`` (and a PE with exactly N rows) means prefix tokens have no row.
    """
    pos = getattr(model, "pos_embed", None)
    if not isinstance(pos, torch.Tensor):
        return None
    rows = pos.reshape(-1, pos.shape[-1])
    n = layout.num_patches
    if rows.shape[0] == n:
        return rows
    if rows.shape[0] == n + layout.num_prefix_tokens:
        return rows[layout.num_prefix_tokens :]
    raise ValueError(
        f"pos_embed has {rows.shape[0]} rows but the layout has {n} grid tokens and "
        f"{layout.num_prefix_tokens} prefix tokens; pass grid=/num_prefix_tokens= that match"
    )
