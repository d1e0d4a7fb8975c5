"""Proposition 1 (Zheng, Li & Lucey): relative residual of channel mixing of impulse-filtered
channels against a general f×f conv target, as a function of the channel count D.

For k ∈ {1, 2, 4}, f ∈ {3, 5} on an 8×8 grid (N = 64), D from k to 2·k·f², 5 trials each, with
the balanced offset assignment (channel c → tap c mod f², exact from D = k·f²) and ConvMixer's
random one (coupon collector). Prints a markdown table and plots residual vs D/(k·f²).
With k = 4, f = 5, k·f² = 100 > N = 64: there D = N channels already suffice.

    OMP_NUM_THREADS=1 .venv/bin/python bench/proposition1.py --figure docs/figures/proposition1.png
"""

from __future__ import annotations

import argparse
import time

import torch

from proposition1_maths import proposition1_curve

RATIOS = (0.125, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0)
FLOOR = 1e-17  # log-axis floor for exact zeros


def channel_counts(k: int, f: int) -> list[int]:
    return sorted({max(1, round(r * k * f * f)) for r in RATIOS})


def run(grid: tuple[int, int], trials: int, seed: int) -> list[dict]:
    rows = []
    for k in (1, 2, 4):
        for f in (3, 5):
            counts = channel_counts(k, f)
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
    head = "| k | f | k·f² | D | D/(k·f²) | balanced mean | balanced max | random mean | random max |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        cells = [r["k"], r["f"], r["kf2"], r["D"], f"{r['D'] / r['kf2']:.2f}"]
        cells += [f"{r[c]:.1e}" for c in ("balanced_mean", "balanced_max", "random_mean", "random_max")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (k, f) in enumerate(sorted({(r["k"], r["f"]) for r in rows})):
        sel = [r for r in rows if (r["k"], r["f"]) == (k, f)]
        x = [r["D"] / r["kf2"] for r in sel]
        color = f"C{i}"
        ax.plot(x, [max(r["balanced_mean"], FLOOR) for r in sel], "o-", color=color, label=f"k={k}, f={f}")
        ax.plot(x, [max(r["random_mean"], FLOOR) for r in sel], "x--", color=color, alpha=0.7)
    ax.axvline(1.0, color="k", lw=1, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("D / (k·f²)")
    ax.set_ylabel("relative residual ‖YM − Z‖ / ‖Z‖ (mean of trials)")
    ax.set_title("Proposition 1, 8×8 grid: solid balanced offsets, dashed random", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


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
