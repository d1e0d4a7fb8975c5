r"""Proposition 1 of Zheng, Li & Lucey, *Structured Initialization for Attention in Vision
Transformers*: channel mixing of impulse-filtered channels can express any f×f filter.

The maths (tested by ``tests/test_proposition1.py``; not part of the ``structinit`` package, no
init uses it), and as a script the residual against the channel count D: for k ∈ {1, 2, 4},
f ∈ {3, 5} on an 8×8 grid, D from k to 2·k·f², balanced and random offsets, a markdown table and
a figure of the residual against D/(k·f²).

    OMP_NUM_THREADS=1 .venv/bin/python bench/proposition1.py --figure docs/figures/proposition1.png

Setting. Tokens of an h×w grid (N = h·w, row-major), D channels, input X ∈ ℝ^{N×D} of rank k,
X = A·B with A ∈ ℝ^{N×k}, B ∈ ℝ^{k×D}. For a tap t = (dy, dx) of an f×f kernel let S_t be the
N×N zero-padded shift (:func:`~structinit.functional.targets.impulse_matrix`, a cross-correlation
as in ``conv2d(padding=f//2)``). A depthwise layer with *impulse* filters gives channel c the
one-hot filter at offset o(c):

    Y = [S_{o(1)} X_{:,1}, …, S_{o(D)} X_{:,D}]                          (N×D),

and a general f×f convolution with weights W_t ∈ ℝ^{D×D_out} per tap gives

    Z = Σ_t S_t X W_t = Σ_t S_t A (B W_t)                                 (N×D_out).

Grouping channels by offset, C_t = {c : o(c) = t},

    Y M = Σ_t S_t A (B_{:,C_t} M_{C_t,:}).

Statement tested (sufficiency, exact). If for every one of the f² taps t the columns
B_{:,C_t} span ℝ^k (so |C_t| ≥ k for all t, hence D ≥ k·f²), then for *every* filter bank
(W_t) there is a mixing matrix M ∈ ℝ^{D×D_out} with Y M = Z exactly: solve
B_{:,C_t} M_{C_t,:} = B W_t tap by tap. Numerically the least-squares residual is ~1e-15.

Converse (generic). Write K = [S_{t_1} A, …, S_{t_{f²}} A] (N×k·f²). Then Z = K·V with
V = [B W_t]_t arbitrary, and Y = K·P where column c of P is e_{o(c)} ⊗ B_{:,c}. Every Z is
reachable iff rank(K P) = rank(K). When K has full column rank (generic A and N ≥ k·f²) this
is iff P has full row rank k·f², i.e. iff every tap has channels whose B columns span ℝ^k:
then D < k·f², or a tap with fewer than k channels, leaves a residual > 0 for a generic target.
When N < k·f² (e.g. k = 4, f = 5 on 8×8), rank(K) ≤ N and D ≥ rank(K) channels can already
suffice: Proposition 1's k·f² is a sufficient count, the exact one is rank(K) ≤ min(N, k·f²).

Random offsets (ConvMixer's frozen random impulse filters) are a coupon-collector draw: at
D = k·f² every tap gets exactly k channels only with small probability, so the residual keeps
shrinking beyond D = k·f² and reaches 0 once every tap has been drawn k times
(:func:`proposition1_curve` with ``assignment="random"``); the ``"balanced"`` assignment
(channel c → tap c mod f²) meets the condition exactly from D = k·f² on.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from common import markdown, pyplot

from structinit.functional.targets import (
    Offset,
    check_kernel_size,
    check_offsets,
    kernel_offsets,
    random_offsets,
    target_index,
)
from structinit.harness.run.checkpoint import write_png

ASSIGNMENTS = ("balanced", "random")


def _check_tokens(x: torch.Tensor, grid: tuple[int, int], name: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected token features of shape (N, D), got {shape}")
    if len(grid) != 2 or x.shape[0] != grid[0] * grid[1]:
        raise ValueError(
            f"{name}: has N={x.shape[0]} tokens but grid={tuple(grid)} holds {grid[0] * grid[1]}; "
            "give x of shape (h·w, D)"
        )


def _named_offsets(offsets: Sequence[Offset], kernel_size: int, name: str, channels: int) -> list[Offset]:
    """:func:`check_offsets`, and one offset per channel, with the error messages naming the
    caller's parameter."""
    try:
        offsets = check_offsets(offsets, kernel_size)
    except ValueError as err:  # OptionError is a ValueError too
        raise type(err)(str(err).replace("offsets:", f"{name}:", 1)) from None
    if len(offsets) != channels:
        raise ValueError(f"{name}: got {len(offsets)} offsets for D={channels} channels; give one per channel")
    return offsets


