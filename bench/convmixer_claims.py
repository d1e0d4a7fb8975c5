"""The ConvMixer claims, tested on a finished ConvMixer comparison (recipe ``cpu-cifar-convmixer``).

Reads every ``<init>/seed<k>/result.json`` under the comparison folder, prints the table of all
rows (mean ± std over seeds, difference to the learned default) and then each claim with the
two means, their difference, the difference's standard error (√(s₁²/n₁ + s₂²/n₂)) and a verdict:

- frozen impulse filters are within 1 point of learned ones (|Δ| ≤ 1);
- covariance (trainable) ≥ the default init, trained the same way;
- covariance beats the default when frozen: frozen covariance > frozen random (PyTorch's
  uniform default, frozen).

"holds" is the plain comparison of means; "within noise" flags a difference smaller than two
standard errors, which three seeds cannot call either way.

    .venv/bin/python bench/convmixer_claims.py runs/cm
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from common import markdown

from structinit.harness.finished import find_runs

LEARNED = "pytorch"
CLAIMS = (  # (claim, a, b, test on the difference of means a − b in points)
    ("frozen impulse within 1 point of learned", "impulse:frozen=True", LEARNED, lambda d: abs(d) <= 1.0),
    ("covariance ≥ default (both trainable)", "covariance", LEARNED, lambda d: d >= 0.0),
    ("covariance beats default when frozen", "covariance:frozen=True", "random:frozen=True", lambda d: d > 0.0),
)


def load_rows(folder: Path) -> dict[str, list[float]]:
    """Init spec → held-out accuracies (%) of its finished seeds, in seed order."""
    rows: dict[str, list[float]] = {}
    for run in find_runs(folder):
        rows.setdefault(run.spec, []).append(100 * run.result["final"]["holdout_acc"])
    return rows


def _short(spec: str) -> str:
    """The transfer's source path is long and machine-specific: the table names the init only."""
    return "covariance_transfer" if spec.startswith("covariance_transfer") else spec


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(rows: dict[str, list[float]]) -> str:
    base = statistics.fmean(rows[LEARNED]) if LEARNED in rows else None
    lines = []
    for spec, values in sorted(rows.items(), key=lambda kv: -statistics.fmean(kv[1])):
        mean, sd = _stats(values)
        delta = "" if base is None or spec == LEARNED else f"{mean - base:+.2f}"
        lines.append([_short(spec), f"{mean:.2f} ± {sd:.2f}", ", ".join(f"{v:.2f}" for v in values), delta])
    return markdown(["init", "held-out accuracy % (mean ± std)", "per seed", "Δ vs learned"], "lrlr", lines)


def claims(rows: dict[str, list[float]]) -> str:
    lines = []
    for text, a, b, test in CLAIMS:
        if a not in rows or b not in rows:
            lines.append(f"| {text} | | | | | not measured ({a if a not in rows else b} missing) |")
            continue
        (ma, sa), (mb, sb) = _stats(rows[a]), _stats(rows[b])
        diff = ma - mb
        se = math.sqrt(sa**2 / len(rows[a]) + sb**2 / len(rows[b]))
        verdict = "holds" if test(diff) else "fails"
        if abs(diff) < 2 * se:
            verdict += " (within noise)"
        lines.append(f"| {text} | {ma:.2f} | {mb:.2f} | {diff:+.2f} | {se:.2f} | {verdict} |")
    return "\n".join([markdown(["claim", "a", "b", "a − b (points)", "std. error", "verdict"], "lrrrrl"), *lines])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="the compare folder of the cpu-cifar-convmixer runs")
    args = ap.parse_args()
    rows = load_rows(args.folder)  # find_runs: a clear error if the folder holds no finished run
    print(table(rows), "", claims(rows), sep="\n")


if __name__ == "__main__":
    main()
