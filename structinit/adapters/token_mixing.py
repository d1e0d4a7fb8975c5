"""Token-mixing MLPs (MLP-Mixer): the layers an impulse shift of the token grid is written into.

A token-mixing MLP maps each channel's N tokens through N → hidden → N. It is found by
structure: a module's ``mlp_tokens`` child with Linear ``fc1`` (N → hidden) and ``fc2``
(hidden → N), as in timm's and structinit's ``MixerBlock``. The token grid is the patch
embedding's (a module with ``grid_size`` whose product is N), or √N × √N for a square N.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["find_token_mixing_layers", "is_token_mixing", "token_grid"]


def is_token_mixing(module: object) -> bool:
    """True for an MLP ``mlp_tokens`` child with Linear fc1 (N → hidden) and fc2 (hidden → N)."""
    mlp = getattr(module, "mlp_tokens", None)
    fc1, fc2 = getattr(mlp, "fc1", None), getattr(mlp, "fc2", None)
    return (isinstance(module, nn.Module) and isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)
            and fc1.in_features == fc2.out_features and fc1.out_features == fc2.in_features)


def find_token_mixing_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, token-mixing MLP) of every Mixer block of ``model``, in module order;
    a ValueError if there is none."""
    found = [(f"{name}.mlp_tokens" if name else "mlp_tokens", m.mlp_tokens) for name, m in model.named_modules()
             if is_token_mixing(m)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no token-mixing MLP (a block's mlp_tokens with Linear fc1 "
                         "and fc2 over the tokens, as in an MLP-Mixer)")
    return found


def token_grid(model: nn.Module, tokens: int) -> tuple[int, int]:
    """The (h, w) grid of ``tokens`` tokens: a patch embedding's ``grid_size`` with h·w = tokens,
    else the square side; a ValueError if neither gives one."""
    for module in model.modules():
        grid = getattr(module, "grid_size", None)
        if isinstance(grid, tuple) and len(grid) == 2 and grid[0] * grid[1] == tokens:
            return int(grid[0]), int(grid[1])
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"{type(model).__name__}: {tokens} tokens and no patch embedding with a grid_size of "
                         "that many; cannot lay the tokens out on a grid")
    return side, side
