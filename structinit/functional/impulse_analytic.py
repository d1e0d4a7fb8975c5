r"""Analytic impulse attention: QKᵀ built from the structure of the position embedding.

For a head with offset (dy, dx) we want logits that peak where p' = p + (dy, dx). Take the
separable, shift-invariant kernel

    κ(p, p') = Σ_j c_j cos(ω_j (y' − y − dy)) + Σ_j c_j cos(ω_j (x' − x − dx)),   c_j ≥ 0,

whose maximum over the grid is at δ = p' − p − offset = 0. Since cos(a' − a − φ) =
sin(a') sin(a + φ) + cos(a') cos(a + φ), κ = q(p)·k(p') with features

    q(p) = [√c_j sin(ω_j (y + dy)), √c_j cos(ω_j (y + dy)), … same for x …]
    k(p') = [√c_j sin(ω_j y'),     √c_j cos(ω_j y'),      … same for x …],

two dimensions per frequency and axis, so m = ⌊r/4⌋ frequencies per axis fit a head of
dimension r. The weights c solve   min ‖c‖²  s.t.  Σ_j c_j (1 − cos ω_j δ) ≥ 1  for every
shift δ ≠ 0 that occurs on the grid: the margin between the target and any other token is
at least 1, and ‖c‖ bounds how much content noise in the features can move the logits.

The features are read out of the (LayerNormed) position embedding Z (N×D) linearly, by
ridge regression  W = Zᵀ (ZZᵀ + λI)⁻¹ T  with T the N×2m feature table: the minimum-norm
readout spreads over every coordinate that carries the same positional signal, which keeps
noise from patch content small, and it lies in the row space of Z, so it sums to zero over
channels and ignores the mean that LayerNorm removes. On the raw sin-cos table the features
are linear in the embedding and the kernel is exact. Through LayerNorm each token is also
divided by its own std σ_p (for the sin-cos table σ_p² = ½ − μ_p², μ_p the token's mean,
varying by about ±10 %), which no linear readout can undo: the ridge fit is then the
least-squares approximation, as it is for any other embedding. The margin of κ absorbs this
for usual sizes; :func:`impulse_qk` checks that every target is still each row's argmax on
the pseudo input and raises otherwise.

The **signed** kernel κ − b (b = κ(target) − ½, one constant feature more) puts the target
logit at +½ and every other at ≤ −½. When the token stds σ_p are known (the solver writes the
sin-cos table), the features are fitted as T/σ_p, which is exact: the logits on LN(PE) are
diag(1/σ_p) (κ − b) diag(1/σ_p), the same signs. With patch content and every residual write
kept out of the position subspace (:mod:`structinit.functional.reservation`), content only
rescales each query and key by a positive factor, so every target stays its row's argmax on
any image, in every layer; prefix tokens kept out of the subspace get logit 0 < ½.

The cost is one N×N solve per model plus a tiny QP per axis: no D×D SVD and no iterative fit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from structinit.functional.linalg import canonical_svd
from structinit.functional.mimetic import mimetic_noise
from structinit.functional.posembed import sincos_frequencies
from structinit.functional.reservation import position_basis
from structinit.functional.targets import Offset, target_indices

Factors = tuple[torch.Tensor, torch.Tensor]  # Wq, Wk of shape (heads, D, head_dim)


def axis_kernel(omega: torch.Tensor, max_shift: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ≤ ``budget`` frequencies from ``omega`` and weights c ≥ 0 with the smallest ‖c‖
    such that Σ c_j (1 − cos ω_j δ) ≥ 1 for δ = 1 … max_shift. Returns (ω_sel, c)."""
    if budget < 1:
        raise ValueError("budget must be ≥ 1")
    om = omega.detach().double().numpy()
    # Neighbouring candidates of a wide table are nearly collinear on a small grid; ~4× the
    # budget, evenly spread, loses nothing and keeps the QP small.
    om = om[:: max(1, len(om) // (4 * budget))]
    if max_shift < 1:  # a 1-wide axis: nothing to tell apart
        return torch.tensor(om[:1]), torch.zeros(1, dtype=torch.float64)
    gaps = 1.0 - np.cos(np.outer(np.arange(1, max_shift + 1), om))  # (shifts, freqs)

    from scipy.optimize import minimize  # here, not at the top: half a second of every `import structinit`

    def solve(g):
        k = g.shape[1]
        res = minimize(
            lambda c: c @ c, np.full(k, 1.0 / max(g.sum(1).min(), 1e-12)), jac=lambda c: 2 * c,
            constraints=[{"type": "ineq", "fun": lambda c: g @ c - 1, "jac": lambda c: g}],
            bounds=[(0, None)] * k, method="SLSQP", options={"maxiter": 500, "ftol": 1e-12},
        )
        return np.clip(res.x, 0, None)

    c = solve(gaps)
    keep = np.sort(np.argsort(-c, kind="stable")[:budget])
    c = solve(gaps[:, keep])
    margin = (gaps[:, keep] @ c).min()
    if not margin > 0.99:
        raise ValueError(
            f"no kernel with {budget} frequencies separates all {max_shift} shifts; "
            "use a larger head_dim or a smaller grid"
        )
    return torch.tensor(om[keep]), torch.tensor(c)


MAX_GRAM_BYTES = 2 * 2**30  # a grid of about 16k tokens: beyond it the readout is refused, not attempted


def frequency_budget(head_dim: int, signed: bool, frequencies: int | None = None) -> int:
    """Frequencies per axis that fit ``head_dim`` columns (a sin/cos pair per frequency and
    axis, one column more for the signed kernel's constant), capped at ``frequencies``."""
    budget = (head_dim - int(signed)) // 4
    return budget if frequencies is None else min(budget, frequencies)


def ridge_readout(z: torch.Tensor, ridge: float = 2e-3) -> torch.Tensor:
    """The D×N operator R = Zᵀ (ZZᵀ + λI)⁻¹ with λ = ridge · tr(ZZᵀ)/N, so ``R @ T`` is the
    minimum-norm (ridge) linear readout of per-token features T (N×F) from tokens Z (N×D)."""
    tokens = z.shape[0]
    if tokens * tokens * 8 > MAX_GRAM_BYTES:
        raise ValueError(f"{tokens} tokens: the ridge readout forms a {tokens}×{tokens} float64 Gram matrix "
                         f"({tokens * tokens * 8 / 2**30:.0f} GiB), more than this solver takes; initialise the "
                         "model on a smaller grid (grid=), or a smaller image size")
    z = z.double()
    g = z @ z.T
    lam = ridge * g.diagonal().mean()
    return torch.linalg.solve(g + lam * torch.eye(g.shape[0], dtype=g.dtype), z).T


def analytic_qk(z: torch.Tensor, grid: tuple[int, int], offsets: list[Offset], head_dim: int,
    omega: torch.Tensor | None = None, *, ridge: float = 2e-3, signed: bool = False,
    token_scale: torch.Tensor | None = None, frequencies: int | None = None) -> Factors:
    """Unscaled analytic factors for pseudo input ``z`` (N×D) on ``grid``.

    Returns Wq, Wk of shape (heads, D, head_dim), float64, with ``(z Wq[h])(z Wk[h])ᵀ ≈ κ_h``
    in the least-squares sense (exact for the raw sin-cos table, see the module doc).
    ``omega`` are the candidate frequencies (default: the sin-cos table's own for width D).

    ``signed=True`` adds one constant feature pair (query −b, key 1) with b = κ(target) − ½, so
    the target logit is +½ and every other logit ≤ −½: the argmax then survives any positive
    per-token scaling of queries and keys (see :mod:`structinit.functional.reservation`). It
    costs one dimension, so one frequency fewer per axis when ``head_dim`` is a multiple of 4.
    ``token_scale`` (N,), each token's LayerNorm std when ``z = LN(P)``: the features are then
    fitted as T / σ, exact for the sin-cos table (see the module doc).
    ``frequencies`` caps the frequencies per axis (default: as many as ``head_dim`` holds); the
    columns left over are zero, free for :func:`content_qk`.
    """
    if omega is None:
        omega = sincos_frequencies(4 * max(z.shape[1] // 4, 1))
    budget = frequency_budget(head_dim, signed, frequencies)
    if budget < 1:
        raise ValueError(
            f"head_dim={head_dim} is too small for the analytic impulse: it needs at least "
            f"{4 + int(signed)} dimensions per head (a sin/cos pair for each grid axis"
            f"{', and the constant of the signed kernel' if signed else ''}); use fewer heads"
            f"{' or signed=False (4 dimensions)' if signed and head_dim >= 4 else ''}"
        )
    h, w = grid
    reach = max(max(abs(dy), abs(dx)) for dy, dx in offsets)
    ys = torch.arange(h, dtype=torch.float64).repeat_interleave(w)
    xs = torch.arange(w, dtype=torch.float64).repeat(h)
    kernel_y = axis_kernel(omega, h - 1 + reach, budget)
    kernel_x = kernel_y if w == h else axis_kernel(omega, w - 1 + reach, budget)
    axes = [(ys, kernel_y), (xs, kernel_x)]
    readout = ridge_readout(z, ridge)
    # κ at the target: every cosine at phase 0. Non-targets are ≥ 1 below on one axis at least.
    peak = float(kernel_y[1].sum() + kernel_x[1].sum())
    inv_scale = 1.0 if token_scale is None else 1.0 / token_scale.double()[:, None]

    def features(shift_y: int, shift_x: int, constant: float) -> torch.Tensor:
        cols = []
        for (pos, (om, c)), shift in zip(axes, (shift_y, shift_x)):
            phase = (pos[:, None] + shift) * om[None, :]
            cols += [c.sqrt() * phase.sin(), c.sqrt() * phase.cos()]
        if signed:
            cols.append(torch.full_like(pos[:, None], constant))
        f = torch.cat(cols, dim=1) * inv_scale
        return torch.nn.functional.pad(f, (0, head_dim - f.shape[1]))

    wk = readout @ features(0, 0, 1.0)
    wq = readout @ torch.stack([features(dy, dx, 0.5 - peak) for dy, dx in offsets])
    return wq, wk.expand_as(wq).clone()


def _target_logits(kernel_logits: torch.Tensor, grid, offsets):
    """Per head, the kernel rows whose target is inside the grid and each row's target column:
    (rows (M, N), target column (M,)) stacked over heads, head by head."""
    targets = target_indices(grid, offsets)  # (heads, N), −1 off the grid
    inside = targets >= 0
    return kernel_logits[inside], targets[inside]


def calibrate_logit_scale(
    kernel_logits: torch.Tensor, grid: tuple[int, int], offsets: list[Offset], mass: float
) -> float:
    """The factor τ for which softmax(τ · kernel_logits) puts mean mass ``mass`` on the targets
    (averaged over heads' in-grid rows).

    While each target is its row's maximum the mass m(τ) increases with τ, with derivative
    m'(τ) = mean_rows p_t (k_t − Σ_j p_j k_j), so a Newton iteration in s = log τ converges in a
    few steps; it is safeguarded by a bisection bracket.
    """
    n = kernel_logits.shape[-1]
    if not 1.0 / n < mass < 1.0:
        raise ValueError(f"target_mass={mass}: must lie strictly between 1/N = {1 / n:.4g} and 1")
    rows, cols = _target_logits(kernel_logits, grid, offsets)
    # Target logit 0 (stable, same softmax); float32 is ample for a mass matched to ~1e-6.
    rows = (rows - rows.gather(1, cols[:, None])).float()
    # Weights make the mean over rows a mean over heads of per-head means, as fidelity reports.
    counts = (target_indices(grid, offsets) >= 0).sum(1).tolist()
    weight = torch.cat([torch.full((c,), 1.0 / (c * len(counts))) for c in counts])

    def mass_and_slope(s: float) -> tuple[float, float]:
        tau = math.exp(s)
        p = (tau * rows).softmax(-1)
        p_t = p.gather(1, cols[:, None]).squeeze(1)
        slope = (weight * p_t * -(p * rows).sum(-1)).sum() * tau  # d mass / d log τ (target logit 0)
        return float((weight * p_t).sum()), float(slope)

    lo, hi = math.log(1e-4), math.log(1e5)
    reach = mass_and_slope(hi)[0]
    if reach < mass:
        raise ValueError(
            f"target_mass={mass} is out of reach: the structure gives at most {reach:.4f} on this "
            "pseudo input; lower target_mass, or strengthen the position signal (a larger pe_scale)"
        )
    s = 0.0
    for _ in range(100):
        m, slope = mass_and_slope(s)
        if abs(m - mass) < 1e-6:
            break
        lo, hi = (s, hi) if m < mass else (lo, s)
        step = s - (m - mass) / slope if slope > 0 else None
        s = step if step is not None and lo < step < hi else 0.5 * (lo + hi)
    return math.exp(s)


def position_columns(head_dim: int, signed: bool, frequencies: int | None) -> int:
    """How many of a head's ``head_dim`` columns the analytic kernel uses: a sin/cos pair per
    frequency and axis, plus the constant of the signed kernel."""
    return 4 * frequency_budget(head_dim, signed, frequencies) + int(signed)


def content_qk(z: torch.Tensor, heads: int, head_dim: int, used: int, weight: float, *,
               generator: torch.Generator | None = None) -> Factors:
    r"""A mimetic content term for the free columns of impulse heads: per head, Wq Wkᵀ = the
    best rank-(head_dim − used) approximation of weight · P (Z_h + I) P, with Z_h mimetic noise
    (variance 1/D) and P the projector onto the complement of the row space of ``z`` (the
    position subspace) and of the ones vector (which LayerNorm removes).

    Returns Wq, Wk (heads, D, head_dim), float64, zero in the first ``used`` columns, so added
    to impulse factors the logits are position term + content term with no cross terms; on
    the position-only input ``z`` the content term is exactly 0.
    """
    d = z.shape[1]
    u = position_basis(z)  # LayerNorm of the LayerNormed z changes no direction
    ones = torch.full((d, 1), d**-0.5, dtype=torch.float64)
    proj = torch.eye(d, dtype=torch.float64) - u @ u.T - ones @ ones.T
    free = head_dim - used
    wq = torch.zeros(heads, d, head_dim, dtype=torch.float64)
    wk = torch.zeros_like(wq)
    for h in range(heads):
        m = weight * proj @ (mimetic_noise(d, generator=generator) + torch.eye(d, dtype=torch.float64)) @ proj
        left, sv, right = canonical_svd(m)
        wq[h, :, used:] = left[:, :free] * sv[:free].sqrt()
        wk[h, :, used:] = right[:free].T * sv[:free].sqrt()
    return wq, wk


def impulse_qk(z: torch.Tensor, grid: tuple[int, int], offsets: list[Offset], head_dim: int, *,
    target_mass: float = 0.5, softmax_scale: float | None = None, ridge: float = 2e-3, signed: bool = False,
    token_scale: torch.Tensor | None = None, frequencies: int | None = None) -> Factors:
    """Analytic impulse factors, calibrated: Wq, Wk (heads, D, head_dim), float64, such that
    softmax(softmax_scale · z Wq[h] Wk[h]ᵀ zᵀ) puts mean mass ``target_mass`` on the targets
    for the pseudo input ``z`` (N×D, e.g. LayerNorm of the position embedding).

    ``softmax_scale`` is the scale your attention applies (default head_dim^−½); the other options
    as in :func:`analytic_qk`. Write ``Wq[h].T`` into the rows of head h of your query projection
    (``nn.Linear`` layout), ``Wk[h].T`` into the key projection, and zero their biases.

    Raises ValueError if, on ``z``, some in-grid target is not its row's argmax (the embedding
    or head is too small to carry the structure; see the module doc).
    """
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    d = z.shape[1]
    wq, wk = analytic_qk(z, grid, offsets, head_dim, ridge=ridge, signed=signed, token_scale=token_scale,
                         frequencies=frequencies)
    z = z.double()
    kernel = (z @ wq) @ (z @ wk).transpose(1, 2)  # (heads, N, N)
    rows, cols = _target_logits(kernel, grid, offsets)
    missed, total = int((rows.argmax(-1) != cols).sum()), len(cols)
    if missed:
        raise ValueError(
            f"the analytic impulse misses {missed} of {total} targets on the position-only input "
            f"(embed dim {d}, head_dim={head_dim}, grid {grid[0]}×{grid[1]}): this position embedding "
            f"cannot carry the structure at this size; use a larger embed_dim/head_dim, a smaller kernel, a smaller "
            f"ridge (ridge={ridge}; the default is 2e-3), or let the init write the sin-cos table (pe_scale)"
        )
    tau = calibrate_logit_scale(kernel, grid, offsets, target_mass)
    f = math.sqrt(tau / scale)
    return wq * f, wk * f
