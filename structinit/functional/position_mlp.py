"""Impulse tables written through a continuous position bias (CPB): an MLP that maps each
relative offset's coordinates to one logit per head (Swin-V2, timm's relpos-MLP ViTs).

Such a layer computes its relative bias table as

    table = g · act(H W₂ᵀ + b₂),    H = φ(C W₁ᵀ + b₁)  (R × d),

C (R × 2) the fixed coordinates of the R = (2h − 1)(2w − 1) offsets of an h × w window, φ the
hidden activation (ReLU), ``act`` the identity or a sigmoid with gain g (Swin-V2: 16·sigmoid), and
head h's logit for query i and key j is ``table[index[i, j], h]``. An impulse at offset δ wants
column h high at δ's row t and low elsewhere. The last layer is linear in (W₂, b₂), so it is
fitted by least squares on pre-activation targets: z_t = hi and z_r ≤ lo for every other row r
(a one-sided bound: lower than lo only makes the map sharper). The fit solves
min ‖[H 1] x − z‖² + λ‖x‖² over the rows that are not yet below their bound and repeats with the
rows that are (a finite Newton iteration for the squared hinge); with d + 1 ≥ R and [H 1] of
full row rank the first solve is already exact, otherwise the rows the bound frees make it exact
whenever the features can separate row t from the rest, and the leftover (the residual) is
reported. The tiny ridge λ keeps W₂ small where [H 1] is ill-conditioned.

The package inits of these MLPs (trunc-normal W₁, zero b₁) give features that are positively
homogeneous in C: entries on one ray from the origin are proportional and the (0, 0) entry is 0
whatever W₂ is, so no last layer can single out one offset. :func:`position_mlp_features` builds
a first layer whose ReLU kinks lie on the table's own coordinate values instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from structinit.functional.relative import impulse_logit
from structinit.utils import check_int, check_number

__all__ = ["SIGMOID_EDGE", "LastLayerFit", "fit_last_layer", "impulse_targets", "cosine_logit_scale",
           "position_mlp_features", "table_margin"]

# A sigmoid table's pre-activation targets are ±SIGMOID_EDGE: the table within a few percent of
# its cap at the offset and of 0 elsewhere, while the sigmoid keeps a slope the MLP can learn through.
SIGMOID_EDGE = 4.0
RIDGE = 1e-8  # λ relative to the mean squared feature norm: W₂ stays small, the fit stays exact
EXACT = 1e-4  # a residual below this (relative to hi − lo) is a fit to rounding and the ridge


def position_mlp_features(coords: torch.Tensor, hidden: int, *, generator: torch.Generator | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(W₁ (hidden, 2), b₁ (hidden,)) float64 of a first layer whose ReLU features can carry an
    impulse at any offset near the centre. The first units are ReLU(±(c_a − v)) for every value v
    that axis a of the coordinates ``coords`` (R, 2) takes, those nearest 0 first: with the four
    units of a row's two values, −|c_y − v_y| − |c_x − v_x| is a combination of them that peaks at
    that row alone. The remaining units are ReLU(u·(c − p)), u a unit direction uniform in angle and
    p uniform in the coordinates' bounding box, so that every kink line crosses the table.

    Examples:
        >>> coords = torch.tensor([[-1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
        >>> w1, b1 = position_mlp_features(coords, 8, generator=torch.Generator().manual_seed(0))
        >>> w1[:4].tolist(), b1[:4].tolist()  # kinks at y = 0 and x = 0 first, both signs
        ([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], [0.0, 0.0, 0.0, 0.0])
        >>> bool(torch.allclose(w1.norm(dim=1), torch.ones(8, dtype=w1.dtype)))
        True
    """
    check_int("hidden", hidden, low=1)
    if coords.ndim != 2 or coords.shape[1] != 2:
        raise ValueError(f"coords has shape {tuple(coords.shape)}; expected (R, 2), one (y, x) row per offset")
    c = coords.detach().double().cpu()
    levels = [sorted(torch.unique(c[:, a]).tolist(), key=lambda v: (abs(v), v)) for a in range(2)]
    units = [([sign if a == axis else 0.0 for a in range(2)], 0.0 - sign * levels[axis][rank])
             for rank in range(max(len(v) for v in levels)) for axis in range(2) if rank < len(levels[axis])
             for sign in (1.0, -1.0)][:hidden]
    w1 = torch.tensor([u for u, _ in units], dtype=torch.float64).reshape(-1, 2)
    b1 = torch.tensor([b for _, b in units], dtype=torch.float64)
    extra = hidden - len(units)
    angle = torch.rand(extra, generator=generator, dtype=torch.float64) * 2 * math.pi
    low, high = c.min(0).values, c.max(0).values
    points = low + (high - low) * torch.rand(extra, 2, generator=generator, dtype=torch.float64)
    w_rand = torch.stack([angle.cos(), angle.sin()], 1)
    return torch.cat([w1, w_rand]), torch.cat([b1, -(w_rand * points).sum(1)])


