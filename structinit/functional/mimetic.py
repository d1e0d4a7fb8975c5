r"""Mimetic initialisation (Trockman & Kolter, 2023): the maths.

Per head, W_q^h W_k^hᵀ = the best rank-r approximation of M = α Z + β I; per layer,
W_v W_o = γ Z' − δ I exactly, where Z has i.i.d. entries of mean 0 and variance 1/D
(uniform on ±√(3/D) by default, or normal). Factors come from the SVD M = U S Vᵀ:
L = U S^{½}, R = S^{½} Vᵀ, so L R = M and L[:, :r] R[:r] is its rank-r truncation.
"""

from __future__ import annotations

import math

import torch

from structinit.utils import check_number

NOISE = ("uniform", "normal")


def mimetic_noise(dim: int, noise: str = "uniform", *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Z (dim×dim), i.i.d. mean 0, variance 1/dim, float64."""
    if noise == "uniform":
        return (torch.rand(dim, dim, generator=generator, dtype=torch.float64) * 2 - 1) * math.sqrt(3.0 / dim)
    if noise == "normal":
        return torch.randn(dim, dim, generator=generator, dtype=torch.float64) / math.sqrt(dim)
    raise ValueError(f"noise={noise!r}: valid names are {', '.join(NOISE)}")


def mimetic_factors(
    dim: int, alpha: float, beta: float, *, noise: str = "uniform", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L, R, M): M = α Z + β I and its balanced factors L = U S^{½}, R = S^{½} Vᵀ (float64)."""
    check_number("alpha", alpha)
    check_number("beta", beta)
    m = alpha * mimetic_noise(dim, noise, generator=generator) + beta * torch.eye(dim, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(m)
    return u * s.sqrt(), s.sqrt()[:, None] * vh, m


def mimetic_qk(
    dim: int, num_heads: int, head_dim: int, *, alpha: float = 0.7, beta: float = 0.7,
    noise: str = "uniform", generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Wq, Wk (heads, D, r) with Wq[h] Wk[h]ᵀ = rank-r truncation of M_h (a fresh M per head),
    and the M_h themselves (heads, D, D)."""
    wq, wk, ms = [], [], []
    for _ in range(num_heads):
        left, right, m = mimetic_factors(dim, alpha, beta, noise=noise, generator=generator)
        wq.append(left[:, :head_dim])
        wk.append(right[:head_dim].T)
        ms.append(m)
    return torch.stack(wq), torch.stack(wk), torch.stack(ms)


def mimetic_vo(
    dim: int, inner: int, *, gamma: float = 0.4, delta: float = 0.4, noise: str = "uniform",
    generator: torch.Generator | None = None, reference_layout: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Wv (D, inner), Wo (inner, D) and M (D×D) with Wv Wo = M = γ Z − δ I (its rank-``inner``
    truncation when inner < D), so that x ↦ o(v(x)) is x ↦ x M.

    ``reference_layout=True`` reproduces the public ports, which store L and R in
    ``nn.Linear`` without transposing: the composite is then x (R L)ᵀ, not x M (same trace,
    a diagonal that is negative on average but not entry by entry, different noise). Only for
    comparisons with those ports.
    """
    check_number("gamma", gamma)
    check_number("delta", delta)
    left, right, m = mimetic_factors(dim, gamma, -delta, noise=noise, generator=generator)
    left, right = left[:, :inner], right[:inner]
    if reference_layout:
        if inner != dim:
            raise ValueError("reference_layout=True needs square value/output projections")
        return left.T.clone(), right.T.clone(), m
    return left, right, m
