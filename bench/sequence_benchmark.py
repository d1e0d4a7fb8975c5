"""The sequence benchmark (docs/results/sequence.md): default vs mimetic init on Mamba and on a
causal Transformer of matched size, on copying and multi-query associative recall at three
settings each (recipe ``seq-cpu``), 5 seeds. Each (setting, model) is a ``structinit compare``
folder under ``--out``, run seed-major and resumable; it prints the table (also
``--out``/benchmark.md) and draws accuracy against length and against step.

    OMP_NUM_THREADS=2 .venv/bin/python bench/sequence_benchmark.py --out runs/seq --figures docs/figures
    OMP_NUM_THREADS=1 .venv/bin/python bench/sequence_benchmark.py --quick --out /tmp/seqq   # smoke test

``--ablation`` runs the SSM scheme's ablation (:data:`ABLATION`) on Mamba at the longest
settings, 3 seeds, in the same folders (table ``ablation.md``):

    OMP_NUM_THREADS=2 .venv/bin/python bench/sequence_benchmark.py --out runs/seq --ablation --figures runs/seq/ablation
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common import markdown, pyplot

from structinit.harness.compare import compare
from structinit.harness.recipes import sequence_recipe
from structinit.harness.specs import parse_seeds, spec_label, split_init_specs

# MQAR's vocabulary is 64 (keys from 31, values from 32 tokens): with Zoology's larger ones
# (256+) neither Mamba-2×64 init got past the rate of guessing one of the 8 values in context
# in 1,000 steps of a probe, so the settings could not tell the inits apart.
SETTINGS = {"copy": [dict(length=8, vocab=16), dict(length=16, vocab=16), dict(length=32, vocab=16)],
            "mqar": [dict(pairs=4, length=32, vocab=64), dict(pairs=8, length=48, vocab=64),
                     dict(pairs=12, length=64, vocab=64)]}
QUICK = {"copy": [dict(length=4, vocab=8), dict(length=8, vocab=8)], "mqar": [dict(pairs=2, length=16)]}
MODELS = ("mamba_seq_2x64", "gpt_seq_2x64")
# The mimetic row uses the scheme's defaults (the SSM scheme on Mamba, the attention scheme on
# the Transformer). SSM-only specs (``--ssm-inits``) run on the Mamba models only: the attention
# scheme has none of their options.
INITS = ("default", "mimetic")
SSM_INITS = ()
# Each part of the SSM scheme switched off, the part its defaults leave off switched on, and
# the B/C constants moved to either side of the attention lead α = β = 0.7.
ABLATION = ("mimetic:conv_identity=True", "mimetic:bc=False", "mimetic:a_log=None,delta=None",
            "mimetic:a_log=None", "mimetic:alpha=0.0,beta=1.0", "mimetic:alpha=1.0,beta=0.3")
ABLATION_FLAGS = dict(seeds="3", settings="2", models="mamba_seq_2x64", ssm_inits=";".join(ABLATION),
                      table="ablation.md")


def inits_of(model: str, inits, ssm_inits) -> list[str]:
    """The init specs a model runs: all of ``inits``, plus ``ssm_inits`` on a Mamba model."""
    return list(inits) + (list(ssm_inits) if model.startswith("mamba") else [])


def task_spec(task: str, options: dict) -> str:
    return f"{task}:" + ",".join(f"{k}={v}" for k, v in options.items())


def folder(out: Path, task: str, options: dict, model: str) -> Path:
    return out / spec_label(task_spec(task, options)) / model


def run_all(out: Path, settings: dict, models, inits, ssm_inits, seeds: list[int], overrides: dict,
            progress: bool) -> None:
    for n in range(1, len(seeds) + 1):  # seed-major over the whole benchmark
        for task, options_list in settings.items():
            for options in options_list:
                for model in models:
                    base = sequence_recipe("seq-cpu", model=model, task=task, task_options=options, precision="fp32",
                                           **overrides)
                    print(f"=== seed {seeds[n - 1]}: {task_spec(task, options)} {model}", flush=True)
                    compare(base, inits_of(model, inits, ssm_inits), seeds[:n], folder(out, task, options, model),
                            progress=progress)


def collect(out: Path, settings: dict, models, inits, ssm_inits) -> list[dict]:
    """One row per (task setting, model, init): the finished seeds' final held-out metrics."""
    from structinit.data.sequence_tasks import make_sequence_problem

    rows = []
    for task, options_list in settings.items():
        for options in options_list:
            for model in models:
                for init in inits_of(model, inits, ssm_inits):
                    results = [json.loads(p.read_text()) for p in
                               sorted((folder(out, task, options, model) / spec_label(init)).glob("seed*/result.json"))]
                    if not results:
                        continue
                    acc = [r["final"]["holdout_acc"] for r in results]
                    exact = [r["final"]["holdout_exact"] for r in results]
                    rows.append({"task": task, "options": options,
                                 "seq_len": make_sequence_problem(task, **options).seq_len,
                                 "model": model, "init": init, "acc": acc, "exact": exact,
                                 "minutes": statistics.median(r["wall_s"] for r in results) / 60, "results": results})
    return rows


