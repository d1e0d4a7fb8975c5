"""Does keeping the structure pay? Held-out accuracy against real-image fidelity at init.

For every init spec with finished runs in the given ``compare`` folders (``result.json``
per seed), the model of each run is rebuilt exactly as the run built it (same recipe, same
init seed) and its impulse fidelity is measured at init on real CIFAR-10 test images
0 … n−1: argmax hit and attention mass on the target, at layer 1 and averaged over layers.
Inits without impulse offsets (pytorch, mimetic, …) are measured against the offsets of the
first impulse spec, i.e. "how often would a random 3×3 tap win" (their hit is near chance).

Prints one table (mean over seeds) and writes a scatter figure: accuracy against mean hit and
against mean mass, one point per init spec with error bars over seeds.

    .venv/bin/python bench/data_efficiency.py --inits "SPEC;SPEC" --out runs/c9     # train first
    .venv/bin/python bench/fidelity_accuracy.py --runs runs/c9 --figure runs/c9/fidelity_accuracy.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from common import DATA_DIR, cifar_test_images, pyplot

import structinit as si
from structinit.harness.config import ImageConfig
from structinit.harness.summary import primary_metric
from structinit.harness.tasks.image import load_train_split, plan_model


def finished_runs(folders: list[Path]) -> dict[str, list[dict]]:
    """{run label: [result.json of each finished seed]} over every folder, in folder order."""
    runs: dict[str, list[dict]] = {}
    for folder in folders:
        if not folder.is_dir():
            sys.exit(f"error: --runs {folder}: no such folder (a `compare` output folder)")
        for result in sorted(folder.glob("*/seed*/result.json")):
            runs.setdefault(f"{folder.name}/{result.parent.parent.name}", []).append(json.loads(result.read_text()))
    if not runs:
        sys.exit(f"error: no finished run (*/seed*/result.json) under {', '.join(map(str, folders))}")
    return runs


def fidelity_at_init(cfg: ImageConfig, train_ds, images, offsets) -> tuple[si.FidelitySummary, list | None]:
    """Fidelity of the run's model at init, and the offsets its impulse init recorded (None
    for other inits, which are then measured against ``offsets``)."""
    model, plan = plan_model(cfg, train_ds.image_shape, train_ds.num_classes)
    plan.commit()
    record = si.get_record(si.find_attention_layers(model)[0][1].module)
    fid = si.impulse_fidelity(model, images, offsets=None if record else offsets)
    return si.fidelity_summary(fid), (record["offsets"] if record else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, nargs="+", required=True, help="compare output folder(s)")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--figure", type=Path, default=None,
                    help="PNG path (default: <first --runs>/fidelity_accuracy.png)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    runs = finished_runs(args.runs)
    images = cifar_test_images(args.data_dir, args.images)
    # Impulse runs first, so that inits without offsets are measured against a real impulse draw.
    order = sorted(runs, key=lambda k: runs[k][0]["config"]["init"] != "impulse")
    rows, offsets, datasets = [], None, {}
    for label in order:
        accs, fids = [], []
        for result in runs[label]:
            cfg = ImageConfig(**{**result["config"], "data_dir": str(args.data_dir)})
            key = (cfg.dataset, cfg.data_dir)
            if key not in datasets:  # only the image shape and class count are needed
                datasets[key] = load_train_split(dataclasses.replace(cfg, train_size=10))
            summary, recorded = fidelity_at_init(cfg, datasets[key], images, offsets)
            offsets = offsets or recorded
            accs.append(result["final"][primary_metric(result["final"])])
            fids.append(dataclasses.astuple(summary))
        config = runs[label][0]["config"]
        spec = config["init"] + "".join(f",{k}={v}" for k, v in config["init_options"].items())
        mean = [statistics.fmean(f[i] for f in fids) for i in range(4)]
        rows.append((label, spec, len(accs), statistics.fmean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     *mean))
    print(f"\n### Held-out accuracy against real-image fidelity at init ({args.images} CIFAR-10 test images)\n")
    print("| run folder | init | seeds | held-out acc % | mass L1 | hit L1 | mass mean | hit mean |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, spec, n, acc, std, m1, h1, mm, hm in sorted(rows, key=lambda r: -r[3]):
        print(f"| {label} | {spec} | {n} | {100 * acc:.2f} ± {100 * std:.2f} "
              f"| {m1:.3f} | {h1:.3f} | {mm:.3f} | {hm:.3f} |")
    plot(rows, args.figure or args.runs[0] / "fidelity_accuracy.png")


def plot(rows, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, (col, name) in zip(axes, [(8, "argmax hit on target, mean over layers"),
                                       (7, "attention mass on target, mean over layers")]):
        for row in rows:
            ax.errorbar(row[col], 100 * row[3], yerr=100 * row[4], fmt="o", capsize=3,
                        label=f"{row[1]} ({row[2]} seed{'s' if row[2] > 1 else ''})")
        ax.set_xlabel(f"{name} (real images, at init)")
        ax.set_xlim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy % (mean ± std over seeds)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Does keeping the structure pay? (cpu-cifar, CIFAR-10 5k images)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nfigure: {path}")


if __name__ == "__main__":
    main()
