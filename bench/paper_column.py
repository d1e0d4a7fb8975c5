"""The paper's CIFAR-10 column as the GPU runs fill it: each ``paper-cifar`` run that a draw
brought back (``docs/results/data/gpu/runs.json`` lists them, with the card and the state),
read on the exact test images 0–1016 with their standard error, set against the paper's
Table 2. The whole test set's accuracy is beside it: images 1017–9999 of the shared CIFAR-10
``test_batch`` are JPEG re-encodings, so it is a degraded test, not the paper's.

    .venv/bin/python bench/paper_column.py            # the markdown table
    .venv/bin/python bench/paper_column.py --epoch 32 # every run as it stood at epoch 32
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "docs" / "results" / "data" / "gpu"
# Zheng, Li, Lucey, Table 2: ViT-Tiny, 200 epochs, CIFAR-10 top-1 %
PAPER_CIFAR10 = {"pytorch": 86.36, "trunc_normal": 88.63, "mimetic": 91.16, "impulse": 91.62,
                 "impulse:kernel_size=5": 90.67}
EPOCHS = 200  # paper-cifar's


def standard_error(accuracy: float, n: int) -> float:
    """The binomial standard error of an accuracy measured on ``n`` images."""
    return math.sqrt(accuracy * (1 - accuracy) / n)


def column_row(init: str, entry: dict, folder: Path, epoch: int | None = None) -> str:
    """One run's row; with ``epoch``, as the run stood at the end of that epoch (inits compared at
    the same point while the column fills), or None if it has not reached it."""
    rows = [json.loads(line) for line in (folder / entry["metrics"]).read_text().splitlines()]
    if epoch is not None:
        rows = [r for r in rows if r["epoch"] <= epoch]
        if not rows or rows[-1]["epoch"] != epoch:
            return None
    last = rows[-1]
    exact_key = next(k for k in last if k.startswith("test_first") and k.endswith("_acc"))
    n = int(exact_key.removeprefix("test_first").removesuffix("_acc"))
    exact = last[exact_key]
    whole = [r for r in rows if "test_acc" in r]
    whole_text = f"{100 * whole[-1]['test_acc']:.2f} (epoch {whole[-1]['epoch']})" if whole else "–"
    rates = [r["images_per_s"] for r in rows[1:]] or [rows[0]["images_per_s"]]  # the first epoch compiles
    paper = PAPER_CIFAR10.get(init)
    return (f"| `{init}` | {last['epoch']} of {EPOCHS} | {100 * exact:.2f} ± {100 * standard_error(exact, n):.2f} | "
            f"{whole_text} | {'–' if paper is None else f'{paper:.2f}'} | {statistics.median(rates):,.0f} | "
            f"{last['wall_s'] / 60:.1f} | {entry['card']} |")


def column(folder: Path, epoch: int | None = None) -> str:
    manifest = json.loads((folder / "runs.json").read_text())["runs"]
    found = {init: column_row(init, entry, folder, epoch) for init, entry in manifest.items()}
    missing = [init for init, row in found.items() if row is None]
    lines = ["| init | epochs done | test images 0–1016 % (± s.e.) | whole test set % | paper % (200 epochs) | "
             "training images/s (median epoch) | minutes | card |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    note = f"\nNot at epoch {epoch} yet: {', '.join(missing)}\n" if missing else ""
    return "\n".join([*lines, *(row for row in found.values() if row is not None)]) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the folder with runs.json and the metrics")
    p.add_argument("--epoch", type=int, default=None,
                   help="each run as it stood at the end of this epoch (runs short of it are listed apart)")
    args = p.parse_args(argv)
    if args.epoch is not None and not 1 <= args.epoch <= EPOCHS:
        p.error(f"--epoch: {args.epoch} is not an epoch of a paper-cifar run; pass 1 … {EPOCHS}")
    print(column(args.data, args.epoch), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
