"""Compare initialisations: the same recipe trained with several inits and seeds.

Runs go one after another into ``out_dir/<init label>/seed<k>``; a finished run is not
redone and a half-finished one resumes from its checkpoint, so an interrupted comparison
continues where it stopped. The summary is a mean ± std table, an accuracy-vs-epoch plot
(PNG), a JSON file and a self-contained HTML page (``report.html``, :mod:`structinit.harness.report.page`).

Each run folder is locked while it trains (:func:`~structinit.harness.run.folder.lock_run`). A
comparison that reaches a run another process is training stops there with
:class:`~structinit.harness.errors.RunLockedError` (the runs it finished are kept, and the next
call reuses them); with ``wait=True`` it waits for that run and reuses its result. It never
skips a run: a summary always covers every spec and seed, and two comparisons on one folder
never train the same run twice.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from structinit.analysis.curves import curves_figure
from structinit.harness.config import RunConfig, check_config
from structinit.harness.errors import input_parameter, user_input
from structinit.harness.report import page as report_page
from structinit.harness.run.checkpoint import atomic_write_bytes, write_json, write_png
from structinit.harness.run.device import placement
from structinit.harness.run.folder import check_out_dir, run_in
from structinit.harness.run.lifecycle import check_run, construct_and_plan
from structinit.harness.specs import check_init_specs, parse_init_spec, parse_seeds, spec_label
from structinit.harness.summary import format_summary, summarise
from structinit.harness.tasks import check_run_config, make_task, train
from structinit.utils.optional_imports import require

__all__ = ["check_specs", "compare", "plot_curves", "run_config"]


def run_config(base: RunConfig, spec: str, name: str, options: dict[str, Any], seed: int, out: Path) -> RunConfig:
    """The configuration of one run of the comparison (also the one its spec is checked with)."""
    return dataclasses.replace(base, init=name, init_options={**base.init_options, **options}, seed=seed,
                               init_seed=None, out_dir=str(out / spec_label(spec) / f"seed{seed}"))


def check_specs(base: RunConfig, inits: list[str], seeds: list[int],
                out_dir: str | Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Parse every init spec and plan its init on the model its first run will build, writing
    nothing: a misspelt option or a bad value fails here, with a ``ValueError`` that names the
    spec and the option, before any run starts. Returns ``{spec: (scheme, options)}``."""
    with user_input("seeds"):
        if not seeds:
            raise ValueError("seeds is empty; expected at least one seed")
    with user_input("init"):
        parsed = {spec: parse_init_spec(spec) for spec in inits}
    for spec, (name, options) in parsed.items():  # cheap checks first: a misspelt scheme fails without loading data
        check_config(run_config(base, spec, name, options, seeds[0], Path(out_dir)))
    sizes = make_task(base).model_sizes()  # what the data decides: image shape and classes, or vocabulary
    for spec, (name, options) in parsed.items():
        try:
            construct_and_plan(run_config(base, spec, name, options, seeds[0], Path(out_dir)), sizes)
        except (TypeError, ValueError) as err:
            if input_parameter(err) != "init":  # the model, not this spec: the same for every spec
                raise
            with user_input("init"):
                raise ValueError(f"init spec {spec!r}: {err}") from err
    return parsed


def compare(base: RunConfig, inits: list[str] | str, seeds: list[int] | int | str, out_dir: str | Path,
            progress: bool = True, wait: bool = False) -> dict[str, Any]:
    """Train ``base`` once per (init spec, seed), then summarise. Returns the summary dict.

    ``inits`` is a list of init specs or a string of them as ``--inits`` takes it
    (:func:`~structinit.harness.specs.check_init_specs`); ``seeds`` a count or a list of seeds
    (:func:`~structinit.harness.specs.parse_seeds`). The same init or seed given twice is refused:
    it would be one run counted twice.

    ``out_dir`` and the settings are checked before anything is loaded, and every spec is
    checked completely (:func:`check_specs`) before the first run, so a bad one fails at once,
    not after hours of the others. A run another process is training raises RunLockedError,
    or with ``wait=True`` is waited for (see the module docstring)."""
    check_run_config("base", base)
    out = Path(out_dir)
    with user_input("out_dir"):
        check_out_dir(out)
        if why := run_in(out):  # a comparison over a run's files would read them as neither
            raise ValueError(f"out_dir={out} is a run's folder ({why}); a comparison written there would be "
                             "mixed with it; choose another out_dir (--out)")
    inits, seeds = check_init_specs(inits), parse_seeds(seeds)
    # the settings checked on a run folder of this comparison (its root is no run's folder)
    check_run(make_task(dataclasses.replace(base, out_dir=str(out / "_" / f"seed{base.seed}"))), placement())
    parsed = check_specs(base, inits, seeds, out)
    runs: dict[str, list[dict]] = {spec: [] for spec in inits}
    plan = [(seed, spec) for seed in seeds for spec in inits]  # seed-major: the first seed's table comes first
    cfgs = [run_config(base, spec, *parsed[spec], seed, out) for seed, spec in plan]
    finished = [Path(cfg.out_dir, "result.json").exists() for cfg in cfgs]
    print(f"== {len(plan)} runs ({len(inits)} inits × {len(seeds)} seeds), {sum(finished)} already finished",
          flush=True)
    trained: list[float] = []  # seconds of each run trained in this call, for the estimate of the rest
    for k, ((seed, spec), cfg) in enumerate(zip(plan, cfgs)):
        print(f"== {spec} seed {seed} → {cfg.out_dir}", flush=True)
        start = time.perf_counter()
        runs[spec].append(train(cfg, resume=True, progress=progress, wait=wait))
        if not finished[k]:
            trained.append(time.perf_counter() - start)
            left = sum(not f for f in finished[k + 1:])
            if left:  # how long the runs still to train will take at the pace of those just trained
                total, each = left * sum(trained) / len(trained) / 60, sum(trained) / len(trained) / 60
                print(f"== {left} run{'s' if left > 1 else ''} left, about {total:.0f} minutes at the pace of the "
                      f"{len(trained)} just trained ({each:.1f} minutes a run)", flush=True)
    summary = summarise(runs)
    write_json(out / "summary.json", summary)
    atomic_write_bytes(out / "summary.md", lambda f: f.write(format_summary(summary).encode()))
    plot_curves(runs, out / "accuracy.png")
    try:
        report_page.write_report(out)
    except Exception as err:  # a page to read the results by: failing to draw it must not fail the comparison
        first = (str(err).strip().splitlines() or ["no message"])[0]
        print(f"warning: {out / report_page.REPORT} not written ({type(err).__name__}: {first})", file=sys.stderr,
              flush=True)
    return summary


def plot_curves(runs: dict[str, list[dict]], path: Path) -> None:
    """Held-out (or test) accuracy and loss per epoch for every init, the mean over seeds with a
    ±1 std band (:func:`structinit.curves_figure`), written atomically to ``path``."""
    require("matplotlib", "the accuracy plot").use("Agg")  # render to a file; there may be no display

    fig = curves_figure(runs, title="mean over seeds, band ±1 std")
    write_png(path, fig, bbox_inches="tight")
