r"""Gated positional self-attention (GPSA; ConViT, d'Ascoli et al., 2021) as tensor maths: the
relative positions it scores, its gated mixture of a content and a positional softmax, and the
positional weights of a Gaussian around an offset.

A GPSA head mixes its content probabilities with purely positional ones,

    A = (1 − σ(g_h)) · softmax(q kᵀ · scale) + σ(g_h) · softmax(pos_proj(r_ij)),  A ← A / Σ_j A,

where r_ij = (δx, δy, δx² + δy²) is the offset of key j from query i on the token grid (the
published ``rel_indices``). Positional weights (2α c_x, 2α c_y, −α) with zero bias give the
score −α‖δ − c‖² + α‖c‖², a Gaussian around the offset c (ConViT's local init puts one centre
per head). The ConViT model and the adapter that recognises GPSA in any package both compute
through these functions, so the model and its checks cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["gated_mixture", "gaussian_positional_weight", "relative_positions"]


def relative_positions(grid: tuple[int, int]) -> torch.Tensor:
    """(N, N, 3) float32, N = h·w: for query i and key j of the row-major h×w grid,
    (x_j − x_i, y_j − y_i, (x_j − x_i)² + (y_j − y_i)²).

    Examples:
        >>> relative_positions((1, 2))[0]
        tensor([[0., 0., 0.],
                [1., 0., 1.]])
    """
    h, w = grid
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    y, x = y.reshape(-1), x.reshape(-1)
    dx = (x[None, :] - x[:, None]).float()
    dy = (y[None, :] - y[:, None]).float()
    return torch.stack([dx, dy, dx**2 + dy**2], dim=-1)


def gated_mixture(content: torch.Tensor, positional: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """GPSA's map: content probabilities (…, H, T, T) mixed with positional probabilities
    (H, T, T) by the gates σ(g_h) of ``gate_logits`` (H,), each row renormalised to sum to one.
    Dtypes promote as in the published code (nothing is cast).

    Examples:
        >>> content = torch.full((1, 2, 2), 0.5)
        >>> positional = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
        >>> gated_mixture(content, positional, torch.zeros(1))
        tensor([[[0.7500, 0.2500],
                 [0.2500, 0.7500]]])
    """
    gate = torch.sigmoid(gate_logits).view(-1, 1, 1)
    attn = (1.0 - gate) * content + gate * positional
    return attn / attn.sum(dim=-1, keepdim=True)


def gaussian_positional_weight(centres: Sequence[tuple[float, float]], alpha: float = 1.0, *,
                               dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """(len(centres), 3): the ``pos_proj`` rows (2α c_x, 2α c_y, −α) that, with zero bias, score
    offset δ by −α‖δ − c‖² + const: a Gaussian around each head's centre c = (c_x, c_y).

    Examples:
        >>> gaussian_positional_weight([(1.0, 0.0), (0.0, -1.0)], alpha=2.0)
        tensor([[ 4.,  0., -2.],
                [ 0., -4., -2.]])
    """
    rows = torch.tensor([[2 * cx, 2 * cy, -1.0] for cx, cy in centres], dtype=dtype, device=device)
    return rows.reshape(-1, 3) * alpha
