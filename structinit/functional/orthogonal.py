"""Orthogonal initial kernels for ordinary convolutions (c_out, c_in, k, k), tensor out, every
draw through ``generator=``: the delta-orthogonal kernel (an orthogonal matrix at the centre
tap) and the truncated Cayley kernel (an exactly orthogonal circular convolution, cut back
to k×k)."""

from __future__ import annotations

import torch

from structinit.functional.cayley_conv import fft_conv_weight, semi_orthogonal_cayley
from structinit.utils import make_generator
from structinit.utils.checks import check_sizes

__all__ = ["cayley_kernel", "centre_tap", "conv_weight_from_fft", "delta_orthogonal_kernel", "orthogonal_matrix"]


def orthogonal_matrix(rows: int, cols: int, *, dtype: torch.dtype = torch.float32,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """A Haar-random (rows, cols) matrix with orthonormal columns (rows ≥ cols: MᵀM = I) or
    rows (rows < cols: MMᵀ = I): the QR factor of a Gaussian matrix, signs fixed by diag(R)
    (as ``torch.nn.init.orthogonal_``), computed in float64.

    Examples:
        >>> m = orthogonal_matrix(4, 2, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(m.T @ m, torch.eye(2), atol=1e-6)
        True
    """
    check_sizes(rows=rows, cols=cols)
    gen = make_generator(generator)
    tall = rows >= cols
    a = torch.randn(max(rows, cols), min(rows, cols), generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
    return (q if tall else q.T).to(dtype)


def centre_tap(k: int) -> int:
    """The tap (k − 1)//2: the centre for odd k, the upper-left of the central four for even k.
    It is the zero-shift tap of PyTorch's ``padding='same'`` and of padding (k − 1)//2 (the
    left/top padding, for any k), and of the circular padding of the Cayley layers.

    Examples:
        >>> centre_tap(3), centre_tap(4)
        (1, 1)
    """
    check_sizes(k=k)
    return (k - 1) // 2


def delta_orthogonal_kernel(c_out: int, c_in: int, k: int, *, gain: float = 1.0, dtype: torch.dtype = torch.float32,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """Delta-orthogonal kernel (Xiao et al. 2018), shape (c_out, c_in, k, k): ``gain`` times an
    orthogonal c_out×c_in matrix M (:func:`orthogonal_matrix`) at tap (:func:`centre_tap`) in
    both directions, zeros elsewhere. The convolution is then y[:, i, j] = M x[:, i, j] when
    that tap is the zero-shift one: norm-preserving (gain 1, c_out ≥ c_in) for any padding
    (zero, reflect, circular), co-isometric for c_out < c_in.

    Examples:
        >>> w = delta_orthogonal_kernel(3, 3, 3, generator=torch.Generator().manual_seed(0))
        >>> m = w[:, :, 1, 1]
        >>> torch.allclose(m.T @ m, torch.eye(3), atol=1e-6), float(w.abs().sum() - m.abs().sum())
        (True, 0.0)
    """
    m = orthogonal_matrix(c_out, c_in, dtype=dtype, generator=generator)
    c = centre_tap(k)
    w = torch.zeros(c_out, c_in, k, k, dtype=dtype)
    w[:, :, c, c] = gain * m
    return w


def conv_weight_from_fft(matrices: torch.Tensor, k: int) -> torch.Tensor:
    """The cross-correlation kernel whose :func:`~structinit.functional.cayley_conv.fft_conv_weight`
    on an n×n input is ``matrices`` (n, n//2 + 1, c_out, c_in), cut to its k×k taps around
    :func:`centre_tap` (the n×n kernel exactly when k = n). Inverse of fft_conv_weight:
    ŵ = conj(Ŵ · conj(phase)), w = irfft2(ŵ) read at taps 0..k−1 (offsets −p..k−1−p).
    Shape (c_out, c_in, k, k), real.

    Examples:
        >>> w = torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(conv_weight_from_fft(fft_conv_weight(w, 8), 3), w, atol=1e-6)
        True
    """
    n = matrices.shape[0]
    if matrices.dim() != 4 or matrices.shape[1] != n // 2 + 1 or not 1 <= k <= n:
        raise ValueError(f"matrices: expected (n, n//2 + 1, c_out, c_in) with k={k!r} in [1, n], "
                         f"got shape {tuple(matrices.shape)}")
    p = centre_tap(k)
    real = matrices.real.dtype
    u = torch.arange(n, device=matrices.device).view(n, 1, 1, 1)
    v = torch.arange(n // 2 + 1, device=matrices.device).view(1, -1, 1, 1)
    angle = (2 * torch.pi * p / n) * (u + v).to(real)
    w_hat = (matrices * torch.polar(torch.ones_like(angle), angle)).conj().permute(2, 3, 0, 1)
    return torch.fft.irfft2(w_hat, s=(n, n))[..., :k, :k]


def cayley_kernel(c_out: int, c_in: int, k: int, *, n: int | None = None, std: float = 0.1,
                  dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> torch.Tensor:
    """A truncated Cayley kernel, shape (c_out, c_in, k, k): draw G with i.i.d. N(0, σ²)
    taps, σ = ``std``/√(max(c_out, c_in)·k²) (so the skew part of the spectrum has entries of
    order ``std``); take the per-frequency Cayley map Q_f of its Fourier matrices on an n×n
    grid (:func:`~structinit.functional.cayley_conv.semi_orthogonal_cayley`, exactly orthogonal as
    an n×n circular conv) and cut the resulting kernel back to k×k (:func:`conv_weight_from_fft`).
    ``n`` defaults to max(16, 2k). Computed in float64.

    The truncation costs orthogonality. Measured (``generator`` seeded 0, c_out = c_in = 16,
    n = 16, float64; the error max_f |Ŵ_fᴴŴ_f − I| of the truncated kernel on a 32×32 grid,
    tests/test_orthogonal_init.py): k = 3: 0.043 at std 0.1, 0.23 at std 0.3, 0.61 at std 1;
    k = 4: 0.14, 0.45, 0.73 (an even kernel loses more: the adjoint's taps fall outside it).
    Small ``std`` stays near the delta-orthogonal kernel (about a quarter of the kernel's norm
    off the centre tap at std 0.1); large ``std`` is more random and less orthogonal.

    Examples:
        >>> w = cayley_kernel(4, 4, 3, generator=torch.Generator().manual_seed(0))
        >>> w.shape
        torch.Size([4, 4, 3, 3])
    """
    check_sizes(c_out=c_out, c_in=c_in, k=k)
    n = max(16, 2 * k) if n is None else n
    check_sizes(n=n)
    if n < k:
        raise ValueError(f"n={n}: the Fourier grid must be at least the kernel size k={k}; pass n ≥ {k} or None")
    gen = make_generator(generator)
    g = torch.randn(c_out, c_in, k, k, generator=gen, dtype=torch.float64) * (std / (max(c_out, c_in) * k * k) ** 0.5)
    q = semi_orthogonal_cayley(fft_conv_weight(g, n))
    return conv_weight_from_fft(q, k).to(dtype)