def shift_rows(x: torch.Tensor, grid: tuple[int, int], offset: Offset) -> torch.Tensor:
    """S_t X for the zero-padded shift at ``offset`` = (dy, dx): row (y, x) of the result is
    row (y+dy, x+dx) of ``x``, or 0 off the grid. Same as ``impulse_matrix(grid, offset) @ x``
    without forming the N×N matrix. Shapes: x (N, C) → (N, C).

    Examples:
        >>> x = torch.arange(3.0).reshape(3, 1)  # a 1×3 grid, one channel
        >>> shift_rows(x, (1, 3), (0, 1)).flatten().tolist()
        [1.0, 2.0, 0.0]
    """
    idx = target_index(grid, offset)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return padded[torch.where(idx >= 0, idx, x.shape[0])]


def impulse_features(
    x: torch.Tensor, grid: tuple[int, int], offsets: Sequence[Offset], kernel_size: int | None = None
) -> torch.Tensor:
    r"""Y = [S_{o(1)} X_{:,1}, …, S_{o(D)} X_{:,D}]: a depthwise layer whose channel c has the
    one-hot filter at ``offsets[c]`` = (dy, dx), zero padded; equals ``conv2d(groups=D,
    padding=f//2)`` with those one-hot f×f kernels. Shapes: x (N, D), N = h·w → Y (N, D).
    ``kernel_size``, if given, bounds the offsets (|dy|, |dx| ≤ f//2).

    Examples:
        >>> x = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])  # 1×3 grid, D = 2
        >>> impulse_features(x, (1, 3), [(0, -1), (0, 1)]).tolist()
        [[0.0, 20.0], [1.0, 30.0], [2.0, 0.0]]
    """
    _check_tokens(x, grid)
    if kernel_size is not None:
        check_kernel_size(kernel_size)
    bound = kernel_size if kernel_size is not None else 2 * max(grid) + 1
    offsets = _named_offsets(offsets, bound, "offsets", x.shape[1])
    out = torch.empty_like(x)
    for off in set(offsets):
        cols = [c for c, o in enumerate(offsets) if o == off]
        out[:, cols] = shift_rows(x[:, cols], grid, off)
    return out


