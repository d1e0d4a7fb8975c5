"""Impulse targets through rotary position embeddings (2-D axial RoPE), from constant q and k.

RoPE rotates each 2-D pair f of a head's q and k by an angle ω_f·p, where p is the token's
row or column (the pair's axis a_f). Written as complex numbers z_f, the logit of query i and
key j is

    q_i'ᵀ k_j' = Σ_f Re( conj(q_f) · k_f · e^{i ω_f (p_j − p_i)} ).

For the part of q and k that does not depend on the content (a q/k bias, a norm's bias carried
through the projection, a reserved channel), q_f = a_f (real) and k_f = b_f e^{−i φ_f} give

    L(Δ) = Σ_f A_f cos(ω_f Δ_{a_f} − φ_f),     A_f = a_f b_f,   Δ = p_key − p_query,

a sum of one cosine per band. With φ_f = ω_f δ_{a_f} every band peaks at the offset Δ = δ: the
impulse of a one-hot k×k filter at δ = (dy, dx) (the convention of
:mod:`structinit.functional.targets`). Whether that peak is the only one on the grid depends
on the frequencies the model has: a band with ω Δ ≥ 2π inside the grid aliases, and low bands
alone are too flat to single out one token. :func:`rope_impulse_terms` picks the bands (the
fastest first) whose sum has the largest margin between the peak and the runner-up, per unit
of amplitude, and scales them so that every query whose target lies in the grid puts at least
``target_mass`` on it. Rows and columns add, so the two axes are solved apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from structinit.functional.targets import Offset
from structinit.utils import check_int, check_number

__all__ = ["rope_impulse_terms", "rope_impulse_terms_2d", "rope_logits"]


def _profile(freqs: torch.Tensor, amplitudes: torch.Tensor, shift: int, extent: int) -> torch.Tensor:
    """(2·extent − 1,) logits of one axis, Δ = −(extent−1) … extent−1: Σ_f A_f cos(ω_f (Δ − shift))."""
    delta = torch.arange(-(extent - 1), extent, dtype=torch.float64)
    return (amplitudes[:, None] * torch.cos(freqs[:, None] * (delta[None, :] - shift))).sum(0)


def _margin(profile: torch.Tensor, shift: int, extent: int) -> float:
    """The peak at Δ = shift minus the largest other logit of the profile."""
    peak = extent - 1 + shift
    others = torch.cat([profile[:peak], profile[peak + 1:]])
    return float(profile[peak] - others.max()) if len(others) else math.inf


def _fastest_bands(order, bands: int, margin) -> tuple:
    """The first k bands of ``order`` (fastest first), k the number that gives the largest
    ``margin(amplitudes)`` per unit amplitude; (those bands, that margin per unit)."""
    best, best_k = 0.0, 0
    for k in range(1, len(order) + 1):
        amplitudes = torch.zeros(bands, dtype=torch.float64)
        amplitudes[order[:k]] = 1.0
        score = margin(amplitudes) / k
        if score > best + 1e-9:
            best, best_k = score, k
    return order[:best_k], best


def _worst_mass(freqs: torch.Tensor, amplitudes: torch.Tensor, shift: int, extent: int) -> float:
    """The smallest softmax mass on the target over the queries of one axis whose target exists."""
    profile = _profile(freqs, amplitudes, shift, extent)
    worst = 1.0
    for query in range(extent):
        if not 0 <= query + shift < extent:
            continue
        logits = profile[extent - 1 - query: 2 * extent - 1 - query]  # keys 0 … extent−1
        worst = min(worst, float(torch.softmax(logits, 0)[query + shift]))
    return worst


def rope_impulse_terms(freqs: torch.Tensor, axes: Sequence[int], offset: Offset, grid: tuple[int, int],
                       target_mass: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Amplitudes A_f and phases φ_f of the content-free logit Σ_f A_f cos(ω_f Δ_{a_f} − φ_f)
    that peaks at ``offset`` = (dy, dx), and only there, on an h×w ``grid``.

    Args:
        freqs: (F,) angular frequency ω_f of each rotary pair, radians per token.
        axes: (F,) the axis each pair rotates with: 0 for rows (y), 1 for columns (x).
        offset: (dy, dx), key position minus query position.
        grid: (h, w) of the token grid.
        target_mass: the least softmax mass a query whose target key is in the grid puts on it.

    Returns:
        (amplitudes, phases), each (F,) float64; the logit is in softmax units (after the
        model's scale). Bands left out have amplitude 0.

    Raises ValueError when an axis whose offset is not 0 has no set of bands with a unique
    peak on the grid (aliasing or too flat), naming the axis and the frequencies.

    Examples:
        >>> freqs = torch.tensor([1.0, 0.5, 1.0, 0.5])
        >>> amp, phase = rope_impulse_terms(freqs, [0, 0, 1, 1], (0, 1), (4, 4), 0.9)
        >>> L = rope_logits(freqs, [0, 0, 1, 1], amp, phase, (4, 4))
        >>> int(L[0].argmax())  # token (0, 0) looks at (0, 1)
        1
    """
    freqs = torch.as_tensor(freqs, dtype=torch.float64).flatten()
    axes = torch.as_tensor(list(axes), dtype=torch.long).flatten()
    if len(axes) != len(freqs) or not bool(((axes == 0) | (axes == 1)).all()):
        raise ValueError(f"axes: expected one 0 (rows) or 1 (columns) per frequency ({len(freqs)}), got "
                         f"{axes.tolist()}")
    if not bool(torch.isfinite(freqs).all()):
        raise ValueError("freqs: the rotary frequencies hold NaN/inf")
    for name, size in zip(("grid rows", "grid columns"), grid):
        check_int(name, size, low=1)
    check_number("target_mass", target_mass, low=0, high=1, low_open=True, high_open=True)
    amplitudes = torch.zeros_like(freqs)
    phases = torch.zeros_like(freqs)
    for axis in (0, 1):
        shift, extent = int(offset[axis]), int(grid[axis])
        if abs(shift) >= extent:
            raise ValueError(f"offset {tuple(offset)}: outside a {grid[0]}×{grid[1]} grid; choose a smaller "
                             "kernel_size")
        on_axis = (axes == axis) & (freqs.abs() > 0)
        if extent == 1:
            continue  # one row (or column): nothing to choose on this axis
        axis_freqs = freqs[on_axis]
        bands, margin = _fastest_bands(torch.argsort(axis_freqs.abs(), descending=True), len(axis_freqs),
                                       lambda a: _margin(_profile(axis_freqs, a, shift, extent), shift, extent))
        if margin <= 0:
            listed = ", ".join(f"{f:.3g}" for f in axis_freqs.tolist())
            raise ValueError(f"the rotary frequencies of axis {'rows' if axis == 0 else 'columns'} ({listed}) give no "
                             f"unique peak at offset {shift} on {extent} tokens (they alias, or are too slow to tell "
                             "neighbours apart)")
        chosen = torch.zeros_like(freqs)
        chosen[on_axis.nonzero().flatten()[bands]] = 1.0
        amplitudes += chosen
        phases += chosen * freqs * shift

    def worst(c: float) -> float:  # the worst query's mass: the rows' times the columns'
        mass = 1.0
        for axis in (0, 1):
            on = axes == axis
            mass *= _worst_mass(freqs[on], c * amplitudes[on], int(offset[axis]), int(grid[axis]))
        return mass

    return _least_scale(worst, target_mass, f"target_mass={target_mass}: not reachable on this grid with these "
                        "frequencies") * amplitudes, phases


