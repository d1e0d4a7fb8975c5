"""Structured init across architectures: the ``cpu-cifar`` comparison of each model side by side
(docs/results/architectures.md). Trains nothing: it reads each architecture's ``structinit
compare`` folder (or its ``summary.json``) and prints held-out accuracy, each init's gain paired
by seed (over ``pytorch`` and ``timm``, and impulse against mimetic) and the cost; ``--figure``
draws the gains. ``NAME=A+B`` reads each init from the first of the folders that has it.

    structinit compare --recipe cpu-cifar --precision fp32 --data-dir ../shared/datasets \\
        --model swin_cpu_patch2_32 --out runs/cpu-cifar-swin          # one per architecture
    .venv/bin/python bench/architectures.py --runs swin=runs/cpu-cifar-swin --runs mixer=runs/cpu-cifar-mixer
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common import core_hours, markdown, pyplot

from structinit.harness.run.checkpoint import write_png
from structinit.harness.summary import format_stat, paired_gains, seed_accuracies, seed_gains

INITS = ("mimetic", "impulse", "pytorch", "timm")


def read_summary(path: Path, inits=INITS) -> dict[str, dict[int, float]]:
    """{init: {seed: accuracy}} from a comparison's ``summary.json``."""
    try:
        summary = json.loads(path.read_text())
        return {init: dict(zip(summary[init]["seeds"], summary[init]["accs"], strict=True))
                for init in inits if init in summary}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a comparison's summary.json (expected per init 'accs' and 'seeds' "
                         f"lists of one length): {type(err).__name__}: {err}") from err


def collect(folders: dict[str, tuple[Path, ...]], inits=INITS) -> dict[str, dict[str, dict[int, float]]]:
    """{architecture: {init: {seed: held-out accuracy}}} of the finished runs in each column's
    folders (or ``summary.json`` files); an init is read from the first of them that has it."""
    table = {}
    for arch, paths in folders.items():
        merged: dict[str, dict[int, float]] = {}
        for path in paths:
            by_init = read_summary(path, inits) if path.is_file() else seed_accuracies(path, list(inits))
            for init, accs in by_init.items():
                merged.setdefault(init, accs)
        table[arch] = {init: merged[init] for init in inits if init in merged}
    return table


def format_accuracy(table: dict[str, dict[str, dict[int, float]]], inits=INITS) -> str:
    """Markdown: a row per init, a column per architecture: mean ± std (per seed)."""
    def cell(accs: dict[int, float]) -> str:
        per_seed = ", ".join(f"{100 * a:.2f}" for _, a in sorted(accs.items()))
        return f"{format_stat(list(accs.values()))} ({per_seed})" if accs else "not run"

    rows = [[init, *(cell(table[arch].get(init, {})) for arch in table)] for init in inits]
    return markdown(["init", *(f"{a}: acc % (per seed)" for a in table)], "l" + "r" * len(table), rows) + "\n"


BASES = ("pytorch", "timm")


def gain_rows(inits=INITS) -> list[tuple[str, str]]:
    """(init, base) pairs of the gain table: every other init against each baseline of ``BASES``
    that ran, then impulse against mimetic. Both baselines, because a structured init leaves the
    rest of the model as built, and models are built differently (docs/results/architectures.md)."""
    bases = [b for b in BASES if b in inits]
    rows = [(init, base) for base in bases for init in inits if init not in bases]
    rows += [(other, base) for i, base in enumerate(bases) for other in bases[i + 1:]]
    return rows + ([("impulse", "mimetic")] if {"impulse", "mimetic"} <= set(inits) else [])


def format_gains(table: dict[str, dict[str, dict[int, float]]], inits=INITS) -> str:
    """Markdown: a row per (init − base), a column per architecture: mean ± std of the per-seed
    differences (points), then the differences seed by seed."""
    def cell(by_init: dict[str, dict[int, float]], init: str, base: str) -> str:
        by_seed = seed_gains(by_init, init, base)
        detail = ", ".join(f"{100 * g:+.2f}" for g in by_seed.values())
        return f"{format_stat(paired_gains(by_init, init, base))} ({detail})" if by_seed else "–"

    rows = [[f"{init} − {base}", *(cell(table[arch], init, base) for arch in table)] for init, base in gain_rows(inits)]
    return markdown(["points, paired by seed", *table], "l" + "r" * len(table), rows) + "\n"


