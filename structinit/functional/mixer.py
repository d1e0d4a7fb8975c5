"""An MLP-Mixer's token-mixing MLP written as an impulse convolution on the token grid.

The token-mixing MLP of a Mixer block maps each channel's N tokens (a Wh×Ww grid, row-major)
as y = W₂ GELU(W₁ x + b₁) + b₂, with W₁: (hidden, N) and W₂: (N, hidden), the same weights for
every channel. The impulse with offset (dy, dx) is the shift y = S x, S the N×N matrix of
:func:`~structinit.functional.targets.impulse_matrix` (zero padding: a token whose neighbour
falls outside the grid reads 0). Two exact-enough ways through the nonlinearity:

- hidden ≥ 2N, exact: GELU(z) − GELU(−z) = z·(Φ(z) + Φ(−z)) = z, so W₁ = [S; −S], b₁ = 0,
  W₂ = [I, −I], b₂ = 0 gives y = S x for every x;
- N ≤ hidden < 2N, within ε: GELU(z + c) = (z + c)·Φ(z + c) → z + c once z + c ≫ 0, so
  W₁ = [S; 0], b₁ = c, W₂ = [I, 0], b₂ = −c gives y = S x − (S x + c)·Φ(−(S x + c)); with
  c = ``margin`` = 8 the error is below 1e-14 where S x ≥ 0, 6e-9 at −2, 1e-7 at −2.5 and
  1.3e-4 at −4 (LayerNorm'd tokens rarely go below −3).

The hidden units beyond those used are zero in both layers: they start silent and learn. The
MLP is shared by all channels, so one layer holds one offset (a per-channel-group impulse, as
in a depthwise convolution, cannot be written into shared weights).
"""

from __future__ import annotations

import torch

from structinit.functional.targets import Offset, impulse_matrix
from structinit.utils import check_int, check_number

__all__ = ["token_mixing_impulse", "token_mixing_linear"]


def token_mixing_linear(matrix: torch.Tensor, hidden: int, margin: float = 8.0) -> tuple[torch.Tensor, ...]:
    """(W₁ (hidden, N), b₁ (hidden,), W₂ (N, hidden), b₂ (N,)) of a token-mixing MLP that
    computes y = A x for the (N, N) ``matrix`` A: exactly when ``hidden`` ≥ 2N, else within
    GELU's tail at bias ``margin`` (see the module docstring, with A in place of S). Needs
    ``hidden`` ≥ N.

    Examples:
        >>> a = torch.tensor([[0.0, 2.0], [1.0, 0.0]])
        >>> w1, b1, w2, b2 = token_mixing_linear(a, hidden=4)
        >>> w2 @ torch.nn.functional.gelu(w1 @ torch.tensor([1.0, -3.0]) + b1) + b2
        tensor([-6.,  1.])
    """
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix has shape {tuple(matrix.shape)}: expected a square (N, N) token map")
    n, dtype = matrix.shape[0], matrix.dtype
    check_int("hidden", hidden, low=1)
    if hidden < n:
        raise ValueError(f"hidden={hidden}: the token-mixing MLP needs at least N = {n} hidden units to carry a "
                         "linear map of its N tokens; this model's token MLP is too narrow")
    check_number("margin", margin, low=0, low_open=True)
    eye = torch.eye(n, dtype=dtype)
    w1, b1 = torch.zeros(hidden, n, dtype=dtype), torch.zeros(hidden, dtype=dtype)
    w2, b2 = torch.zeros(n, hidden, dtype=dtype), torch.zeros(n, dtype=dtype)
    w1[:n], w2[:, :n] = matrix, eye
    if hidden >= 2 * n:  # GELU(z) − GELU(−z) = z
        w1[n : 2 * n], w2[:, n : 2 * n] = -matrix, -eye
    else:  # GELU(z + c) − c ≈ z
        b1[:n], b2[:] = margin, -margin
    return w1, b1, w2, b2


def token_mixing_impulse(grid: tuple[int, int], offset: Offset, hidden: int, margin: float = 8.0,
                         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """:func:`token_mixing_linear` for the shift S x of ``offset`` on ``grid`` (see the module
    docstring).

    Examples:
        >>> w1, b1, w2, b2 = token_mixing_impulse((2, 2), (0, 1), hidden=8)
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> w2 @ torch.nn.functional.gelu(w1 @ x + b1) + b2  # token (y, x) reads (y, x + 1)
        tensor([2., 0., 4., 0.])
    """
    return token_mixing_linear(impulse_matrix(grid, offset, dtype=dtype), hidden, margin)