def filter_output(x: torch.Tensor, grid: tuple[int, int], weights: torch.Tensor) -> torch.Tensor:
    r"""Z = Σ_t S_t X W_t: a general f×f convolution (cross-correlation, zero padding f//2) of
    token features. ``weights[i, j]`` (D×D_out) is the tap at offset (i − f//2, j − f//2), i.e.
    ``weights = conv2d_weight.permute(2, 3, 1, 0)``. Shapes: x (N, D), weights (f, f, D, D_out)
    → Z (N, D_out).

    Examples:
        >>> x = torch.tensor([[1.0], [2.0], [3.0]])  # 1×3 grid, D = 1
        >>> w = torch.zeros(3, 3, 1, 1); w[1, 0] = 1.0; w[1, 2] = 1.0  # left + right neighbour
        >>> filter_output(x, (1, 3), w).flatten().tolist()
        [2.0, 4.0, 2.0]
    """
    _check_tokens(x, grid)
    if weights.dim() != 4 or weights.shape[0] != weights.shape[1] or weights.shape[2] != x.shape[1]:
        raise ValueError(f"weights: expected shape (f, f, D={x.shape[1]}, D_out), got {tuple(weights.shape)}")
    f = weights.shape[0]
    check_kernel_size(f)
    out = x.new_zeros(x.shape[0], weights.shape[3])
    for dy, dx in kernel_offsets(f):
        out += shift_rows(x, grid, (dy, dx)) @ weights[dy + f // 2, dx + f // 2].to(x.dtype)
    return out


def mixing_residual(
    x: torch.Tensor,
    grid: tuple[int, int],
    kernel_size: int,
    channel_offsets: Sequence[Offset],
    target: torch.Tensor,
) -> float:
    r"""Relative residual min_M ‖Y M − Z‖_F / ‖Z‖_F of channel mixing M (D×D_out) applied to the
    impulse features Y = :func:`impulse_features` (x, grid, channel_offsets), solved by
    ``torch.linalg.lstsq`` in float64. 0 (to ~1e-15) iff the target ``Z`` is a linear mix of
    impulse-filtered channels. Shapes: x (N, D), channel_offsets D pairs, target (N, D_out).
    Build a rank-k ``x`` in float64: a float32 product A·B is rank k only up to ~1e-7, and so is
    then the residual.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> a, b = torch.randn(16, 1, generator=g), torch.randn(1, 9, generator=g)
        >>> x = a.double() @ b.double()  # 4×4 grid, rank k = 1, D = 9 (float64: exactly rank 1)
        >>> z = filter_output(x, (4, 4), torch.randn(3, 3, 9, 2, generator=g).double())
        >>> mixing_residual(x, (4, 4), 3, kernel_offsets(3), z) < 1e-10  # one channel per tap
        True
        >>> mixing_residual(x, (4, 4), 3, kernel_offsets(3)[:8] + [(0, 0)], z) > 1e-3  # tap (1, 1) unused
        True
    """
    check_kernel_size(kernel_size)
    _check_tokens(x, grid)
    offsets = _named_offsets(channel_offsets, kernel_size, "channel_offsets", x.shape[1])
    if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.shape[0] != x.shape[0]:
        shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"target: expected shape (N={x.shape[0]}, D_out), got {shape}")
    z = target.double()
    norm = torch.linalg.norm(z)
    if norm == 0:
        raise ValueError("target: is all zeros, its relative residual is undefined")
    y = impulse_features(x.double(), grid, offsets)
    m = torch.linalg.lstsq(y, z, driver="gelsd").solution
    return float(torch.linalg.norm(y @ m - z) / norm)


def channel_assignment(
    channels: int, kernel_size: int, assignment: str = "balanced", generator: torch.Generator | None = None
) -> list[Offset]:
    """Offsets of ``channels`` impulse filters: ``"balanced"`` gives channel c the tap c mod f²
    (every tap has ⌊D/f²⌋ or ⌈D/f²⌉ channels), ``"random"`` draws taps uniformly, with
    replacement, from ``generator`` (ConvMixer's frozen random impulses).

    Examples:
        >>> channel_assignment(4, 3)
        [(-1, -1), (-1, 0), (-1, 1), (0, -1)]
    """
    if assignment == "balanced":
        taps = kernel_offsets(kernel_size)
        return [taps[c % len(taps)] for c in range(channels)]
    if assignment == "random":
        return random_offsets(channels, kernel_size, generator=generator)
    raise ValueError(f"assignment={assignment!r}: expected one of {', '.join(ASSIGNMENTS)}")