def _least_scale(worst, target_mass: float, unreachable: str) -> float:
    """The least factor c (to 60 halvings) with ``worst(c)`` ≥ ``target_mass``, ``worst`` rising
    with c; ValueError(``unreachable``) when c would pass 10⁶."""
    low, high = 0.0, 1.0
    while worst(high) < target_mass:
        low, high = high, 2 * high
        if high > 1e6:
            raise ValueError(unreachable)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if worst(mid) < target_mass else (low, mid)
    return high


def rope_logits(freqs: torch.Tensor, axes: Sequence[int] | None, amplitudes: torch.Tensor, phases: torch.Tensor,
                grid: tuple[int, int]) -> torch.Tensor:
    """(N, N) logits, N = h·w tokens row-major: L[i, j] = Σ_f A_f cos(ω_f·(p_j − p_i) − φ_f), with
    ``freqs`` (F,) on the ``axes`` given (axial RoPE), or ``freqs`` (F, 2) = (ω_y, ω_x) per band
    and ``axes=None``."""
    h, w = grid
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pos = torch.stack([y.flatten(), x.flatten()], 1).double()  # (N, 2)
    delta = pos[None, :, :] - pos[:, None, :]  # (N, N, 2): key − query
    freqs = torch.as_tensor(freqs, dtype=torch.float64)
    if axes is None:
        angle = delta @ freqs.T - phases  # (N, N, F)
    else:
        angle = freqs * delta[..., torch.as_tensor(list(axes), dtype=torch.long)] - phases
    return (torch.as_tensor(amplitudes, dtype=torch.float64) * torch.cos(angle)).sum(-1)