def impulse_targets(margin: float | None, activation: str = "identity", gain: float = 1.0) -> tuple[float, float]:
    """(hi, lo): the pre-activation value at the offset's row and the bound on every other row,
    so that the table g·act(z) is at least ``margin`` higher at the offset.

    - identity: hi = margin / g, lo = 0;
    - sigmoid, ``margin=None`` (cosine attention: as sharp as the cap allows): ±:data:`SIGMOID_EDGE`,
      a margin of g·tanh(SIGMOID_EDGE / 2);
    - sigmoid with a margin: lo = −SIGMOID_EDGE and hi = logit(σ(lo) + margin / g); a margin the
      cap g cannot reach is a ValueError.

    Examples:
        >>> impulse_targets(3.0)
        (3.0, 0.0)
        >>> hi, lo = impulse_targets(4.0, "sigmoid", 16.0)
        >>> round(16 * (torch.tensor(hi).sigmoid() - torch.tensor(lo).sigmoid()).item(), 6)
        4.0
    """
    check_number("gain", gain, low=0, low_open=True)
    if activation == "identity":
        if margin is None:
            raise ValueError("margin=None: an identity table has no cap, give the margin the impulse needs")
        return float(margin) / gain, 0.0
    if activation != "sigmoid":
        raise ValueError(f"activation={activation!r}: use 'identity' or 'sigmoid'")
    if margin is None:
        return SIGMOID_EDGE, -SIGMOID_EDGE
    low = 1 / (1 + math.exp(SIGMOID_EDGE))
    top = low + float(margin) / gain
    if top >= 1:
        raise ValueError(f"a margin of {margin:.3g} between the offset's logit and the others exceeds the table's "
                         f"cap {gain:g}·sigmoid; lower target_mass")
    return math.log(top / (1 - top)), -SIGMOID_EDGE


