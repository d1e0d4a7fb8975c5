r"""Mimetic initialisation (Trockman & Kolter, 2023): the maths.

Per head, W_q^h W_k^hᵀ = the best rank-r approximation of M = α Z + β I; per layer,
W_v W_o = γ Z' − δ I exactly (its best rank-``inner`` approximation when the heads are
narrower than D). Z is a D×D noise matrix of entry variance 1/D, drawn in one of two ways:

- ``noise='uniform'`` / ``'normal'``: i.i.d. entries (uniform on ±√(3/D), or Gaussian), the
  published recipe. The factors come from the SVD M = U S Vᵀ: L = U S^{½}, R = S^{½} Vᵀ, so
  L R = M and L[:, :r] R[:r] is its rank-r truncation. One dense D×D SVD per head: O(D³).
- ``noise='circular'``: Z = Q B Qᵀ, a random *normal* matrix. Q is Haar-random orthogonal and
  B is block-diagonal with 2×2 blocks ρ·[[cos θ, −sin θ], [sin θ, cos θ]], i.e. eigenvalues
  ρe^{±iθ} filling the disk of radius √2 evenly (:func:`circular_spectrum`; plus ±1 when D is
  odd), so that ‖Z‖²_F = D, tr Z = 0 (±1) and the entries have mean 0 and variance 1/D, as
  with i.i.d. noise. Because M = Q (αB + βI) Qᵀ is normal, its SVD is known in closed form:
  each block αμ + β = s·R(φ) has both singular values s = |αμ + β|, and the best rank-r
  approximation keeps the blocks with the largest s. Only the r columns of Q those blocks use
  are drawn (a D×r Gaussian, orthonormalised): O(D r²) per head instead of O(D³), with no
  D×D matrix formed. The factors are balanced like the SVD ones: W_q = Q_r S^{½} and
  W_k = Q_r Rᵀ S^{½}, so W_q ≠ W_k (R holds the blocks' rotations).

The circular noise's rank-r products have the same diagonal-dominant shape as i.i.d. noise's;
it differs in that Z commutes with Zᵀ (its eigenvectors are orthogonal).
"""

from __future__ import annotations

import math

import torch

from structinit.functional.linalg import canonical_svd
from structinit.utils import check_number

NOISE = ("uniform", "normal", "circular")
DENSE_NOISE = ("uniform", "normal")  # i.i.d. entries: Z is drawn as a dense matrix