# -- bands that turn with rows and columns at once (mixed RoPE, 1-D RoPE over the grid) ----------

def _offsets(grid: tuple[int, int]) -> torch.Tensor:
    """((2h−1)(2w−1), 2) every key − query offset on the grid, row-major from (−(h−1), −(w−1))."""
    h, w = grid
    dy, dx = torch.meshgrid(torch.arange(1 - h, h), torch.arange(1 - w, w), indexing="ij")
    return torch.stack([dy.flatten(), dx.flatten()], 1).double()


def _rivals(offset: Offset, grid: tuple[int, int]) -> torch.Tensor:
    """Mask over :func:`_offsets`: the offsets Δ ≠ δ that some query whose target is on the grid
    also sees (|Δ| and |Δ − δ| within the grid on each axis)."""
    d = _offsets(grid)
    size = torch.tensor(grid, dtype=torch.float64)
    target = torch.tensor(offset, dtype=torch.float64)
    seen = ((d.abs() < size) & ((d - target).abs() < size)).all(1)
    return seen & ~(d == target).all(1)


def _profile_2d(freqs: torch.Tensor, amplitudes: torch.Tensor, offset: Offset, grid) -> torch.Tensor:
    """Σ_f A_f cos(ω_f·(Δ − δ)) at every offset of :func:`_offsets`."""
    d = _offsets(grid) - torch.tensor(offset, dtype=torch.float64)
    return (amplitudes * torch.cos(d @ freqs.T)).sum(1)


def _worst_mass_2d(profile: torch.Tensor, offset: Offset, grid) -> float:
    """The smallest softmax mass on the target over every query whose target is on the grid."""
    h, w = grid
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    y, x = y.flatten(), x.flatten()
    index = (y[None] - y[:, None] + h - 1) * (2 * w - 1) + (x[None] - x[:, None] + w - 1)  # (query, key)
    target = (y + offset[0]) * w + x + offset[1]
    on = (y + offset[0] >= 0) & (y + offset[0] < h) & (x + offset[1] >= 0) & (x + offset[1] < w)
    probs = torch.softmax(profile[index[on]], -1)
    return float(probs.gather(1, target[on][:, None]).min())


