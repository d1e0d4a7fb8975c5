r"""Mimetic initialisation of selective state-space layers (Trockman et al. 2024, arXiv 2410.11135):
the maths, with no knowledge of any model.

A Mamba-1 layer, channel c, state n (mambapy's layout)::

    h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t x_t,   y_t = C_tᵀ h_t (+ D x_t),   A = −exp(A_log)

unrolls into a causal "attention" over positions::

    y_i = Σ_{j≤i} (C_i·B_j) · exp(A Σ_{k=j+1..i} Δ_k) · Δ_j · x_j

With A → 0 (``A_log`` very negative) and Δ ≈ 1 it is unnormalised causal linear attention with
queries C_i = W_C x_i and keys B_j = W_B x_j; the mimetic init makes W_Cᵀ W_B ≈ αZ + βI, as
Trockman & Kolter (2023) make W_q W_kᵀ ≈ αZ + βI (:mod:`structinit.functional.mimetic`).
"""

from __future__ import annotations

import torch

from structinit.functional.mimetic import mimetic_factors
from structinit.utils import check_int

__all__ = ["causal_linear_attention", "mimetic_bc", "softplus_inverse", "ssm_attention", "ssm_retention"]


def softplus_inverse(y: torch.Tensor | float) -> torch.Tensor:
    r"""The x with softplus(x) = log(1 + eˣ) = y, for y > 0: x = y + log(−expm1(−y)).

    Computed in float64 for a Python number (numerically stable for tiny and large y).

    Examples:
        >>> softplus_inverse(1.0)            # log(e − 1)
        tensor(0.5413, dtype=torch.float64)
    """
    y = torch.as_tensor(y, dtype=torch.float64 if not torch.is_tensor(y) else None)
    if not (y > 0).all():
        raise ValueError("softplus_inverse: every value must be > 0 (softplus is positive)")
    return y + torch.log(-torch.expm1(-y))


def ssm_retention(A_log: torch.Tensor, delta: torch.Tensor | float, length: int) -> torch.Tensor:
    r"""How much of the state survives ``length`` = L ≥ 0 steps of constant step size Δ
    (``delta``, per channel (d_inner,) or one number): exp(−exp(A_log) · Δ · L) in (0, 1], per
    (channel, state), shape (d_inner, N) as ``A_log``, the SSM's log(−A).

    Examples:
        >>> ssm_retention(torch.full((2, 4), -8.0), 1.0, 256).min()   # A_log = −8, Δ = 1
        tensor(0.9177)
    """
    length = check_int("length", length, low=0)
    delta = torch.as_tensor(delta, dtype=A_log.dtype)
    if delta.dim() == 1:
        delta = delta[:, None]
    return torch.exp(-torch.exp(A_log) * delta * length)