@dataclass(frozen=True)
class LastLayerFit:
    """The fitted last layer: ``weight`` (heads, d), ``bias`` (heads,) or None, float64; per
    head the relative ``residual`` (0 when every bound holds) and the pre-activation ``fitted``
    column (R, heads)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    residual: torch.Tensor
    fitted: torch.Tensor


def fit_last_layer(hidden: torch.Tensor, rows: list[int], hi: float, lo: float, *, bias: bool = True,
                   iterations: int = 200) -> LastLayerFit:
    """Least squares for the last Linear of a position MLP (module doc): column h of
    [H 1] [W₂ᵀ; b₂ᵀ] equals ``hi`` at row ``rows[h]`` and is at most ``lo`` at every other row.
    ``hidden`` is H (R, d); ``bias=False`` fits W₂ alone (a last Linear without bias). The
    residual is ‖violations‖ / (hi − lo) per head.

    Examples:
        >>> H = torch.eye(3, dtype=torch.float64)
        >>> fit = fit_last_layer(H, [1], 5.0, 0.0, bias=False)
        >>> [round(v, 6) for v in fit.fitted[:, 0].tolist()], float(fit.residual[0]) < 1e-6
        ([0.0, 5.0, 0.0], True)
    """
    if hidden.ndim != 2:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}; expected (R, d)")
    if not hi > lo:
        raise ValueError(f"hi={hi} must exceed lo={lo}")
    a = hidden.detach().double().cpu()
    if bias:
        a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
    gram = a @ a.T
    ridge = RIDGE * float(gram.diagonal().mean().clamp_min(1e-12))
    memo = {row: _one_sided(a, gram, ridge, row, hi, lo, iterations) for row in dict.fromkeys(rows)}
    solutions, fitted, residual = zip(*(memo[row] for row in rows))
    x = torch.stack(solutions)  # (heads, d [+ 1])
    return LastLayerFit(x[:, : hidden.shape[1]], x[:, -1] if bias else None, torch.tensor(residual),
                        torch.stack(fitted, 1))


def _one_sided(a, gram, ridge, row, hi, lo, iterations):
    """One column: the finite Newton iteration of the module doc; the best iterate by residual."""
    z = torch.full((len(a),), lo, dtype=a.dtype)
    z[row] = hi
    active = torch.ones(len(a), dtype=torch.bool)
    tol = 1e-6 * (hi - lo)
    best = None
    for _ in range(iterations):
        sub = gram[active][:, active] + ridge * torch.eye(int(active.sum()), dtype=a.dtype)
        x = a[active].T @ torch.linalg.solve(sub, z[active])
        f = a @ x
        over = (f - lo).clamp_min(0)
        over[row] = (f[row] - hi).abs()
        residual = float(over.norm()) / (hi - lo)
        if best is None or residual < best[2]:
            best = (x, f, residual)
        now = f > lo + tol
        now[row] = True
        if residual < EXACT or (torch.equal(now | active, active) and residual < 1e-3 * EXACT):
            break  # the first solve, on every row, is exact when [H 1] has full row rank: it is kept
        active = now | (active & (f > lo - tol))  # rows at their bound stay, rows above it join
    return best


def table_margin(table: torch.Tensor, rows: list[int], floor: float | None = None) -> torch.Tensor:
    """Per head h, ``table[rows[h], h]`` less the largest other entry of column h (and less
    ``floor``, a logit every window also holds, such as a class token's 0, when given).

    Examples:
        >>> table_margin(torch.tensor([[0.0], [3.0], [1.0]]), [1])
        tensor([2.])
    """
    out = []
    for h, row in enumerate(rows):
        column = table[:, h]
        others = torch.cat([column[:row], column[row + 1:]])
        top = others.max() if floor is None else torch.maximum(others.max(), torch.tensor(floor, dtype=table.dtype))
        out.append(column[row] - top)
    return torch.stack(out)


def cosine_logit_scale(margin: torch.Tensor, target_mass: float, keys: int) -> torch.Tensor:
    """Per head, the largest scale s of cosine attention (logits s·cos(q, k) + bias) whose content
    term cannot take the target below ``target_mass``: every other logit rises by at most s and the
    target's falls by at most s, so a bias ``margin`` Δ guarantees
    mass ≥ 1 / (1 + (n − 1) e^{−(Δ − 2s)}) on any content, and s = (Δ − β) / 2 with
    β = log(m (n − 1) / (1 − m)). A margin at or below β is a ValueError.

    Examples:
        >>> s = cosine_logit_scale(torch.tensor([10.0]), 0.5, 2)
        >>> float(s[0])
        5.0
    """
    beta = impulse_logit(target_mass, keys)
    if bool((margin <= beta).any()):
        raise ValueError(f"a bias margin of {float(margin.min()):.3g} cannot hold target_mass={target_mass} over "
                         f"{keys} keys (it needs more than {beta:.3g}); lower target_mass")
    return (margin - beta) / 2
