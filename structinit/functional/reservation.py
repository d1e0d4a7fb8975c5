r"""Position reservation: keep the subspace that attention reads position from free of
content at init.

In a plain ViT the query/key readout of a structured init reads position out of the
directions the position embedding spans. After the first LayerNorm those are the row space
of Z = LN(PE) (N×D; every row has zero mean, so the space is orthogonal to the all-ones
vector that LayerNorm removes). If patch content and every block's residual writes are
orthogonal to that space, then for a token x = p + c with Uᵀc = 0

    Uᵀ LN(x) = Uᵀ (p + c − mean(p + c)·1) / σ(x) = Uᵀ p / σ(x),

so position stays exactly readable in every layer; only the per-token scale σ(x), which the
content still sets, remains.

The functions here compute U and project it out of weights whose *outputs* (rows, in
``nn.Linear`` / ``nn.Conv2d`` layout) land in the residual stream.
"""

from __future__ import annotations

import torch

from structinit.functional.attention import layer_norm_tokens


def position_basis(pe: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
    """Orthonormal basis U (D×r), float64, of the row space of LayerNorm(``pe``).

    ``pe`` is the (N, D) position embedding of the grid tokens. Singular values below
    ``rtol`` × the largest count as zero (the 2-D sin-cos table on an h×w grid has rank at
    most h + w − 1, its trailing singular values are numerical noise).

    Examples:
        >>> pe = structinit.sincos_2d((8, 8), 64)
        >>> position_basis(pe).shape
        torch.Size([64, 15])
    """
    z = layer_norm_tokens(pe)
    _, s, vh = torch.linalg.svd(z, full_matrices=False)
    rank = int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    return vh[:rank].T.contiguous()


def free_width(basis: torch.Tensor) -> int:
    """Directions of the residual stream left to content once ``basis`` is reserved: D − 1 − r
    (LayerNorm removes the mean direction, which the basis is orthogonal to)."""
    d, r = basis.shape
    return d - 1 - r


def project_out(weight: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``weight`` with its output rows moved out of span(``basis``): W − U (Uᵀ W).

    ``weight`` has the output channel first, (D, …) as in ``nn.Linear``, ``nn.Conv2d`` or a
    bias (D,); the result has the same shape and dtype, and Uᵀ result = 0 to the rounding of
    that dtype. The projection runs in ``weight``'s dtype (at least float32): float64 leaves a
    smaller remainder in span(U), but both lie at the level of the weight's own rounding, and
    float64 costs twice as much on a wide MLP output.
    """
    dtype = torch.promote_types(weight.dtype, torch.float32)
    w = weight.detach().to(dtype).reshape(weight.shape[0], -1)
    u = basis.to(dtype)
    # one fused product w − u (uᵀ w): a single full-size result, not two (a wide MLP output is large)
    return torch.addmm(w, u, u.T @ w, alpha=-1).reshape(weight.shape).to(weight.dtype)


def project_out_tokens(tokens: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``tokens`` (…, D), channel last, with span(``basis``) removed: t − (t U) Uᵀ; same shape
    and dtype."""
    rows = tokens.reshape(-1, tokens.shape[-1])
    return project_out(rows.T, basis).T.reshape(tokens.shape)  # tokens as the columns of a weight