def _ms(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.1f} ± {100 * sd:.1f}"


# A seed "solves" a setting at this held-out token accuracy. MQAR outcomes are bimodal (a run
# either escapes the plateau at the rate of guessing a value in context, or stays on it), so
# the count of seeds that solve says more than a mean ± std over seeds.
SOLVED = 0.9


def table(rows: list[dict]) -> str:
    head = ["task", "setting", "seq len", "model", "init", "token acc %", "exact-match %", "per seed (token %)",
            f"seeds ≥ {100 * SOLVED:.0f} %", "median min/run"]
    cells = [[r["task"], ", ".join(f"{k}={v}" for k, v in r["options"].items()), r["seq_len"], r["model"], r["init"],
              _ms(r["acc"]), _ms(r["exact"]), ", ".join(f"{100 * a:.0f}" for a in r["acc"]),
              f"{sum(a >= SOLVED for a in r['acc'])}/{len(r['acc'])}", f"{r['minutes']:.1f}"] for r in rows]
    return markdown(head, "llrllrrlrr", cells) + "\n"


def style(model: str, init: str) -> dict:
    """One colour per model family (Mamba blue, Transformer orange), darker and solid for mimetic."""
    mamba, mimetic = model.startswith("mamba"), init.startswith("mimetic")
    colour = ("#1f4e9c" if mamba else "#c0561b") if mimetic else ("#7fa6e0" if mamba else "#f0a36b")
    return {"color": colour, "linestyle": "-" if mimetic else "--"} if init in INITS else {"linestyle": ":"}


def _seeds(rows: list[dict]) -> dict[tuple[str, str], int]:
    """The fewest finished seeds of each (model, init) over ``rows``: one legend entry across
    panels, so one count."""
    out: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r["model"], r["init"])
        out[key] = min(out.get(key, len(r["acc"])), len(r["acc"]))
    return out


