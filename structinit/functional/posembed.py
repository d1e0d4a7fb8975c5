"""Fixed 2-D sine-cosine position embeddings in timm's layout."""

from __future__ import annotations

import torch


def sincos_frequencies(dim: int, temperature: float = 10000.0, dtype=torch.float64) -> torch.Tensor:
    """Frequencies ω_j = temperature^(−j / (dim/4)), j = 0 … dim/4 − 1, shape (dim/4,)."""
    if dim <= 0 or dim % 4:
        raise ValueError(
            f"dim={dim}: a 2-D sin-cos position embedding needs a positive multiple of 4 "
            "(one sin and one cos per frequency, for each of the two axes)"
        )
    pos_dim = dim // 4
    return temperature ** (-torch.arange(pos_dim, dtype=dtype) / pos_dim)


def sincos_2d(
    grid: tuple[int, int], dim: int, temperature: float = 10000.0, dtype=torch.float32
) -> torch.Tensor:
    """2-D sin-cos table for an h×w token grid, shape (h·w, dim), rows in row-major order.

    Feature order is timm's ``[sin(y·ω), sin(x·ω), cos(y·ω), cos(x·ω)]`` with y the row and
    x the column (0-based), ω as in :func:`sincos_frequencies`. Every row has squared norm
    exactly dim/2, and the table has rank at most h + w − 1 (each feature depends on one axis).
    """
    h, w = grid
    omega = sincos_frequencies(dim, temperature)
    y, x = torch.meshgrid(
        torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij"
    )
    y = y.reshape(-1, 1) * omega
    x = x.reshape(-1, 1) * omega
    return torch.cat([y.sin(), x.sin(), y.cos(), x.cos()], dim=1).to(dtype)