def mimetic_noise(dim: int, noise: str = "uniform", *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Z (dim×dim), i.i.d. mean 0, variance 1/dim, float64 (``noise='uniform'`` or ``'normal'``;
    the circular noise is never formed densely, see :func:`circular_factors`)."""
    if noise == "uniform":
        return (torch.rand(dim, dim, generator=generator, dtype=torch.float64) * 2 - 1) * math.sqrt(3.0 / dim)
    if noise == "normal":
        return torch.randn(dim, dim, generator=generator, dtype=torch.float64) / math.sqrt(dim)
    raise ValueError(f"noise={noise!r}: valid names for a dense Z are {', '.join(DENSE_NOISE)}")


def circular_spectrum(pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ, θ), each (pairs,) float64: the eigenvalues ρ e^{±iθ} of the circular noise, an even
    filling of the disk of radius √2.

    A sunflower pattern (radii √(2(i+½)/k), golden-ratio angles) fills the quarter disk
    0 ≤ θ < π/2 and is mirrored to π − θ, so the real parts cancel: tr Z = 0, as the trace of
    i.i.d. noise is O(1) (independently drawn eigenvalues would make it O(√D)). Σ ρ² = pairs,
    so E|μ|² = 1 and ‖Z‖²_F = 2·pairs. An odd ``pairs`` adds ρ = 1 at θ = π/2.
    """
    k = pairs // 2
    i = torch.arange(k, dtype=torch.float64)
    rho = (2 * (i + 0.5) / max(k, 1)).sqrt()
    theta = (math.pi / 2) * torch.frac((i + 0.5) * (math.sqrt(5) - 1) / 2)
    extra = torch.ones(pairs % 2, dtype=torch.float64)
    return torch.cat([rho, rho, extra]), torch.cat([theta, math.pi - theta, extra * (math.pi / 2)])


def circular_factors(
    dim: int, rank: int, alpha: float, beta: float, *, heads: int = 1, with_target: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    r"""Balanced factors of the best rank-``rank`` approximation of M = α Z + β I for ``heads``
    independent circular noise matrices Z (see the module docstring), without forming Z.

    Returns L (heads, D, rank) and R (heads, rank, D), float64, with L[h] R[h] the truncation of
    M_h, L = U S^{½} and R = S^{½} Vᵀ for an SVD U S Vᵀ of it. With ``with_target=True`` the
    third value is the M_h themselves (heads, D, D), built from the same draws plus the rest of
    Q (O(D³): for tests and diagnostics); otherwise None. Draw order: the sign of the real
    eigenvalue (odd D), then the Gaussian columns of Q every head uses, then (only for the
    targets) the rest of Q, so the factors are the same with or without targets.

    When the rank boundary falls inside a 2×2 block (odd ``rank``, or the real eigenvalue of an
    odd D among the kept ones), the truncation keeps one direction of that block: still a best
    rank-``rank`` approximation, since both of its singular values are equal.

    Examples:
        >>> left, right, m = circular_factors(16, 4, 0.7, 0.7, with_target=True,
        ...                                   generator=torch.Generator().manual_seed(0))
        >>> left.shape, right.shape, m.shape
        (torch.Size([1, 16, 4]), torch.Size([1, 4, 16]), torch.Size([1, 16, 16]))
    """
    check_number("alpha", alpha)
    check_number("beta", beta)
    size, mag, phi, start = _sorted_blocks(dim, alpha, beta, heads, generator)
    cols = min(dim, rank + 1)  # a block cut by the rank boundary needs its second direction
    # The first cols columns of Haar-random orthogonal matrices. The Gaussian draws are float32
    # (faster than float64 on CPU, and as good a Gaussian for this).
    q = _orthonormalise(torch.randn(heads, dim, cols, generator=generator, dtype=torch.float32).double())
    left, right = _balanced_factors(q, rank, size, mag, phi, start)
    if not with_target:
        return left, right, None
    q = torch.cat([q, _haar_complement(q, generator)], 2)
    return left, right, q @ _block_matrix(dim, size, mag, phi, start) @ q.transpose(1, 2)


def _sorted_blocks(dim: int, alpha: float, beta: float, heads: int, generator: torch.Generator | None):
    """The blocks of M = α Z + β I in Z's eigenbasis, for :func:`circular_factors`: (size, s,
    φ, start), each (heads, blocks), largest s first; draws the sign of an odd D's real eigenvalue."""
    pairs, odd = dim // 2, dim % 2
    rho, theta = circular_spectrum(pairs)
    rho, theta = rho.expand(heads, pairs), theta.expand(heads, pairs)
    # The real eigenvalue of an odd D: ±1 (a drawn sign), so that ‖Z‖²_F = D exactly.
    real = torch.randint(0, 2, (heads, odd), generator=generator).double() * 2 - 1
    # Blocks of M: c = α μ + β, as magnitude s and angle φ; the real eigenvalue is a block of
    # size 1 with φ ∈ {0, π} (its sign). Ties in s (the spectrum is mirrored) keep block order.
    c = torch.polar(rho, theta) * alpha + beta
    c_real = real * alpha + beta
    size = torch.cat([torch.full((heads, pairs), 2), torch.ones(heads, odd, dtype=torch.long)], 1)
    mag = torch.cat([c.abs(), c_real.abs()], 1)
    phi = torch.cat([c.angle(), torch.where(c_real < 0, math.pi, 0.0)], 1)
    # Largest blocks first (stable, so ties keep draw order); each block starts at the column
    # after the blocks before it.
    order = torch.sort(mag, dim=1, descending=True, stable=True).indices
    size, mag, phi = size.gather(1, order), mag.gather(1, order), phi.gather(1, order)
    return size, mag, phi, size.cumsum(1) - size


def _balanced_factors(q: torch.Tensor, rank: int, size, mag, phi, start) -> tuple[torch.Tensor, torch.Tensor]:
    """L (heads, D, rank) and R (heads, rank, D) of :func:`circular_factors` from the first
    columns ``q`` of Q and the sorted blocks."""
    heads, cols = q.shape[0], q.shape[2]
    kept = start < rank
    # S^{½} per factor column, and R = (Q K)ᵀ where K (cols × rank) has two non-zeros per column:
    # for a pair at columns (a, a+1), K's block is S^{½}·R(φ)ᵀ = √s [[cos φ, sin φ], [−sin φ, cos φ]];
    # a real eigenvalue at column a has K[a, a] = sign(c)·√|c|.
    h_idx, u_idx = kept.nonzero(as_tuple=True)
    a, sq = start[h_idx, u_idx], mag[h_idx, u_idx].sqrt()
    cos, sin = torch.cos(phi[h_idx, u_idx]) * sq, torch.sin(phi[h_idx, u_idx]) * sq
    pair = size[h_idx, u_idx] == 2
    second = pair & (a + 1 < rank)  # the pair's second column is kept too (not cut by the boundary)
    root = torch.zeros(heads, rank, dtype=torch.float64)
    root[h_idx, a] = sq
    root[h_idx[second], a[second] + 1] = sq[second]
    # Column j of Q K = Q_j·d_j + Q_{j+1}·u_j + Q_{j−1}·l_j: a pair at (a, a+1) has columns
    # Q_a cos φ − Q_{a+1} sin φ and Q_a sin φ + Q_{a+1} cos φ (times √s); a real eigenvalue Q_a·cos φ.
    d = torch.zeros(heads, rank, dtype=torch.float64)
    u = torch.zeros(heads, rank, dtype=torch.float64)
    low = torch.zeros(heads, rank, dtype=torch.float64)
    d[h_idx, a] = cos
    u[h_idx[pair], a[pair]] = -sin[pair]
    hs, a2 = h_idx[second], a[second]
    d[hs, a2 + 1], low[hs, a2 + 1] = cos[second], sin[second]
    left = q[..., :rank] * root[:, None, :]
    qk = q[..., :rank] * d[:, None, :]
    qk[..., :-1] += q[..., 1:rank] * u[:, None, :-1]
    if cols > rank:  # a pair cut by the rank boundary reaches one column past it
        qk[..., -1] += q[..., rank] * u[:, None, -1]
    qk[..., 1:] += q[..., : rank - 1] * low[:, None, 1:]
    return left, qk.transpose(1, 2)


def _block_matrix(dim: int, size, mag, phi, start) -> torch.Tensor:
    """(heads, D, D): the sorted blocks s·R(φ) (a real eigenvalue's: s·cos φ) on the diagonal,
    so that Q times it times Qᵀ is M."""
    heads = size.shape[0]
    blocks = torch.zeros(heads, dim, dim, dtype=torch.float64)
    for h in range(heads):
        for j in range(size.shape[1]):
            at, s_, f = int(start[h, j]), float(mag[h, j]), float(phi[h, j])
            if size[h, j] == 2:
                blocks[h, at:at + 2, at:at + 2] = s_ * torch.tensor(
                    [[math.cos(f), -math.sin(f)], [math.sin(f), math.cos(f)]], dtype=torch.float64)
            else:
                blocks[h, at, at] = s_ * math.cos(f)
    return blocks


def _orthonormalise(g: torch.Tensor, space: int | None = None) -> torch.Tensor:
    """Q of g = Q R (R upper-triangular with a positive diagonal) for a batch of full-rank
    Gaussian g (heads, rows, cols) whose columns lie in a ``space``-dimensional subspace
    (default: all rows), from BLAS-3 steps only: unlike LAPACK's Householder QR, whose rounding
    depends on the number of threads, they give bit-identical results on any thread count, so
    a seed gives the same weights on 1 or 16 threads.

    Cholesky QR (Q = g R⁻¹ with Rᵀ R = gᵀ g) loses orthogonality as ε·cond(g)². A Gaussian
    block at most half as wide as its space has cond ≤ (1 + √½)/(1 − √½) < 6, so one pass
    leaves ~1e-14. A wider g is split: its first half, then the second half projected off the
    first (one Gram–Schmidt step) and orthonormalised the same way within the space left to
    it; blocks narrower than 64 columns take two Cholesky passes instead. A square D = 768 Q
    comes out orthonormal to ~1e-11, and at a lower cost than Cholesky QR on the whole.
    """
    rows, cols = g.shape[-2:]
    space = rows if space is None else space
    if 2 * cols <= space:
        return _cholesky_qr(g, passes=1)
    if cols < 64:
        return _cholesky_qr(g, passes=2)
    half = cols // 2
    qa = _cholesky_qr(g[..., :half], passes=1)
    rest = g[..., half:]
    rest = rest - qa @ (qa.transpose(1, 2) @ rest)
    return torch.cat([qa, _orthonormalise(rest, space - half)], 2)


def _cholesky_qr(g: torch.Tensor, passes: int) -> torch.Tensor:
    """Cholesky QR, ``passes`` times (each takes the orthogonality error from ε·cond² of its
    input towards ε). A Gram matrix that Cholesky cannot factor (a near-singular draw) falls
    back to Householder QR."""
    q = g
    for _ in range(passes):
        chol, info = torch.linalg.cholesky_ex(q.transpose(1, 2) @ q)
        if bool(info.any()):
            q, r = torch.linalg.qr(g)
            return q * torch.sign(r.diagonal(dim1=1, dim2=2))[:, None, :]
        q = torch.linalg.solve_triangular(chol, q.transpose(1, 2), upper=False).transpose(1, 2)
    return q


def _haar_complement(q: torch.Tensor, generator) -> torch.Tensor:
    """(heads, dim, dim − cols): orthonormal columns completing q (heads, dim, cols) to a
    Haar-random orthogonal matrix (Gaussian columns, projected off q, orthonormalised)."""
    heads, dim, cols = q.shape
    g = torch.randn(heads, dim, dim - cols, generator=generator, dtype=torch.float32).double()
    return _orthonormalise(g - q @ (q.transpose(1, 2) @ g), space=dim - cols)  # square in what q leaves


def mimetic_factors(
    dim: int, alpha: float, beta: float, *, noise: str = "uniform", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L, R, M): M = α Z + β I and its balanced factors L = U S^{½}, R = S^{½} Vᵀ (float64),
    columns of L (rows of R) in decreasing singular value."""
    check_number("alpha", alpha)
    check_number("beta", beta)
    if noise == "circular":
        left, right, m = circular_factors(dim, dim, alpha, beta, with_target=True, generator=generator)
        return left[0], right[0], m[0]
    m = alpha * mimetic_noise(dim, noise, generator=generator) + beta * torch.eye(dim, dtype=torch.float64)
    u, s, vh = canonical_svd(m)  # signs fixed: the same factors on every machine
    return u * s.sqrt(), s.sqrt()[:, None] * vh, m


def mimetic_qk(
    dim: int, num_heads: int, head_dim: int, *, alpha: float = 0.7, beta: float = 0.7,
    noise: str = "uniform", generator: torch.Generator | None = None, with_target: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Wq, Wk (heads, D, r) with Wq[h] Wk[h]ᵀ = rank-r truncation of M_h (a fresh M per head),
    and the M_h themselves (heads, D, D), or None with ``with_target=False`` (which spares
    the circular noise its only O(D³) step). A head wider than the model (r > D) gets M_h
    itself, its channels past D zero (as :func:`mimetic_vo`'s).

    Examples:
        >>> wq, wk, m = mimetic_qk(64, 4, 16, noise="circular", generator=torch.Generator().manual_seed(0))
        >>> torch.linalg.matrix_rank(wq[0] @ wk[0].T).item()
        16
    """
    rank = min(head_dim, dim)
    if noise == "circular":
        left, right, m = circular_factors(dim, rank, alpha, beta, heads=num_heads, with_target=with_target,
                                          generator=generator)
        wq, wk = left, right.transpose(1, 2)
    else:
        heads = [mimetic_factors(dim, alpha, beta, noise=noise, generator=generator) for _ in range(num_heads)]
        wq, wk = (torch.stack([left[:, :rank] for left, _, _ in heads]),
                  torch.stack([right[:rank].T for _, right, _ in heads]))
        m = torch.stack([m for _, _, m in heads]) if with_target else None
    if head_dim > rank:  # the channels past D read nothing: Wq Wkᵀ is still M
        wq, wk = (torch.cat([w, w.new_zeros(num_heads, dim, head_dim - rank)], -1) for w in (wq, wk))
    return wq, wk, m


def mimetic_qk_grouped(
    dim: int, kv_of: tuple[int, ...], head_dim: int, *, alpha: float = 0.7, beta: float = 0.7,
    noise: str = "uniform", generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Wq (heads, D, r) and Wk (kv_heads, D, r) for grouped-query attention, where query head h
    reads key head ``kv_of[h]``: each key head serves a group G, so the products
    Wq[h] Wk[g]ᵀ ≈ M_h (M_h = α Z_h + β I, a fresh draw per query head) share Wk[g].

    Wk[g] spans the best common rank-r subspace of the group's targets: with the stacked
    S_g = [M_h]_{h∈G} = U Σ Vᵀ (:func:`~structinit.functional.linalg.canonical_svd`),
    Wk[g] = V_r (Σ_r / √|G|)^{½}, and each Wq[h] = M_h Wk[g] (Wk[g]ᵀ Wk[g])⁻¹, the least-squares
    best for that Wk[g]. A group of one is the ungrouped init: M_h's rank-r truncation, split
    as U S^{½}, V S^{½}.

    Examples:
        >>> wq, wk = mimetic_qk_grouped(32, (0, 0, 1, 1), 8, generator=torch.Generator().manual_seed(0))
        >>> tuple(wq.shape), tuple(wk.shape)
        ((4, 32, 8), (2, 32, 8))
    """
    heads = len(kv_of)
    _, _, m = mimetic_qk(dim, heads, head_dim, alpha=alpha, beta=beta, noise=noise, generator=generator)
    rank = min(head_dim, dim)  # a head wider than the model: its channels past D zero, as in mimetic_qk
    wq = torch.zeros(heads, dim, head_dim, dtype=torch.float64)
    wk = torch.zeros(max(kv_of) + 1, dim, head_dim, dtype=torch.float64)
    for g in range(wk.shape[0]):
        members = [h for h in range(heads) if kv_of[h] == g]
        _, sigma, vh = canonical_svd(torch.cat([m[h] for h in members]))
        weight = (sigma[:rank] / math.sqrt(len(members))).sqrt()
        wk[g, :, :rank] = vh[:rank].T * weight
        for h in members:
            wq[h, :, :rank] = m[h] @ vh[:rank].T / weight
    return wq, wk


def mimetic_vo(
    dim: int, inner: int, *, gamma: float = 0.4, delta: float = 0.4, noise: str = "uniform",
    generator: torch.Generator | None = None, reference_layout: bool = False, with_target: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Wv (D, inner), Wo (inner, D) and M (D×D) with Wv Wo = M = γZ − δI (its rank-``inner``
    truncation when inner < D; with inner > D the extra channels are zero), so that
    x ↦ o(v(x)) is x ↦ x M. M is None with
    ``with_target=False`` and a circular noise narrower than D (nothing else needs it).

    ``reference_layout=True`` reproduces the public ports, which store L and R in
    ``nn.Linear`` without transposing: the composite is then x (R L)ᵀ, not x M (same trace,
    a diagonal that is negative on average but not entry by entry, different noise). Only for
    comparisons with those ports.
    """
    check_number("gamma", gamma)
    check_number("delta", delta)
    if reference_layout and inner != dim:
        raise ValueError("reference_layout=True needs square value/output projections")
    rank = min(inner, dim)  # a value path wider than the model (x-transformers' heads·dim_head > D) has rank D
    if noise == "circular":
        left, right, m = circular_factors(dim, rank, gamma, -delta, with_target=with_target and inner < dim,
                                          generator=generator)
        left, right = left[0], right[0]
        m = m[0] if m is not None else (left @ right if with_target else None)
    else:
        left, right, m = mimetic_factors(dim, gamma, -delta, noise=noise, generator=generator)
        left, right = left[:, :rank], right[:rank]
    if inner > rank:  # the extra value channels read and write nothing: Wv Wo is still M
        left = torch.cat([left, left.new_zeros(dim, inner - rank)], 1)
        right = torch.cat([right, right.new_zeros(inner - rank, dim)], 0)
    if reference_layout:
        return left.T.clone(), right.T.clone(), m
    return left, right, m
