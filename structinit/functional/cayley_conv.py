"""Orthogonal convolutions by the Cayley transform (Trockman & Kolter, ICLR 2021), tensor in
and tensor out.

A circular multi-channel convolution of an n×n input is block-diagonal in the 2-D Fourier
domain: frequency f = (u, v) multiplies the input's spectrum X̂_f (c_in) by a c_out×c_in
complex matrix Ŵ_f (:func:`fft_conv_weight`). The Cayley map Q = (I + A)⁻¹(I − A) of a
skew-Hermitian A (Aᴴ = −A) is unitary (:func:`cayley`), so applying it per frequency to the
skew-Hermitian part of Ŵ gives an exactly orthogonal convolution (:func:`cayley_conv_matrices`,
applied by :func:`fft_circular_conv`). Real inputs use the one-sided spectrum (``rfft2``):
n × (n//2 + 1) frequencies; the Cayley map commutes with complex conjugation, so the output is
real.
"""

from __future__ import annotations

import torch

__all__ = ["cayley", "cayley_conv_matrices", "fft_circular_conv", "fft_conv_weight", "orthogonality_error",
           "semi_orthogonal_cayley", "space_to_depth"]


def _check_real(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_complex() or not t.is_floating_point():
        raise TypeError(f"{name}: expected a real floating-point tensor, got dtype {t.dtype}; pass "
                        f"{name}.real or {name}.float() (complex inputs have no orthogonal real convolution here)")


def cayley(a: torch.Tensor) -> torch.Tensor:
    """The Cayley map Q = (I + A)⁻¹(I − A) = (I − A)(I + A)⁻¹ of a batch of skew-Hermitian
    matrices A (Aᴴ = −A; a real skew-symmetric A is a special case): Q is unitary (orthogonal
    for real A). Shape (…, c, c) → (…, c, c). I + A is always invertible, since the eigenvalues
    of A are imaginary.

    Examples:
        >>> a = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
        >>> q = cayley(a)
        >>> q
        tensor([[ 0., -1.],
                [ 1.,  0.]])
        >>> torch.allclose(q.T @ q, torch.eye(2))
        True
    """
    if not isinstance(a, torch.Tensor) or a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a: expected a (…, c, c) batch of square matrices, got "
                         f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}")
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye + a, eye - a)


def semi_orthogonal_cayley(w: torch.Tensor) -> torch.Tensor:
    """The Cayley map of a batch of c_out×c_in matrices W, shape (…, c_out, c_in) → same.

    c_out ≥ c_in: split W = [U; V] (U the first c_in rows), A = U − Uᴴ + VᴴV and
    Q = [(I + A)⁻¹(I − A); −2V(I + A)⁻¹], so QᴴQ = I_{c_in} (norm-preserving). For c_out = c_in
    this is :func:`cayley` of U − Uᴴ. c_out < c_in: the map of Wᵀ, transposed back, so
    QQᴴ = I_{c_out} (co-isometric: 1-Lipschitz, not norm-preserving). Real W gives real Q.

    Examples:
        >>> q = semi_orthogonal_cayley(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)))
        >>> torch.allclose(q.T @ q, torch.eye(3), atol=1e-6)
        True
    """
    c_out, c_in = w.shape[-2], w.shape[-1]
    if c_in > c_out:
        return semi_orthogonal_cayley(w.transpose(-2, -1)).transpose(-2, -1)
    u, v = w[..., :c_in, :], w[..., c_in:, :]
    eye = torch.eye(c_in, dtype=w.dtype, device=w.device)
    a = u - u.mH + v.mH @ v
    inv = torch.linalg.inv(eye + a)
    return torch.cat([inv @ (eye - a), -2 * v @ inv], dim=-2)


