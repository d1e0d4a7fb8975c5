"""Compare initialisations: the same recipe trained with several inits and seeds.

Runs go one after another into ``out_dir/<init label>/seed<k>``; a finished run is not
redone and a half-finished one resumes from its checkpoint, so an interrupted comparison
continues where it stopped. The summary is a mean ± std table, an accuracy-vs-epoch plot
(PNG), a JSON file and a self-contained HTML page (``report.html``, :mod:`structinit.harness.report`).

Each run folder is locked while it trains (:func:`~structinit.harness.runfolder.lock_run`). A
comparison that reaches a run another process is training stops there with
:class:`~structinit.harness.errors.RunLockedError` (the runs it finished are kept, and the next
call reuses them); with ``wait=True`` it waits for that run and reuses its result. It never
skips a run: a summary always covers every spec and seed, and two comparisons on one folder
never train the same run twice.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

from structinit.harness.build import check_data, load_train_split, plan_model
from structinit.harness.checkpoint import atomic_write_bytes, write_json
from structinit.harness.errors import input_parameter, user_input
from structinit.harness.runfolder import check_out_dir
from structinit.harness.specs import parse_init_spec, split_init_specs
from structinit.harness.train import TrainConfig, train
from structinit.schemes.registry import get_scheme
from structinit.utils.optional_imports import require

__all__ = ["check_specs", "compare", "format_summary", "parse_init_spec", "plot_curves", "primary_metric",
           "spec_label", "split_init_specs", "summarise"]


def primary_metric(final: dict[str, float]) -> str:
    """The metric a run is judged on: held-out accuracy if there is one, else test accuracy."""
    for key in ("holdout_acc", "test_acc"):
        if key in final:
            return key
    raise ValueError(f"no evaluation accuracy in {sorted(final)}")


def spec_label(spec: str) -> str:
    """The folder an init spec's runs go in: ``impulse:pe_scale=2`` → ``impulse_pe_scale-2``."""
    return spec.replace(":", "_").replace(",", "_").replace("=", "-")


def _run_config(base: TrainConfig, spec: str, name: str, options: dict[str, Any], seed: int,
                out: Path) -> TrainConfig:
    """The configuration of one run of the comparison (also the one its spec is checked with)."""
    return dataclasses.replace(base, init=name, init_options={**base.init_options, **options}, seed=seed,
                               init_seed=None, out_dir=str(out / spec_label(spec) / f"seed{seed}"))


def check_specs(base: TrainConfig, inits: list[str], seeds: list[int],
                out_dir: str | Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Parse every init spec and plan its init on the model its first run will build, writing
    nothing: a misspelt option or a bad value fails here, with a ``ValueError`` that names the
    spec and the option, before any run starts. Returns ``{spec: (scheme, options)}``."""
    with user_input("seeds"):
        if not seeds:
            raise ValueError("seeds is empty; expected at least one seed")
    with user_input("init"):
        parsed = {spec: parse_init_spec(spec) for spec in inits}
        for name, _ in parsed.values():  # cheap checks first: a misspelt scheme fails without loading data
            get_scheme(name)
    train_ds = load_train_split(base)  # the model's size depends on the images' shape and the class count
    for spec, (name, options) in parsed.items():
        cfg = _run_config(base, spec, name, options, seeds[0], Path(out_dir))
        try:
            plan_model(cfg, train_ds.image_shape, train_ds.num_classes)
        except (TypeError, ValueError) as err:
            if input_parameter(err) != "init":  # the model, not this spec: the same for every spec
                raise
            with user_input("init"):
                raise ValueError(f"init spec {spec!r}: {err}") from err
    return parsed


def compare(base: TrainConfig, inits: list[str], seeds: list[int], out_dir: str | Path,
            progress: bool = True, wait: bool = False) -> dict[str, Any]:
    """Train ``base`` once per (init spec, seed), then summarise. Returns the summary dict.

    ``out_dir`` and the data are checked before anything is loaded, and every spec is checked
    completely (:func:`check_specs`) before the first run, so a bad one fails at once, not
    after hours of the others. A run another process is training raises RunLockedError, or
    with ``wait=True`` is waited for (see the module docstring)."""
    out = Path(out_dir)
    with user_input("out_dir"):
        check_out_dir(out)
    check_data(base)
    parsed = check_specs(base, inits, seeds, out)
    runs: dict[str, list[dict]] = {spec: [] for spec in inits}
    for seed in seeds:  # seed-major: a complete table for the first seed comes first
        for spec in inits:
            name, options = parsed[spec]
            cfg = _run_config(base, spec, name, options, seed, out)
            print(f"== {spec} seed {seed} → {cfg.out_dir}", flush=True)
            runs[spec].append(train(cfg, resume=True, progress=progress, wait=wait))
    summary = summarise(runs)
    write_json(out / "summary.json", summary)
    atomic_write_bytes(out / "summary.md", lambda f: f.write(format_summary(summary).encode()))
    plot_curves(runs, out / "accuracy.png")
    _write_report(out)
    return summary


def _write_report(out: Path) -> None:
    """``out/report.html``; the comparison succeeds without it, with a one-line warning."""
    from structinit.harness.report import REPORT, write_report

    try:
        write_report(out)
    except Exception as err:  # a page to read the results by: failing to draw it must not fail the comparison
        lines = str(err).strip().splitlines()
        print(f"warning: {out / REPORT} not written ({type(err).__name__}: {lines[0] if lines else 'no message'})",
              file=sys.stderr, flush=True)


def summarise(runs: dict[str, list[dict]]) -> dict[str, Any]:
    table = {}
    for spec, results in runs.items():
        metric = primary_metric(results[0]["final"])
        accs = [r["final"][metric] for r in results]
        table[spec] = {"metric": metric, "accs": accs, "mean": statistics.fmean(accs),
                       "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                       "seeds": [r["seed"] for r in results], "wall_s": [r["wall_s"] for r in results]}
    return table


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["| init | metric | accuracy % (mean ± std) | per seed | minutes per run |", "|---|---|---:|---|---:|"]
    for spec, s in summary.items():
        per_seed = ", ".join(f"{100 * a:.2f}" for a in s["accs"])
        minutes = statistics.fmean(s["wall_s"]) / 60
        lines.append(f"| {spec} | {s['metric']} | {100 * s['mean']:.2f} ± {100 * s['std']:.2f} | {per_seed} | "
                     f"{minutes:.1f} |")
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict[str, list[dict]], path: Path) -> None:
    """Held-out (or test) accuracy and loss per epoch for every init, the mean over seeds with a
    ±1 std band (:func:`structinit.curves_figure`), written atomically to ``path``."""
    require("matplotlib", "the accuracy plot").use("Agg")  # render to a file; there may be no display
    plt = require("matplotlib.pyplot", "the accuracy plot")
    from structinit.analysis.curves import curves_figure

    fig = curves_figure(runs, title="mean over seeds, band ±1 std")
    atomic_write_bytes(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"))
    plt.close(fig)
