r"""Closed-form impulse attention (the 2025 method).

Per layer, target *logits* T_h = L·H_h + ν·E_h ⊙ [H_h = 0] (L = 1000, ν = 3, E truncated
normal, std 0.6, clipped to ±2). With P = X̃ (N×D) and G = PᵀP = U S Vᵀ, the rank-r
truncated pseudo-inverse G⁺_r = V diag(1/s_1 … 1/s_r, 0 …) Uᵀ gives P⁺ = G⁺_r Pᵀ (D×N) and

    A_h = P⁺ T_h P⁺ᵀ   (D×D),   A_h ≈ U_h Σ_h V_hᵀ (top r),
    Q_h = U_h Σ_h^{½},  K_h = V_h Σ_h^{½},  each divided by its Frobenius norm and × qk_norm.

The small singular values of a LayerNormed sin-cos table are inverted as they are; that is
the published method, reproduced faithfully (``pinv_rank`` cuts it). Its numerical zeros are
not: such a table has rank at most h + w − 1, and where r exceeds it the published code divided
by values that are float64 rounding, which makes the weights depend on the machine's arithmetic.
A pseudo-inverse inverts the non-zero values only, and values below ``ZERO_RTOL`` × the largest
are zeros here.
"""

from __future__ import annotations

import torch

from structinit.functional.linalg import canonical_svd
from structinit.functional.targets import Offset, impulse_matrix

Factors = tuple[torch.Tensor, torch.Tensor]  # Wq, Wk of shape (heads, D, head_dim)


# Singular values of G = PᵀP below this fraction of the largest are zeros at float64 rounding
# (the smallest real ones of a LayerNormed sin-cos table are ~1e-5 of the largest).
ZERO_RTOL = 1e-10


def pinv_projector(p: torch.Tensor, rank: int) -> torch.Tensor:
    """P⁺ = G⁺_r Pᵀ (D×N) with G = PᵀP and a rank-``rank`` truncated pseudo-inverse, which
    inverts the top ``rank`` singular values that are not zero (≤ ``ZERO_RTOL`` × the largest)."""
    p = p.double()
    u, s, vh = canonical_svd(p.T @ p)
    keep = torch.arange(s.numel()) < rank
    if s.numel():
        keep &= s > ZERO_RTOL * s[0]  # s is descending
    inv = torch.zeros_like(s)
    inv[keep] = 1.0 / s[keep]
    return (vh.T * inv) @ u.T @ p.T


def closed_form_qk(p: torch.Tensor, grid: tuple[int, int], offsets: list[Offset], head_dim: int, *,
    generator: torch.Generator | None = None, logit_scale: float = 1000.0, noise: float = 3.0,
    qk_norm: float = 7.0, pinv_rank: int | None = None, projector: torch.Tensor | None = None) -> Factors:
    """Wq, Wk (heads, D, head_dim) for pseudo input ``p`` (N×D); fresh noise from ``generator``.
    The singular vectors are :func:`~structinit.functional.linalg.canonical_svd`'s, the same on
    every machine.
    ``projector`` may pass a precomputed :func:`pinv_projector` (it depends on p only)."""
    n = p.shape[0]
    pp = projector if projector is not None else pinv_projector(p, pinv_rank or head_dim)
    wq, wk = [], []
    for off in offsets:
        hm = impulse_matrix(grid, off, dtype=torch.float64)
        e = torch.empty(n, n, dtype=torch.float64)
        torch.nn.init.trunc_normal_(e, std=0.6, a=-2.0, b=2.0, generator=generator)
        t = logit_scale * hm + noise * e * (hm == 0)
        u, s, vh = canonical_svd(pp @ t @ pp.T)
        q = u[:, :head_dim] * s[:head_dim].sqrt()
        k = vh[:head_dim].T * s[:head_dim].sqrt()
        wq.append(qk_norm * q / q.norm())
        wk.append(qk_norm * k / k.norm())
    return torch.stack(wq), torch.stack(wk)