def _check_n(weight: torch.Tensor, n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n={n!r}: expected the input size, an int ≥ 1")
    k1, k2 = weight.shape[-2:]
    if k1 != k2:
        raise ValueError(f"weight: expected a square kernel (c_out, c_in, k, k), got {tuple(weight.shape)}")
    if k1 > n:
        raise ValueError(f"kernel size {k1} is larger than the input size n={n}; a circular convolution needs "
                         f"k ≤ n: use a kernel of at most {n} or an input of at least {k1}×{k1}")


def fft_conv_weight(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The per-frequency matrices of the circular convolution of an n×n input by ``weight``
    (c_out, c_in, k, k), as PyTorch computes it: the cross-correlation
    y[i, j] = Σ_{a,b} w[a, b] · x[(i + a − p) mod n, (j + b − p) mod n], p = (k − 1)//2, i.e.
    ``conv2d`` after circular padding of p left/top and k//2 right/bottom.

    Returns Ŵ of shape (n, n//2 + 1, c_out, c_in), complex, with Ŷ_f = Ŵ_f X̂_f for the
    ``rfft2`` spectra of input and output. Derivation: the cross-correlation is the circular
    convolution by h[m] = w[p − m], whose transform is
    Ĥ[u, v] = conj(ŵ[u, v]) · exp(−2πi p(u + v)/n) with ŵ = rfft2 of w zero-padded to n×n
    (conj: the flip of the correlation; the phase: the shift theorem for the centring by p).
    For even k the centre is the tap p = (k − 1)//2, PyTorch's 'same' convention.

    Examples:
        >>> w = torch.zeros(1, 1, 3, 3); w[0, 0, 1, 1] = 2.0   # a centred delta
        >>> fft_conv_weight(w, 4).real.flatten()                 # the same gain at every frequency
        tensor([2., 2., 2., 2., 2., 2., 2., 2., 2., 2., 2., 2.])
    """
    _check_real("weight", weight)
    if weight.dim() != 4:
        raise ValueError(f"weight: expected a (c_out, c_in, k, k) tensor, got shape {tuple(weight.shape)}")
    _check_n(weight, n)
    p = (weight.shape[-1] - 1) // 2
    w_hat = torch.fft.rfft2(weight, s=(n, n))  # (c_out, c_in, n, n//2 + 1)
    u = torch.arange(n, device=weight.device).view(n, 1)
    v = torch.arange(n // 2 + 1, device=weight.device).view(1, -1)
    angle = (-2 * torch.pi * p / n) * (u + v).to(weight.dtype)
    phase = torch.polar(torch.ones_like(angle), angle)
    return (w_hat.conj() * phase).permute(2, 3, 0, 1)


def cayley_conv_matrices(weight: torch.Tensor, n: int, alpha: torch.Tensor | float | None = None) -> torch.Tensor:
    """The per-frequency matrices of the orthogonal convolution parametrised by ``weight``
    (c_out, c_in, k, k) on an n×n input: Q_f = :func:`semi_orthogonal_cayley` of the Fourier
    matrices (:func:`fft_conv_weight`) of α·W/‖W‖_F. Shape (n, n//2 + 1, c_out, c_in), complex.

    c_out ≥ c_in: Q_fᴴQ_f = I at every frequency (the convolution preserves norms);
    c_out < c_in: Q_fQ_fᴴ = I (co-isometric). ``alpha`` (default ‖W‖_F, i.e. W itself) is the
    learnable scale; the result does not depend on the scale of W. Differentiable in both.

    Note: the published code normalises the one-sided Fourier weights and sets α lazily at the
    first call; here the spatial ‖W‖_F is used so that α exists before the input size is
    known. Both give Ŵ itself at initialisation.

    Examples:
        >>> w = torch.randn(4, 4, 3, 3, generator=torch.Generator().manual_seed(0))
        >>> q = cayley_conv_matrices(w, 8)
        >>> q.shape
        torch.Size([8, 5, 4, 4])
        >>> bool((q.mH @ q - torch.eye(4)).abs().max() < 1e-5)
        True
    """
    _check_real("weight", weight)
    norm = weight.norm()
    alpha = norm if alpha is None else alpha
    return semi_orthogonal_cayley(fft_conv_weight(weight * (alpha / norm), n))


def fft_circular_conv(x: torch.Tensor, matrices: torch.Tensor, *, onesided: bool = True) -> torch.Tensor:
    """Apply per-frequency matrices (n, n//2 + 1, c_out, c_in) to x (B, c_in, n, n) through
    the 2-D FFT: y = irfft2(Ŵ_f rfft2(x)_f), shape (B, c_out, n, n), real.

    ``onesided=False`` takes the full spectrum (n, n, c_out, c_in) (e.g. from ``fft2``) and
    returns the complex ``ifft2``, whose imaginary part is the residue a conjugate-symmetric
    spectrum would cancel (a check of realness).

    Examples:
        >>> x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        >>> w = torch.randn(3, 3, 3, 3, generator=torch.Generator().manual_seed(1))
        >>> y = fft_circular_conv(x, fft_conv_weight(w, 8))
        >>> ref = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="circular"), w)
        >>> torch.allclose(y, ref, atol=1e-5)
        True
    """
    _check_real("x", x)
    if x.dim() != 4 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"x: expected a (B, c_in, n, n) batch of square inputs, got shape {tuple(x.shape)}; "
                         "crop or pad the input to n×n")
    n = x.shape[-1]
    width = n // 2 + 1 if onesided else n
    if matrices.dim() != 4 or tuple(matrices.shape[:2]) != (n, width) or matrices.shape[-1] != x.shape[1]:
        raise ValueError(f"matrices: expected shape ({n}, {width}, c_out, {x.shape[1]}) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(matrices.shape)}; build them for n={n}")
    x_hat = (torch.fft.rfft2(x) if onesided else torch.fft.fft2(x)).permute(2, 3, 1, 0).contiguous()  # (n, w, c_in, B)
    y_hat = (matrices.to(x_hat.dtype) @ x_hat).permute(3, 2, 0, 1)  # (B, c_out, n, w)
    return torch.fft.irfft2(y_hat, s=(n, n)) if onesided else torch.fft.ifft2(y_hat)


def orthogonality_error(matrices: torch.Tensor) -> float:
    """max |QᴴQ − I| over a batch of (…, c_out, c_in) matrices (QQᴴ when c_out < c_in): 0 for
    an exactly semi-orthogonal (or co-isometric) map.

    Examples:
        >>> orthogonality_error(torch.eye(3)[:, :2])
        0.0
    """
    q = matrices if matrices.shape[-2] >= matrices.shape[-1] else matrices.mH
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    return float((q.mH @ q - eye).abs().max())


def space_to_depth(x: torch.Tensor, block: int = 2) -> torch.Tensor:
    """Invertible space-to-depth: (B, C, H, W) → (B, C·b², H/b, W/b), channel c·b² + i·b + j
    holding x[:, c, i::b, j::b] (einops ``b c (h i) (w j) -> b (c i j) h w``). A permutation of
    the entries, so it preserves norms exactly. H and W must be multiples of ``block``.

    Examples:
        >>> space_to_depth(torch.arange(16.0).view(1, 1, 4, 4))[0, :, 0, 0]
        tensor([0., 1., 4., 5.])
    """
    if x.dim() != 4 or x.shape[-1] % block or x.shape[-2] % block:
        raise ValueError(f"x: expected (B, C, H, W) with H and W multiples of block={block}, got shape "
                         f"{tuple(x.shape)}; crop or pad the input")
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // block, block, w // block, block)
    return x.permute(0, 1, 3, 5, 2, 4).reshape(b, c * block * block, h // block, w // block)
