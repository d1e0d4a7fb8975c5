"""Where structured init pays: held-out accuracy against training-set size on CIFAR-10, MNIST and
Fashion-MNIST, the ``cpu-cifar`` ViT with every init at its defaults (the protocol:
docs/results/data-size.md). Every run takes the same ``--steps`` AdamW steps of 125 images, so
the size is the only variable. Runs go seed-major through ``compare`` into
``--out``/<dataset>-<size> (rerun the same command to continue); the report is ``data_size.md``
and ``data_size.json`` there, and three figures in ``--figures``.

    OMP_NUM_THREADS=2 .venv/bin/python bench/data_size.py --data-dir ../shared/datasets
    .venv/bin/python bench/data_size.py --report-only        # table and figures from finished runs
    .venv/bin/python bench/data_size.py --from docs/results/data/data-size.json   # the tables, from a clone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import DATA_DIR, core_hours, markdown, pyplot

from structinit.analysis.curves import mean_std_curve
from structinit.harness.compare import compare
from structinit.harness.recipes import recipe
from structinit.harness.run.checkpoint import atomic_write_bytes, write_png
from structinit.harness.specs import parse_seeds
from structinit.harness.summary import final_accuracy, format_stat, paired_gains, seed_accuracies, seed_gains

INITS = ("pytorch", "timm", "mimetic", "impulse")
BATCH = 125
WARMUP = 0.1  # of the budget
GAIN_FLOOR = -8.0  # points: the gain figure's axis stops here; an init below it is named in the panel


@dataclass(frozen=True)
class Study:
    """One dataset of the study: its sizes and the settings that differ from the base recipe."""

    name: str
    sizes: tuple[int, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    recipe: str = "cpu-cifar"


STUDIES = {
    "cifar10": Study("CIFAR-10", (1000, 2000, 5000, 10000), {"dataset": "cifar10", "augment": "crop4,flip"}),
    "mnist": Study("MNIST", (500, 1000, 2000, 5000), {"dataset": "mnist", "augment": "crop4"}),
    "fashion_mnist": Study("Fashion-MNIST", (500, 1000, 2000, 5000),
                           {"dataset": "fashion_mnist", "augment": "crop4,flip", "data_dir": None}),
}


def run_config(study: Study, size: int, steps: int, data_dir: str | None, batch: int = BATCH):
    """The config of every run at ``size``: ``steps`` steps of ``batch`` images, exactly."""
    per_epoch, rest = divmod(size, batch)
    if rest or steps % per_epoch:
        raise ValueError(f"size {size} with batch {batch} makes {size / batch:g} batches an epoch, and {steps} "
                         "steps are not whole epochs of it; choose sizes and steps that divide")
    overrides = {"data_dir": data_dir, **study.overrides, "train_size": size, "batch_size": batch,
                 "epochs": steps // per_epoch, "warmup_epochs": WARMUP * steps / per_epoch,
                 "eval_every": steps // per_epoch, "precision": "fp32"}
    return recipe(study.recipe, **overrides)


def run_study(studies: dict[str, Study], inits, seeds, steps: int, out: Path, data_dir: str | None,
              batch: int = BATCH) -> None:
    """Train every (seed, dataset, size, init), seed-major, reusing finished runs."""
    for seed in seeds:
        for key, study in studies.items():
            for size in study.sizes:
                cfg = run_config(study, size, steps, data_dir, batch)
                print(f"=== seed {seed} · {study.name} · {size} images", flush=True)
                compare(cfg, list(inits), [seed], out / f"{key}-{size}", progress=False)


def collect(studies: dict[str, Study], inits, out: Path, value=final_accuracy) -> dict[str, Any]:
    """{dataset: {size: {init: {seed: value(result)}}}} of every finished run under ``out``.

    ``value`` reads one number from a run's ``result.json``: by default its held-out accuracy.
    """
    table: dict[str, Any] = {}
    for key, study in studies.items():
        for size in study.sizes:
            if (out / f"{key}-{size}").is_dir():
                by_init = seed_accuracies(out / f"{key}-{size}", list(inits), value)
                if by_init:
                    table.setdefault(key, {})[size] = by_init
    return table


def format_table(studies: dict[str, Study], inits, table: dict[str, Any],
                 train_loss: dict[str, Any] | None = None) -> str:
    """Markdown: one row per (dataset, size, init): mean ± std, gain over pytorch, the training
    loss at the last step (mean over seeds; it tells underfitting from overfitting), per seed."""
    train_loss, rows = train_loss or {}, []
    for key, study in studies.items():
        for size in study.sizes:
            by_init = table.get(key, {}).get(size, {})
            for init in inits:
                accs = by_init.get(init, {})
                per_seed = ", ".join(f"s{s}: {100 * a:.2f}" for s, a in sorted(accs.items())) or "not run yet"
                gain = "—" if init == "pytorch" else format_stat(paired_gains(by_init, init))
                losses = list(train_loss.get(key, {}).get(size, {}).get(init, {}).values())
                loss = f"{statistics.fmean(losses):.3f}" if losses else "–"
                rows.append([study.name, f"{size:,}", init, format_stat(list(accs.values())), gain, loss, per_seed])
    return markdown(["dataset", "images", "init", "held-out acc % (mean ± std)", "gain over pytorch (points)",
                     "final train loss", "per seed (%)"], "lrlrrrl", rows) + "\n"


def format_by_size(studies: dict[str, Study], inits, table: dict[str, Any]) -> str:
    """Markdown: one row per (dataset, size), one column per init: held-out accuracy % (mean ± std)."""
    rows = [[study.name, f"{size:,}", *(format_stat(list(table.get(key, {}).get(size, {}).get(init, {}).values()))
                                        for init in inits)] for key, study in studies.items() for size in study.sizes]
    return markdown(["dataset", "images", *inits], "lr" + "r" * len(inits), rows) + "\n"


def format_trends(studies: dict[str, Study], inits, table: dict[str, Any]) -> str:
    """Markdown, one table per dataset: each structured init's gain over ``pytorch`` at every
    size, ``impulse`` against ``mimetic``, and how each moved from the smallest size to the
    largest (mean ± std over seeds, every difference paired by seed)."""
    rows = [(f"{init} − pytorch", init, "pytorch") for init in inits if init != "pytorch"]
    if "impulse" in inits and "mimetic" in inits:
        rows.append(("impulse − mimetic", "impulse", "mimetic"))
    blocks = []
    for key, study in studies.items():
        by_size = table.get(key, {})
        head = " | ".join(f"{size:,}" for size in study.sizes)
        lines = [f"**{study.name}** (points)\n", f"| | {head} | largest − smallest |",
                 "|---|" + "---:|" * (len(study.sizes) + 1)]
        for label, init, base in rows:
            cells = [format_stat(paired_gains(by_size.get(size, {}), init, base)) for size in study.sizes]
            first, last = (seed_gains(by_size.get(size, {}), init, base) for size in (study.sizes[0], study.sizes[-1]))
            change = [last[seed] - first[seed] for seed in sorted(set(first) & set(last))]
            lines.append(f"| {label} | {' | '.join(cells)} | {format_stat(change)} |")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def plot(studies: dict[str, Study], inits, table: dict[str, Any], figures: Path) -> list[Path]:
    """accuracy vs size and gain over pytorch vs size, one panel per dataset (log x). The gain
    axis stops at ``GAIN_FLOOR``; an init whose mean gain falls below it is named, with its
    range, in the panel."""
    def values(key: str, size: int, init: str, gain: bool) -> list[float]:
        by_init = table.get(key, {}).get(size, {})
        return paired_gains(by_init, init) if gain else list(by_init.get(init, {}).values())

    plt = pyplot()
    written = []
    for name, ylabel in (("data_size_accuracy", "held-out accuracy (%)"),
                         ("data_size_gain", "gain over pytorch (points)")):
        fig, axes = plt.subplots(1, len(studies), figsize=(4.2 * len(studies), 3.6), dpi=110, squeeze=False)
        for ax, (key, study) in zip(axes[0], studies.items()):
            off_scale: list[str] = []
            for init in inits:
                if name.endswith("gain") and init == "pytorch":
                    ax.axhline(0.0, color="grey", lw=0.8)
                    continue
                points = {size: v for size in study.sizes if (v := values(key, size, init, name.endswith("gain")))}
                if points:
                    mean = [100 * statistics.fmean(v) for v in points.values()]
                    line, = ax.plot(list(points), mean, marker="o", label=init)
                    ax.fill_between(list(points), [100 * min(v) for v in points.values()],
                                    [100 * max(v) for v in points.values()], color=line.get_color(), alpha=0.15)
                    if name.endswith("gain") and min(mean) < GAIN_FLOOR:
                        off_scale.append(f"{init}: {max(mean):+.1f} to {min(mean):+.1f}")
            if off_scale:  # one init far below would flatten the others' differences into a line
                ax.set_ylim(bottom=GAIN_FLOOR)
                ax.text(0.02, 0.03, "below the axis: " + "; ".join(off_scale), transform=ax.transAxes, fontsize=7)
            ax.set(xscale="log", title=study.name, xlabel="training images", ylabel=ylabel)
            ax.set_xticks(study.sizes, [f"{s:,}" for s in study.sizes])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle("lines: mean over seeds; bands: min–max over seeds"
                     + ("; gain paired by seed" if name.endswith("gain") else ""), fontsize=9)
        fig.tight_layout()
        written.append(write_png(figures / f"{name}.png", fig))
    return written


def plot_loss(studies: dict[str, Study], inits, out: Path, figures: Path) -> Path:
    """Training loss against optimiser step at each dataset's smallest and largest size (rows),
    mean over seeds: it tells an init that underfits (its loss stalls high) from one that overfits
    (low training loss, low held-out accuracy)."""
    plt = pyplot()
    results = collect(studies, inits, out, value=lambda result: result)
    fig, axes = plt.subplots(2, len(studies), figsize=(4.2 * len(studies), 6.4), dpi=110, squeeze=False,
                             sharey=True)
    for col, (key, study) in enumerate(studies.items()):
        for row, size in enumerate((study.sizes[0], study.sizes[-1])):
            ax = axes[row][col]
            for init in inits:
                by_seed = list(results.get(key, {}).get(size, {}).get(init, {}).values())
                if not by_seed:
                    continue
                steps, mean, _ = mean_std_curve(by_seed, "train_loss", "step")  # the steps every seed took
                ax.plot(steps, mean, marker="." if len(steps) < 20 else None, label=f"{init} ({len(by_seed)})")
            ax.set_title(f"{study.name}, {size:,} images", fontsize=9)
            ax.set(xlabel="optimiser step", ylabel="training loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, title="init (seeds)", title_fontsize=7)
    fig.suptitle("training loss (label-smoothed cross-entropy, mean over seeds; one point per epoch)", fontsize=9)
    fig.tight_layout()
    return write_png(figures / "data_size_loss.png", fig)


def report(studies: dict[str, Study], inits, out: Path, figures: Path) -> str:
    """Write data_size.json, data_size.md and the figures from the finished runs; the table,
    with the CPU time the finished runs took under it."""
    table = collect(studies, inits, out)
    train_loss = collect(studies, inits, out, value=lambda result: result["final"]["train_loss"])
    cost = collect(studies, inits, out, value=core_hours)
    hours = [h for by_size in cost.values() for by_init in by_size.values()
             for by_seed in by_init.values() for h in by_seed.values()]
    text = (format_by_size(studies, inits, table) + "\n" + format_table(studies, inits, table, train_loss)
            + f"\n{len(hours)} runs finished; their training took {sum(hours):.1f} CPU core-hours "
              "(each run's wall time × its threads).\n\n" + format_trends(studies, inits, table))
    atomic_write_bytes(out / "data_size.json", lambda f: f.write(json.dumps(table, indent=1).encode()))
    atomic_write_bytes(out / "data_size.md", lambda f: f.write(text.encode()))
    plot(studies, inits, table, figures)
    plot_loss(studies, inits, out, figures)
    return text


def load_report_data(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The accuracy table {dataset: {size: {init: {seed: acc}}}} and the final training loss of a
    study saved as JSON (``docs/results/data/data-size.json``: ``accuracy`` per seed, and
    ``train_loss_mean``, the mean over seeds that the report prints)."""
    doc = json.loads(path.read_text())
    table = {key: {int(size): {init: {int(seed): acc for seed, acc in seeds.items()} for init, seeds in by_init.items()}
                   for size, by_init in by_size.items()} for key, by_size in doc["accuracy"].items()}
    loss = {key: {int(size): {init: {"mean": value} for init, value in by_init.items()}
                  for size, by_init in by_size.items()} for key, by_size in doc.get("train_loss_mean", {}).items()}
    return table, loss