def plot_gains(table: dict[str, dict[str, dict[int, float]]], path: Path, inits=INITS) -> Path:
    """A bar per (architecture, structured init): the mean gain over ``pytorch`` in points,
    paired by seed, with each seed's gain as a dot. Written atomically as a PNG."""
    plt = pyplot()
    others = [init for init in inits if init != "pytorch"]
    width = 0.8 / max(len(others), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(table), 3.6), dpi=110)
    for i, init in enumerate(others):
        xs = [a + (i - (len(others) - 1) / 2) * width for a in range(len(table))]
        by_arch = [[100 * g for g in paired_gains(table[arch], init)] for arch in table]
        if not any(by_arch):
            continue
        ax.bar([x for x, g in zip(xs, by_arch) if g], [statistics.fmean(g) for g in by_arch if g],
                      width=width * 0.9, label=init, alpha=0.75)
        for x, g in zip(xs, by_arch):
            ax.plot([x] * len(g), g, "o", ms=3, color="black", alpha=0.6, zorder=3)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(table)), list(table))
    ax.set_ylabel("gain over pytorch (points)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("cpu-cifar: bars = mean over seeds, dots = each seed (paired by seed)", fontsize=9)
    fig.tight_layout()
    return write_png(path, fig)


def run_cost(folders: tuple[Path, ...], inits=INITS, counted: set[Path] | None = None) -> dict[str, Any]:
    """The model, the number of finished runs, their mean minutes and total CPU core-hours, each
    init's runs taken from the first folder that has them (as :func:`collect` reads them).

    ``counted``: runs already costed in another column, left out here and added to as this
    column's runs are counted, so that a run a joined column borrows is paid for once."""
    results, done = [], set()
    counted = set() if counted is None else counted
    for folder in (f for f in folders if f.is_dir()):
        for init in inits:
            found = sorted((folder / init).glob("seed*/result.json"))
            if init not in done and found:
                done.add(init)
                fresh = [p for p in found if p.resolve() not in counted]
                counted.update(p.resolve() for p in fresh)
                results += [json.loads(p.read_text()) for p in fresh]
    if not results:
        return {"model": "–", "model_kwargs": {}, "runs": 0, "minutes": float("nan"), "core_hours": 0.0}
    config = results[0]["config"]
    return {"model": config["model"], "model_kwargs": config["model_kwargs"], "runs": len(results),
            "minutes": statistics.fmean(r["wall_s"] for r in results) / 60,
            "core_hours": sum(map(core_hours, results))}


def format_cost(folders: dict[str, tuple[Path, ...]], inits=INITS) -> str:
    """Markdown: per architecture, the model and its parameters, runs, minutes per run, core-hours.
    Each run is costed once, in the first column that reads it: a column joined from folders
    (``NAME=A+B``) counts only the runs no earlier column counted."""
    from structinit.models import create_model

    rows, counted = [], set()
    for arch, paths in folders.items():
        if all(p.is_file() for p in paths):  # summary.json: no per-run record of the model or the threads
            continue
        cost = run_cost(paths, inits, counted)
        params = "–"
        if cost["runs"]:
            model = create_model(cost["model"], num_classes=10, **cost["model_kwargs"])  # cpu-cifar: CIFAR-10
            params = f"{sum(p.numel() for p in model.parameters()):,}"
        rows.append([arch, f"`{cost['model']}`", params, cost["runs"], f"{cost['minutes']:.1f}",
                     f"{cost['core_hours']:.2f}"])
    return markdown(["architecture", "model", "parameters", "runs", "minutes per run", "CPU core-hours"], "llrrrr",
                    rows) + "\n"


def parse_runs(specs: list[str]) -> dict[str, tuple[Path, ...]]:
    """``["swin=runs/x", "s2=runs/y+runs/x"]`` → ``{"swin": (Path("runs/x"),), "s2": (…, …)}``,
    each checked to be a folder or a ``.json`` file."""
    folders: dict[str, tuple[Path, ...]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"--runs {spec!r}: expected NAME=FOLDER, e.g. swin=runs/cpu-cifar-swin")
        paths = tuple(Path(folder) for folder in rest.split("+"))
        for path in paths:
            if path.suffix == ".json" and not path.is_file():
                raise FileNotFoundError(f"--runs {spec!r}: no file {path}; expected a comparison's summary.json")
            if path.suffix != ".json" and not path.is_dir():
                raise FileNotFoundError(f"--runs {spec!r}: {path} is not a folder; train it first with "
                                        f"structinit compare --recipe cpu-cifar --model MODEL --out {path}")
        folders[name] = paths
    return folders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", action="append", required=True, metavar="NAME=FOLDER[+FOLDER]",
                    help="an architecture's comparison folder (or summary.json); repeat for each. With "
                         "several joined by +, each init comes from the first that has it")
    ap.add_argument("--inits", default=",".join(INITS))
    ap.add_argument("--figure", type=Path, default=None,
                    help="also draw the gains as a bar chart here, e.g. docs/figures/architectures_gain.png")
    args = ap.parse_args()
    try:
        folders = parse_runs(args.runs)
        inits = tuple(args.inits.split(","))
        table = collect(folders, inits)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print("### Held-out accuracy, CIFAR-10, 5,000 training images\n")
    print(format_accuracy(table, inits))
    print("### Gain over pytorch and impulse − mimetic\n")
    print(format_gains(table, inits))
    print("### Cost\n")
    print(format_cost(folders, inits))
    if args.figure:
        print(f"figure: {plot_gains(table, args.figure, inits)}")


if __name__ == "__main__":
    main()
