"""Training curves of a comparison: held-out accuracy and loss against epoch, one line per
init, the mean over seeds with a ±1 std band. Drawn from the ``history`` the harness stores
in each run's ``result.json``."""

from __future__ import annotations

import statistics
from pathlib import Path

from structinit.analysis.figures import save_figure
from structinit.utils.optional_imports import require

# (key prefix in the history, axis label, percent?)
PANELS = (("acc", "held-out accuracy (%)", True), ("loss", "held-out loss", False))


def eval_metric(history: list[dict], kind: str) -> str | None:
    """The evaluation key for ``kind`` ('acc' or 'loss') the history holds: the held-out split
    when there is one, else the test split; None if neither was evaluated."""
    keys = {k for row in history for k in row}
    return next((f"{split}_{kind}" for split in ("holdout", "test") if f"{split}_{kind}" in keys), None)


def x_key(history: list[dict]) -> str:
    """The axis a history is drawn against: 'epoch' for image runs, 'step' for sequence-task
    runs (whose rows have no epoch)."""
    return "epoch" if all("epoch" in row for row in history) else "step"


def seed_curves(results: list[dict], key: str, x: str = "epoch") -> tuple[list[int], list[list[float]]]:
    """(x values, one list of ``key`` per seed) over the seeds' histories, on the ``x`` values
    (epochs, or steps) every seed evaluated."""
    series = [{row[x]: row[key] for row in r["history"] if key in row} for r in results]
    xs = sorted(set.intersection(*(set(s) for s in series))) if series else []
    return xs, [[s[e] for e in xs] for s in series]


def mean_std_curve(results: list[dict], key: str, x: str = "epoch") -> tuple[list[int], list[float], list[float]]:
    """(x values, mean, std) of ``key`` over the seeds' histories, on the ``x`` values (epochs,
    or steps) every seed evaluated (std 0 with one seed)."""
    xs, curves = seed_curves(results, key, x)
    at = list(zip(*curves))
    mean = [statistics.fmean(v) for v in at]
    std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in at]
    return xs, mean, std


def curves_figure(runs: dict[str, list[dict]], *, title: str = "", path: str | Path | None = None):
    """Accuracy and loss against epoch for every init (``runs``: label → the seeds' result
    dicts, as :func:`structinit.compare` returns and writes them). Lines are the mean over
    seeds, bands ±1 std; the legend gives the number of seeds. Returns the Figure."""
    if not runs or not all(runs.values()):
        raise ValueError("runs is empty: give at least one init label → a non-empty list of run results")
    require("matplotlib", "training curves").use("Agg")
    plt = require("matplotlib.pyplot", "training curves")
    ticker = require("matplotlib.ticker", "training curves")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for ax, (kind, label, percent) in zip(axes, PANELS):
        scale = 100.0 if percent else 1.0
        for init, results in runs.items():
            key = eval_metric(results[0]["history"], kind)
            if key is None:
                continue
            epochs, mean, std = mean_std_curve(results, key, x_key(results[0]["history"]))
            line, = ax.plot(epochs, [scale * m for m in mean], marker="o", markersize=3,
                            label=f"{init} (n={len(results)})")
            if len(results) > 1:
                ax.fill_between(epochs, [scale * (m - s) for m, s in zip(mean, std)],
                                [scale * (m + s) for m, s in zip(mean, std)], color=line.get_color(), alpha=0.2)
        ax.set_xlabel(x_key(next(iter(runs.values()))[0]["history"]))
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # epochs and steps are whole: no 1.2, 1.4
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title or "mean over seeds, band ±1 std", fontsize=9)
    fig.tight_layout()
    # Below both panels, not inside one: with many inits an in-axes legend hides the curves.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(3, len(labels)) or 1,
               fontsize=8, frameon=False)
    return save_figure(fig, path)