def report_from(studies: dict[str, Study], inits, path: Path) -> str:
    """The report's tables (not its cost line or figures, which need the runs) from a study saved
    as JSON (:func:`load_report_data`)."""
    table, train_loss = load_report_data(path)
    return (format_by_size(studies, inits, table) + "\n" + format_table(studies, inits, table, train_loss) + "\n"
            + format_trends(studies, inits, table))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=DATA_DIR, help="where CIFAR-10 and MNIST are")
    ap.add_argument("--datasets", default=",".join(STUDIES), help=f"any of {', '.join(STUDIES)}")
    ap.add_argument("--inits", default=",".join(INITS), help="init specs, comma-separated")
    ap.add_argument("--seeds", default="3", help="a count (3 → seeds 0,1,2) or a list (0,4,7)")
    ap.add_argument("--steps", type=int, default=400, help="optimiser steps of every run (default 400)")
    ap.add_argument("--out", default="runs/data-size", help="where the runs go (resumable)")
    ap.add_argument("--figures", default="docs/figures", help="where the three figures go")
    ap.add_argument("--report-only", action="store_true", help="no training: table and figures of finished runs")
    ap.add_argument("--from", dest="from_json", type=Path, default=None,
                    help="no training, no runs: the tables from a saved study, e.g. docs/results/data/data-size.json")
    args = ap.parse_args()
    unknown = set(args.datasets.split(",")) - set(STUDIES)
    if unknown:
        sys.exit(f"error: --datasets: unknown {', '.join(sorted(unknown))}; choose from {', '.join(STUDIES)}")
    studies = {k: STUDIES[k] for k in args.datasets.split(",")}
    inits, out = args.inits.split(","), Path(args.out)
    if args.from_json is not None:
        if not args.from_json.is_file():
            sys.exit(f"error: --from {args.from_json}: no such file; the study's data is "
                     "docs/results/data/data-size.json")
        print(report_from(studies, inits, args.from_json))
        return
    if not args.report_only:
        try:
            seeds = parse_seeds(args.seeds)
        except ValueError as err:
            sys.exit(f"error: {err}")
        run_study(studies, inits, seeds, args.steps, out, args.data_dir)
    print(report(studies, inits, out, Path(args.figures)))


if __name__ == "__main__":
    main()