def proposition1_curve(
    k: int,
    kernel_size: int,
    grid: tuple[int, int],
    channel_counts: Sequence[int],
    trials: int = 5,
    generator: torch.Generator | None = None,
    *,
    assignment: str = "random",
    out_channels: int = 4,
) -> torch.Tensor:
    r"""Relative residual of :func:`mixing_residual` against the number of channels D.

    Per trial: A ∈ ℝ^{N×k}, B ∈ ℝ^{k×D_max}, conv weights (f, f, D_max, out_channels), all
    standard normal, float64, and D_max offsets from :func:`channel_assignment`. The target is
    Z = :func:`filter_output` (A·B, grid, weights), fixed for the trial; each D uses the first D
    channels, X_D = A·B_{:, :D}. For D ≥ k, rank(B_{:, :D}) = k and Z = Σ_t S_t X_D (B_{:,:D}⁺ B W_t)
    is an f×f conv of X_D; since Y_D's columns grow with D, each trial's curve is non-increasing.
    Shapes: → (len(channel_counts), 2), columns (mean, max) over trials, float64.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> r = proposition1_curve(1, 3, (6, 6), [4, 9], trials=2, generator=g, assignment="balanced")
        >>> r.shape, bool(r[0, 0] > 1e-3), bool(r[1, 1] < 1e-10)
        (torch.Size([2, 2]), True, True)
    """
    check_kernel_size(kernel_size, grid)
    counts = [int(d) for d in channel_counts]
    if not counts or min(counts) < 1:
        raise ValueError(f"channel_counts={channel_counts!r}: expected positive channel counts")
    if k < 1:
        raise ValueError(f"k={k}: the input rank must be ≥ 1")
    if trials < 1:
        raise ValueError(f"trials={trials}: expected ≥ 1")
    n, d_max, f = grid[0] * grid[1], max(counts), kernel_size
    res = torch.empty(trials, len(counts), dtype=torch.float64)
    for trial in range(trials):
        a = torch.randn(n, k, generator=generator, dtype=torch.float64)
        b = torch.randn(k, d_max, generator=generator, dtype=torch.float64)
        w = torch.randn(f, f, d_max, out_channels, generator=generator, dtype=torch.float64)
        offsets = channel_assignment(d_max, f, assignment, generator)
        z = filter_output(a @ b, grid, w)
        for i, d in enumerate(counts):
            res[trial, i] = mixing_residual(a @ b[:, :d], grid, f, offsets[:d], z)
    return torch.stack([res.mean(0), res.amax(0)], dim=1)


RATIOS = (0.125, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0)
FLOOR = 1e-17  # log-axis floor for exact zeros


def run(grid: tuple[int, int], trials: int, seed: int) -> list[dict]:
    rows = []
    for k in (1, 2, 4):
        for f in (3, 5):
            counts = sorted({max(1, round(r * k * f * f)) for r in RATIOS})
            curves = {
                a: proposition1_curve(k, f, grid, counts, trials, torch.Generator().manual_seed(seed), assignment=a)
                for a in ("balanced", "random")
            }
            for i, d in enumerate(counts):
                rows.append({"k": k, "f": f, "kf2": k * f * f, "D": d, **{
                    f"{a}_{s}": float(curves[a][i, j]) for a in curves for j, s in enumerate(("mean", "max"))
                }})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    columns = ("balanced_mean", "balanced_max", "random_mean", "random_max")
    cells = [[r["k"], r["f"], r["kf2"], r["D"], f"{r['D'] / r['kf2']:.2f}", *(f"{r[c]:.1e}" for c in columns)]
             for r in rows]
    return markdown(["k", "f", "k·f²", "D", "D/(k·f²)", "balanced mean", "balanced max", "random mean", "random max"],
                    "lllllllll", cells)


def plot(rows: list[dict], path: str) -> None:
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0))
    for i, (k, f) in enumerate(sorted({(r["k"], r["f"]) for r in rows})):
        sel = [r for r in rows if (r["k"], r["f"]) == (k, f)]
        x = [r["D"] / r["kf2"] for r in sel]
        color = f"C{i}"
        ax.plot(x, [max(r["balanced_mean"], FLOOR) for r in sel], "o-", color=color, label=f"k={k}, f={f}")
        ax.plot(x, [max(r["random_mean"], FLOOR) for r in sel], "x--", color=color, alpha=0.7)
    ax.axvline(1.0, color="k", lw=1, ls=":")
    ax.set(yscale="log", xlabel="D / (k·f²)", ylabel="relative residual ‖YM − Z‖ / ‖Z‖ (mean of trials)")
    ax.set_title("Proposition 1, 8×8 grid: solid balanced offsets, dashed random", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    write_png(path, fig, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figure", default="docs/figures/proposition1.png", help="where to write the PNG")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = run((8, 8), args.trials, args.seed)
    print(table(rows))
    plot(rows, args.figure)
    print(f"\nfigure: {args.figure}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