def mimetic_bc(
    d_inner: int, d_state: int, alpha: float = 0.7, beta: float = 0.7, *, noise: str = "uniform",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""W_B, W_C (each (N, d_inner), N = ``d_state``, float64) with W_Cᵀ W_B = the rank-N truncation
    of M = α Z + β I (d_inner × d_inner), so that C_i·B_j = x_i M_N x_jᵀ: correlated tokens attend
    to each other.

    Scale convention (that of the attention mimetic init): Z has i.i.d. entries of mean 0 and
    variance 1/d_inner (``noise='uniform'`` on ±√(3/d_inner), or ``'normal'``), and the factors
    are balanced: with the SVD M = U S Vᵀ, W_C = (U S^{½})[:, :N]ᵀ and W_B = (S^{½} Vᵀ)[:N]. For
    N = d_inner the product is M itself, whose diagonal is β + O(α/√d_inner).

    W_C ≠ W_B whenever Z is not symmetric (α ≠ 0), as the paper advises (B and C not equal).

    Raises ``ValueError`` if N > d_inner (the product has rank ≤ d_inner, so the truncation is
    undefined: use d_state ≤ expand·d_model).

    Examples:
        >>> w_b, w_c = mimetic_bc(16, 4, generator=torch.Generator().manual_seed(0))
        >>> w_b.shape, (w_c.T @ w_b).shape
        (torch.Size([4, 16]), torch.Size([16, 16]))
    """
    d_inner = check_int("d_inner", d_inner, low=1)
    d_state = check_int("d_state", d_state, low=1)
    if d_state > d_inner:
        raise ValueError(f"d_state={d_state}: the B/C product W_Cᵀ W_B is d_inner × d_inner = {d_inner} × {d_inner} "
                         f"and cannot have rank {d_state}; use d_state ≤ d_inner = {d_inner}")
    left, right, _ = mimetic_factors(d_inner, alpha, beta, noise=noise, generator=generator)
    return right[:d_state].clone(), left[:, :d_state].T.clone()


def _check_sequences(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, delta: torch.Tensor,
                     A: torch.Tensor | None) -> None:
    if x.dim() != 3 or delta.shape != x.shape:
        raise ValueError(f"x and delta must both be (batch, L, d_inner), got {tuple(x.shape)} and {tuple(delta.shape)}")
    if B.dim() != 3 or B.shape != C.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"B and C must both be (batch, L, N) with x's (batch, L) = {tuple(x.shape[:2])}, got "
                         f"{tuple(B.shape)} and {tuple(C.shape)}")
    if A is not None and A.shape != (x.shape[2], B.shape[2]):
        raise ValueError(f"A must be (d_inner, N) = {(x.shape[2], B.shape[2])}, got {tuple(A.shape)}")


def ssm_attention(B: torch.Tensor, C: torch.Tensor, delta: torch.Tensor,
                  A: torch.Tensor | None = None) -> torch.Tensor:
    r"""The SSM's causal "attention" matrix, materialised, per channel:

        a[b, i, j, c] = Σ_n C[b,i,n] B[b,j,n] · exp(A[c,n] · Σ_{k=j+1..i} Δ[b,k,c]) · Δ[b,j,c]   (j ≤ i), 0 above.

    Args:
        B, C: (batch, L, N).
        delta: Δ, (batch, L, d_inner), positive.
        A: (d_inner, N), the (negative) state matrix −exp(A_log); None means A = 0 (no decay).

    Returns:
        (batch, L, L, d_inner) in float64, so that y = Σ_j a[:, :, j] x[:, j] (:func:`causal_linear_attention`).
        Memory is batch·L²·d_inner·N: a reference for tests and diagnostics, not a layer.

    Examples:
        >>> B = C = torch.ones(1, 3, 2); delta = torch.ones(1, 3, 1)
        >>> ssm_attention(B, C, delta)[0, :, :, 0]
        tensor([[2., 0., 0.],
                [2., 2., 0.],
                [2., 2., 2.]], dtype=torch.float64)
    """
    length = B.shape[1]
    _check_sequences(torch.empty_like(delta), B, C, delta, A)
    B, C, delta = B.double(), C.double(), delta.double()
    mask = torch.ones(length, length, dtype=torch.bool, device=B.device).tril()
    if A is None:
        scores = torch.einsum("bin,bjn->bij", C, B)[..., None] * delta[:, None, :, :]
    else:
        cum = delta.cumsum(1)  # Σ_{k≤i} Δ_k; Σ_{k=j+1..i} Δ_k = cum_i − cum_j
        gap = (cum[:, :, None, :] - cum[:, None, :, :]).clamp(min=0)  # (b, i, j, c), 0 above the diagonal
        decay = torch.exp(gap[..., None] * A.double())  # (b, i, j, c, n)
        scores = torch.einsum("bin,bjn,bijcn->bijc", C, B, decay) * delta[:, None, :, :]
    return scores * mask[None, :, :, None]


def causal_linear_attention(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, delta: torch.Tensor,
                            A: torch.Tensor | None = None) -> torch.Tensor:
    r"""The selective scan (without the D skip) written as explicit causal linear attention,
    y[:, i] = Σ_{j≤i} a[:, i, j] x[:, j] (per channel), a = :func:`ssm_attention` (B, C, delta, A as
    there; A None: plain linear attention with weights Δ_j), for x (batch, L, d_inner).

    Returns y (batch, L, d_inner), in x's dtype. A reference for tests: it materialises
    :func:`ssm_attention`, O(batch·L²·d_inner·N).

    Examples:
        >>> x = torch.randn(1, 5, 3); B = C = torch.randn(1, 5, 2); delta = torch.ones(1, 5, 3)
        >>> causal_linear_attention(x, B, C, delta).shape
        torch.Size([1, 5, 3])
    """
    _check_sequences(x, B, C, delta, A)
    scores = ssm_attention(B, C, delta, A)
    return torch.einsum("bijc,bjc->bic", scores, x.double()).to(x.dtype)
