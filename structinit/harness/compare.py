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
from typing import TYPE_CHECKING, Any

from structinit.harness.build import check_data, load_train_split, plan_model
from structinit.harness.checkpoint import atomic_write_bytes, write_json
from structinit.harness.errors import input_parameter, user_input
from structinit.harness.runfolder import check_out_dir
from structinit.harness.specs import parse_init_spec, split_init_specs
from structinit.harness.train import TrainConfig, train
from structinit.schemes.registry import get_scheme
from structinit.utils.optional_imports import require

if TYPE_CHECKING:
    from structinit.harness.train_sequence import SequenceConfig

__all__ = ["check_specs", "compare", "format_summary", "parse_init_spec", "plot_curves", "primary_metric",
           "spec_label", "split_init_specs", "summarise"]


def primary_metric(final: dict[str, float]) -> str:
    """The metric a run is judged on: held-out accuracy if there is one, else test accuracy."""
    for key in ("holdout_acc", "test_acc"):
        if key in final:
            return key
    raise ValueError(f"no evaluation accuracy in {sorted(final)}")


def spec_label(spec: str) -> str:
    """The folder an init spec's runs go in: ``impulse:pe_scale=2`` → ``impulse_pe_scale-2``;
    a path in an option (``covariance_transfer:source=runs/a/model.safetensors``) stays one
    folder name (``/`` → ``+``)."""
    return spec.replace(":", "_").replace(",", "_").replace("=", "-").replace("/", "+").replace("\\", "+")


def _run_config(base: TrainConfig | SequenceConfig, spec: str, name: str, options: dict[str, Any], seed: int,
                out: Path) -> TrainConfig:
    """The configuration of one run of the comparison (also the one its spec is checked with)."""
    return dataclasses.replace(base, init=name, init_options={**base.init_options, **options}, seed=seed,
                               init_seed=None, out_dir=str(out / spec_label(spec) / f"seed{seed}"))


def check_specs(base: TrainConfig | SequenceConfig, inits: list[str], seeds: list[int],
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
    if _is_sequence(base):  # the model's size depends on the task's vocabulary and length
        from structinit.harness.train_sequence import make_task, plan_sequence_model

        task = make_task(base)
        plan = lambda cfg: plan_sequence_model(cfg, task)
    else:  # … or on the images' shape and the class count
        train_ds = load_train_split(base)
        plan = lambda cfg: plan_model(cfg, train_ds.image_shape, train_ds.num_classes)
    for spec, (name, options) in parsed.items():
        cfg = _run_config(base, spec, name, options, seeds[0], Path(out_dir))
        try:
            plan(cfg)
        except (TypeError, ValueError) as err:
            if input_parameter(err) != "init":  # the model, not this spec: the same for every spec
                raise
            with user_input("init"):
                raise ValueError(f"init spec {spec!r}: {err}") from err
    return parsed


def compare(base: TrainConfig | SequenceConfig, inits: list[str], seeds: list[int], out_dir: str | Path,
            progress: bool = True, wait: bool = False) -> dict[str, Any]:
    """Train ``base`` once per (init spec, seed), then summarise. Returns the summary dict.

    ``out_dir`` and the data are checked before anything is loaded, and every spec is checked
    completely (:func:`check_specs`) before the first run, so a bad one fails at once, not
    after hours of the others. A run another process is training raises RunLockedError, or
    with ``wait=True`` is waited for (see the module docstring)."""
    out = Path(out_dir)
    with user_input("out_dir"):
        check_out_dir(out)
    if _is_sequence(base):
        from structinit.harness.train_sequence import train_sequence as run
    else:
        check_data(base)
        run = train
    parsed = check_specs(base, inits, seeds, out)
    runs: dict[str, list[dict]] = {spec: [] for spec in inits}
    for seed in seeds:  # seed-major: a complete table for the first seed comes first
        for spec in inits:
            name, options = parsed[spec]
            cfg = _run_config(base, spec, name, options, seed, out)
            print(f"== {spec} seed {seed} → {cfg.out_dir}", flush=True)
            runs[spec].append(run(cfg, resume=True, progress=progress, wait=wait))
    summary = summarise(runs)
    write_json(out / "summary.json", summary)
    atomic_write_bytes(out / "summary.md", lambda f: f.write(format_summary(summary).encode()))
    plot_curves(runs, out / "accuracy.png")
    _write_report(out)
    return summary


def _is_sequence(base) -> bool:
    """Whether ``base`` configures a sequence-task comparison (a
    :class:`~structinit.harness.train_sequence.SequenceConfig`) rather than an image one."""
    from structinit.harness.train_sequence import SequenceConfig

    return isinstance(base, SequenceConfig)


def _write_report(out: Path) -> None:
    """``out/report.html``; the comparison succeeds without it, with a one-line warning."""
    from structinit.harness.report import REPORT, write_report

    try:
        write_report(out)
    except Exception as err:  # a page to read the results by: failing to draw it must not fail the comparison
        lines = str(err).strip().splitlines()
        print(f"warning: {out / REPORT} not written ({type(err).__name__}: {lines[0] if lines else 'no message'})",
              file=sys.stderr, flush=True)


# Robustness metrics of runs with certify_eps: (summary key, suffix of the split's metric, column title).
_ROBUST = (("cert", "cert_acc", "certified % (mean ± std)"), ("pgd", "pgd_acc", "PGD % (mean ± std)"))


def _mean_std(values: list[float]) -> dict[str, Any]:
    return {"accs": values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per init spec: the primary metric's accuracies over seeds with mean and std, the seeds
    and wall times; runs trained with ``certify_eps`` also get ``cert`` and ``pgd`` (the same
    split's certified and PGD accuracy, when every seed has them)."""
    table = {}
    for spec, results in runs.items():
        metric = primary_metric(results[0]["final"])
        accs = [r["final"][metric] for r in results]
        table[spec] = {"metric": metric, **_mean_std(accs),
                       "seeds": [r["seed"] for r in results], "wall_s": [r["wall_s"] for r in results]}
        split = metric.removesuffix("_acc")
        for key, suffix, _ in _ROBUST:
            values = [r["final"].get(f"{split}_{suffix}") for r in results]
            if all(v is not None for v in values):
                table[spec][key] = _mean_std(values)
    return table


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a markdown table; certified and PGD columns appear when some run has them."""
    robust = [(key, title) for key, _, title in _ROBUST if any(key in s for s in summary.values())]
    extra_head = "".join(f" {title} |" for _, title in robust)
    lines = [f"| init | metric | accuracy % (mean ± std) |{extra_head} per seed | minutes per run |",
             "|---|---|---:|" + "---:|" * len(robust) + "---|---:|"]
    for spec, s in summary.items():
        per_seed = ", ".join(f"{100 * a:.2f}" for a in s["accs"])
        minutes = statistics.fmean(s["wall_s"]) / 60
        extra = "".join(f" {100 * s[key]['mean']:.2f} ± {100 * s[key]['std']:.2f} |" if key in s else " — |"
                        for key, _ in robust)
        lines.append(f"| {spec} | {s['metric']} | {100 * s['mean']:.2f} ± {100 * s['std']:.2f} |{extra} "
                     f"{per_seed} | {minutes:.1f} |")
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