def rope_impulse_terms_2d(freqs: torch.Tensor, offset: Offset, grid: tuple[int, int],
                          target_mass: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`rope_impulse_terms` for bands that may turn with rows and columns at once:
    ω_f = (ω_y, ω_x), phases φ_f = ω_f·δ, so every band peaks at Δ = δ.

    The rows and columns no longer separate, so the bands are chosen (fastest first, the
    number that gives the largest margin per unit amplitude) on the 2-D offsets a query whose
    target is on the grid can see, and scaled so that every such query puts at least
    ``target_mass`` on its target. An offset that another one matches for every band (1-D RoPE
    over the flattened grid: (dy, dx) and (dy + 1, dx − w)) is no rival: no query whose target
    is on the grid sees both.

    ``freqs`` is (F, 2): (ω_y, ω_x) of every rotary pair, radians per row and per column; the
    other arguments and the result are as in :func:`rope_impulse_terms`. Raises ValueError when
    no set of bands has a unique peak on the grid.

    Examples:
        >>> freqs = torch.tensor([[0.9, 0.4], [-0.4, 0.9], [0.5, 0.2], [-0.2, 0.5]])
        >>> amp, phase = rope_impulse_terms_2d(freqs, (1, -1), (4, 4), 0.9)
        >>> L = rope_logits(freqs, None, amp, phase, (4, 4))
        >>> int(L[0 * 4 + 1].argmax()) == 1 * 4 + 0  # token (0, 1) looks at (1, 0)
        True
    """
    freqs = torch.as_tensor(freqs, dtype=torch.float64).reshape(-1, 2)
    if not bool(torch.isfinite(freqs).all()):
        raise ValueError("freqs: the rotary frequencies hold NaN/inf")
    for name, size in zip(("grid rows", "grid columns"), grid):
        check_int(name, size, low=1)
    check_number("target_mass", target_mass, low=0, high=1, low_open=True, high_open=True)
    offset = (int(offset[0]), int(offset[1]))
    if abs(offset[0]) >= grid[0] or abs(offset[1]) >= grid[1]:
        raise ValueError(f"offset {offset}: outside a {grid[0]}×{grid[1]} grid; choose a smaller kernel_size")
    rivals = _rivals(offset, grid)
    if not bool(rivals.any()):  # a 1×1 grid: nothing to tell apart
        return torch.zeros(len(freqs), dtype=torch.float64), freqs @ torch.tensor(offset, dtype=torch.float64)
    order = [int(f) for f in torch.argsort(freqs.norm(dim=1), descending=True) if float(freqs[f].norm()) > 0]
    centre = (offset[0] + grid[0] - 1) * (2 * grid[1] - 1) + offset[1] + grid[1] - 1  # Δ = δ in _offsets

    def margin(amplitudes: torch.Tensor) -> float:
        profile = _profile_2d(freqs, amplitudes, offset, grid)
        return float(profile[centre] - profile[rivals].max())

    bands, _ = _fastest_bands(order, len(freqs), margin)
    if not bands:
        listed = ", ".join(f"({a:.3g}, {b:.3g})" for a, b in freqs.tolist())
        raise ValueError(f"the rotary frequencies (ω_y, ω_x) = {listed} give no unique peak at offset {offset} on a "
                         f"{grid[0]}×{grid[1]} grid (they alias, or are too slow to tell neighbours apart)")
    chosen = torch.zeros(len(freqs), dtype=torch.float64)
    chosen[bands] = 1.0
    phases = chosen * (freqs @ torch.tensor(offset, dtype=torch.float64))

    def worst(c: float) -> float:
        return _worst_mass_2d(_profile_2d(freqs, c * chosen, offset, grid), offset, grid)

    listed = ", ".join(f"({a:.3g}, {b:.3g})" for a, b in freqs[chosen > 0].tolist())
    return _least_scale(worst, target_mass, f"target_mass={target_mass}: not reachable at offset {offset} on a "
                        f"{grid[0]}×{grid[1]} grid: the fastest rotary frequencies (ω_y, ω_x) = {listed} tell the "
                        "target from its neighbours by too little; lower target_mass") * chosen, phases