def _save(plt, fig, axes, path: Path) -> Path:
    """``fig`` with one legend for all panels below them (in the axes it hid the MQAR curves),
    written to ``path``."""
    handles = {}  # label → the first handle of that label
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(len(handles), 2), fontsize=8, frameon=False)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def figures(rows: list[dict], settings: dict, where: Path) -> list[Path]:
    """Accuracy against sequence length (mean line, min–max band over seeds, one dot per seed)
    and against step at each task's longest setting (mean line, one thin line per seed). Bands
    are min–max, not ±1 std: MQAR outcomes are bimodal, and ±std would leave [0, 100] and hide
    that each seed either solved the setting or stayed at chance."""
    from structinit.analysis.curves import seed_curves

    plt = pyplot()
    where.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in settings if any(r["task"] == t for r in rows)]
    lines = sorted({(r["model"], r["init"]) for r in rows})
    seeds = _seeds(rows)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), dpi=110, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for model, init in lines:
            pts = sorted((r["seq_len"], r["acc"]) for r in rows
                         if (r["task"], r["model"], r["init"]) == (task, model, init))
            if not pts:
                continue
            x = [p[0] for p in pts]
            line, = ax.plot(x, [100 * statistics.fmean(p[1]) for p in pts], marker="o",
                            label=f"{model} · {init} (n={seeds[model, init]})", **style(model, init))
            colour = line.get_color()
            ax.fill_between(x, [100 * min(p[1]) for p in pts], [100 * max(p[1]) for p in pts], color=colour, alpha=0.12)
            ax.scatter([p[0] for p in pts for _ in p[1]], [100 * a for p in pts for a in p[1]], s=9, color=colour,
                       alpha=0.45, linewidths=0)
        lengths = sorted({r["seq_len"] for r in rows if r["task"] == task})
        ax.set(title=task, xlabel="sequence length (tokens)", ylabel="held-out token accuracy (%)", ylim=(-2, 102))
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    paths = [_save(plt, fig, axes[0], where / "sequence_accuracy_vs_length.png")]

    longest_rows = [r for r in rows if r["seq_len"] == max(q["seq_len"] for q in rows if q["task"] == r["task"])]
    seeds = _seeds(longest_rows)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), dpi=110, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        task_rows = [r for r in longest_rows if r["task"] == task]
        for r in task_rows:
            steps, curves = seed_curves(r["results"], "holdout_acc", "step")
            line, = ax.plot(steps, [100 * statistics.fmean(v) for v in zip(*curves)], lw=2,
                            label=f"{r['model']} · {r['init']} (n={seeds[r['model'], r['init']]})",
                            **style(r["model"], r["init"]))
            for c in curves:
                ax.plot(steps, [100 * a for a in c], color=line.get_color(), lw=0.7, alpha=0.35)
        setting = ", ".join(f"{k}={v}" for k, v in task_rows[0]["options"].items())
        ax.set(title=f"{task} ({setting})", xlabel="step", ylabel="held-out token accuracy (%)", ylim=(-2, 102))
        ax.grid(alpha=0.3)
    return [*paths, _save(plt, fig, axes[0], where / "sequence_accuracy_vs_step.png")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/sequence-benchmark")
    parser.add_argument("--seeds", default=None, help="a count (5 → seeds 0 … 4) or a list (0,4,7); default 5 "
                        "(3 with --ablation)")
    parser.add_argument("--models", default=None, help=f"default {','.join(MODELS)}")
    parser.add_argument("--tasks", default="copy,mqar")
    parser.add_argument("--inits", default=";".join(INITS),
                        help="init specs for every model, separated by ';'")
    parser.add_argument("--ssm-inits", default=None,
                        help="extra init specs for the Mamba models only (SSM-scheme options), separated by ';'")
    parser.add_argument("--settings", default=None,
                        help="indices into each task's settings, e.g. '2' for the longest only (default: all)")
    parser.add_argument("--table", default=None, help="file name of the table, in --out (default benchmark.md)")
    parser.add_argument("--ablation", action="store_true",
                        help="the SSM-scheme ablation: " + " ".join(f"--{k.replace('_', '-')} {v!r}"
                                                                     for k, v in ABLATION_FLAGS.items()))
    parser.add_argument("--figures", default=None, help="folder for the figures (default: --out)")
    parser.add_argument("--quick", action="store_true", help="tiny settings and 60 steps: a smoke test")
    parser.add_argument("--report-only", action="store_true", help="train nothing; tabulate what has finished")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args()
    preset = ABLATION_FLAGS if args.ablation else dict(seeds="5", models=",".join(MODELS),
                                                       ssm_inits=";".join(SSM_INITS), table="benchmark.md")
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    out = Path(args.out)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        sys.exit(f"error: {err}")
    settings = {t: (QUICK if args.quick else SETTINGS)[t] for t in args.tasks.split(",")}
    if args.settings is not None:
        picks = [int(i) for i in args.settings.split(",")]
        settings = {t: [options[i] for i in picks if i < len(options)] for t, options in settings.items()}
    models = args.models.split(",")
    inits, ssm_inits = split_init_specs(args.inits), split_init_specs(args.ssm_inits)
    overrides = dict(steps=60, eval_every=20, heldout_size=64) if args.quick else {}
    if not args.report_only:
        run_all(out, settings, models, inits, ssm_inits, seeds, overrides, args.progress)
    rows = collect(out, settings, models, inits, ssm_inits)
    text = table(rows)
    (out / args.table).write_text(text)
    print(text)
    for path in figures(rows, settings, Path(args.figures) if args.figures else out):
        print(f"→ {path}")


if __name__ == "__main__":
    main()
