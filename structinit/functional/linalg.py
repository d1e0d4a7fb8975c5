r"""Decompositions whose results depend only on the matrix, never on the LAPACK that computed them.

An SVD or an eigendecomposition is unique only up to the sign of each singular vector and up to
any rotation inside a repeated singular value. Two LAPACKs (MKL's AVX2 and AVX-512 paths,
OpenBLAS) pick differently, so an init that writes singular vectors into weights would give
other weights on another CPU for the same seed. The functions here remove that freedom:

- :func:`psd_sqrt` returns the symmetric square root V Λ^{½} Vᵀ, a function of the matrix alone;
- :func:`canonical_svd` fixes each singular vector's sign by a fixed generic direction, and
  within a cluster of (numerically) equal singular values it replaces the basis LAPACK chose by
  the orthonormalised projections of fixed generic vectors onto the cluster's subspace, which
  depends on the subspace alone.

What is left between machines is rounding, of the order of the float64 epsilon.
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = ["canonical_svd", "generic_vectors", "psd_sqrt"]

# Singular values within this fraction of the largest are one cluster: far above float64
# rounding (~1e-16), far below any gap an init relies on.
CLUSTER_RTOL = 1e-9


def generic_vectors(n: int, k: int) -> torch.Tensor:
    """(n, k) float64 fixed "generic" vectors: entries frac(i·φ + j·√2) − ½ of an irrational
    sequence, the same on every machine, orthogonal to no structured vector in practice.

    Examples:
        >>> generic_vectors(3, 2).shape
        torch.Size([3, 2])
    """
    i = torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    j = torch.arange(1, k + 1, dtype=torch.float64)[None, :]
    phi, root2 = (math.sqrt(5) - 1) / 2, math.sqrt(2)
    return torch.frac(i * phi + j * root2) - 0.5


def psd_sqrt(a: torch.Tensor) -> torch.Tensor:
    """The symmetric PSD square root S = V max(Λ, 0)^{½} Vᵀ of symmetric ``a`` (n, n), float64,
    so that S S = a for PSD ``a`` (negative eigenvalues from round-off count as 0). Unlike
    V Λ^{½}, it does not depend on which eigenvectors the LAPACK returned.

    Examples:
        >>> a = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> s = psd_sqrt(a)
        >>> torch.allclose(s @ s, a), torch.allclose(s, s.T)
        (True, True)
    """
    a = a.double()
    evals, evecs = torch.linalg.eigh((a + a.T) / 2)
    s = (evecs * evals.clamp_min(0).sqrt()) @ evecs.T
    return (s + s.T) / 2


def _subspace_basis(basis: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of span(``basis``) that depends on that span alone: the probes
    projected onto it, orthonormalised by QR with a positive diagonal."""
    q, r = torch.linalg.qr(basis @ (basis.T @ probes))
    sign = torch.sign(torch.diagonal(r))
    return q * torch.where(sign == 0, torch.ones_like(sign), sign)


def canonical_svd(m: torch.Tensor, rtol: float = CLUSTER_RTOL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD U S Vᵀ = ``m`` (rows, cols), float64, with the choices LAPACK leaves open
    made the same way on every machine:

    - a singular value of its own: the signs of u and v are those that make gᵀu > 0 for a fixed
      generic vector g (:func:`generic_vectors`);
    - a cluster of values equal within ``rtol`` × the largest: U's columns are the projections of
      generic vectors onto the cluster's left subspace, orthonormalised; V's are Mᵀ U / s̄, and the
      cluster's values are set to their mean s̄ (so U S Vᵀ still equals ``m`` there);
    - the values at or below that tolerance (the null space): U's and V's columns each from
      their own subspace, as above.

    Returns (U (rows, r), S (r,), Vᵀ (r, cols)) with r = min(rows, cols), S descending.

    Examples:
        >>> m = torch.diag(torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64))  # a repeated value
        >>> u, s, vh = canonical_svd(m)
        >>> torch.allclose(u @ torch.diag(s) @ vh, m), s.tolist()
        (True, [2.0, 2.0, 1.0])
    """
    m = m.double()
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    u, s, v = u.clone(), s.clone(), vh.T.clone()
    r = s.numel()
    if r == 0:
        return u, s, vh
    tol = rtol * float(s[0])
    probes_u, probes_v = generic_vectors(m.shape[0], r), generic_vectors(m.shape[1], r)
    null = int((s > tol).sum()) if float(s[0]) > 0 else 0  # where the null space starts
    # Signs first, all at once: by the first probe that is not (nearly) orthogonal to the vector.
    dots = probes_u.T @ u[:, :null]  # (r, null)
    first = (dots.abs() > 1e-6).to(torch.int8).argmax(0)
    sign = torch.where(dots.gather(0, first[None])[0] < 0, -1.0, 1.0).to(torch.float64)
    u[:, :null] *= sign
    v[:, :null] *= sign
    # Then each cluster of equal values (a run of gaps ≤ tol) gets the basis its subspace alone decides.
    cluster = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.bool), s[1:null] < s[: null - 1] - tol]), 0)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.bincount(cluster), 0)]).tolist()
    for a, b in itertools.pairwise(starts):
        if b - a < 2:
            continue  # a value of its own: its sign is fixed above
        q = _subspace_basis(u[:, a:b], probes_u[:, : b - a])
        mean = s[a:b].mean()
        u[:, a:b] = q
        v[:, a:b] = (m.T @ q) / mean
        s[a:b] = mean
    if null < r:
        u[:, null:] = _subspace_basis(u[:, null:], probes_u[:, : r - null])
        v[:, null:] = _subspace_basis(v[:, null:], probes_v[:, : r - null])
    return u, s, v.T
