"""Decompositions that give the same result on every machine (structinit.functional.linalg).

Another LAPACK may return other singular vectors for the same matrix: any signs, and any
rotation inside a repeated singular value (and of the null space, left and right apart). The
tests stand in for such a LAPACK by rotating and flipping what torch's returns, and check that
the canonical results do not move, to float64 rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from structinit.functional.conv_filters import gaussian_kronecker_covariance, sample_filters
from structinit.functional.impulse_closed_form import pinv_projector
from structinit.functional.linalg import canonical_svd, generic_vectors, psd_sqrt


def _orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q


def _other_lapack(monkeypatch, seed: int) -> None:
    """torch.linalg.svd and eigh return a valid decomposition, but with other choices: random
    signs, and random rotations inside every run of equal values (left and right apart in the
    null space)."""
    real_svd, real_eigh = torch.linalg.svd, torch.linalg.eigh
    g = torch.Generator().manual_seed(seed)

    def runs(values: torch.Tensor, tol: float) -> list[tuple[int, int]]:
        out, start = [], 0
        for i in range(1, len(values) + 1):
            if i == len(values) or abs(float(values[i - 1] - values[i])) > tol:
                out.append((start, i))
                start = i
        return out

    def svd(m, full_matrices=True):
        u, s, vh = real_svd(m, full_matrices=False)
        r = s.numel()
        left, right = torch.eye(r, dtype=m.dtype), torch.eye(r, dtype=m.dtype)
        tol = 1e-9 * float(s[0]) if r else 0.0
        for a, b in runs(s, tol):
            rot = _orthogonal(b - a, g) * (torch.randint(0, 2, (1,), generator=g) * 2 - 1)
            left[a:b, a:b] = rot
            right[a:b, a:b] = rot if float(s[a]) > tol else _orthogonal(b - a, g)
        return u @ left, s, (vh.T @ right).T

    def eigh(a):
        w, v = real_eigh(a)
        rot = torch.eye(len(w), dtype=a.dtype)
        for lo, hi in runs(w, 1e-9 * float(w.abs().max())):
            rot[lo:hi, lo:hi] = _orthogonal(hi - lo, g)
        return w, v @ rot

    monkeypatch.setattr(torch.linalg, "svd", svd)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(0, 2), st.integers(0, 3), st.integers(0, 99))
def test_canonical_svd_is_the_same_whatever_the_lapack_chose(sizes, zeros, extra_cols, seed):
    # singular values in runs of equal values (sizes), then `zeros` zero values; a tall matrix
    g = torch.Generator().manual_seed(seed)
    values = torch.cat([torch.full((n,), float(len(sizes) - i + 1), dtype=torch.float64) for i, n in enumerate(sizes)]
                       + [torch.zeros(zeros, dtype=torch.float64)])
    rows, cols = len(values) + extra_cols, len(values)
    m = _orthogonal(rows, g)[:, :cols] @ torch.diag(values) @ _orthogonal(cols, g).T
    u, s, vh = canonical_svd(m)
    torch.testing.assert_close(u @ torch.diag(s) @ vh, m, atol=1e-12, rtol=0)
    torch.testing.assert_close(u.T @ u, torch.eye(cols, dtype=torch.float64), atol=1e-12, rtol=0)
    with pytest.MonkeyPatch.context() as patch:
        _other_lapack(patch, seed + 1)
        u2, s2, vh2 = canonical_svd(m)
    torch.testing.assert_close(u2, u, atol=1e-12, rtol=0)
    torch.testing.assert_close(vh2, vh, atol=1e-12, rtol=0)
    torch.testing.assert_close(s2, s, atol=1e-12, rtol=0)


def test_the_stand_in_lapack_does_change_plain_singular_vectors(monkeypatch):
    # Else the test above could not fail: plain torch.linalg.svd moves under the stand-in.
    m = torch.diag(torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64))
    before = torch.linalg.svd(m)[0]
    _other_lapack(monkeypatch, 0)
    assert not torch.allclose(torch.linalg.svd(m)[0], before)


def test_psd_sqrt_and_the_covariance_filters_do_not_depend_on_the_eigenvectors(monkeypatch):
    cov = gaussian_kronecker_covariance(3, 1.0)  # a Kronecker covariance: repeated eigenvalues
    root = psd_sqrt(cov)
    torch.testing.assert_close(root @ root, cov.double(), atol=1e-12, rtol=0)
    filters = sample_filters(cov, 16, generator=torch.Generator().manual_seed(0))
    _other_lapack(monkeypatch, 3)
    torch.testing.assert_close(psd_sqrt(cov), root, atol=1e-12, rtol=0)
    assert torch.equal(sample_filters(cov, 16, generator=torch.Generator().manual_seed(0)), filters)


def test_the_pseudo_inverse_does_not_divide_by_rounding():
    # A rank-3 pseudo input asked for rank 5: the two extra singular values of PᵀP are float64
    # rounding. Rounding-level changes of P (what another CPU's arithmetic makes) move P⁺ by as
    # little; inverting those values instead moved it by orders of magnitude.
    g = torch.Generator().manual_seed(0)
    p = torch.randn(20, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 6, generator=g, dtype=torch.float64)
    nudged = p * (1 + 1e-15 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    a, b = pinv_projector(p, 5), pinv_projector(nudged, 5)
    assert float((a - b).abs().max()) < 1e-9 * float(a.abs().max())
    torch.testing.assert_close(a @ p, pinv_projector(p, 3) @ p)  # the same as the rank-3 pseudo-inverse


def test_generic_vectors_are_fixed_numbers():
    # the weights of every machine rest on these: a change of the sequence changes every SVD's signs
    assert generic_vectors(2, 2).flatten().tolist() == pytest.approx([-0.46775244888, -0.05353888650,
                                                                      0.15028153987, -0.43550489775], abs=1e-10)
