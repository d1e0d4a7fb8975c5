"""One self-contained HTML page for a comparison or an ablation (``structinit report``).

A ``compare`` folder's page says what was compared and how to read it, then shows the results,
the training curves, the first attention layer of every init at initialisation and after
training, the configuration and the versions and seeds. An ``ablate`` folder's page shows its
``ablation.md``, ``ablation.png`` and ``ablation.json``, and the configuration and versions of
the runs it holds. Figures are embedded as PNG data URIs and the style is inline: the page
loads nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
from pathlib import Path

import torch

import structinit
from structinit.adapters import infer_layout
from structinit.analysis.capture import attention_maps
from structinit.analysis.curves import curves_figure
from structinit.analysis.figures import comparison_figure
from structinit.harness.config import facts
from structinit.harness.errors import user_input
from structinit.harness.finished import find_runs, models_of
from structinit.harness.report.html import (
    config_html,
    esc,
    figure,
    figure_png,
    json_html,
    markdown,
    note,
    page,
    split_config,
    table,
    versions_html,
)
from structinit.harness.run.checkpoint import atomic_write_bytes
from structinit.harness.specs import spec_label
from structinit.harness.summary import primary_metric, summarise
from structinit.harness.tasks.image import eval_images

REPORT = "report.html"
ABLATION_FILES = ("ablation.json", "ablation.md", "ablation.png")
EVAL_IMAGES = 8  # evaluation images the attention maps are averaged over
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METRICS = {"holdout_acc": ("held-out accuracy", "{examples} that were set aside and never trained on"),
           "test_acc": ("test accuracy", "the dataset's test {examples}, never trained on")}


def write_report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``folder`` (a compare or ablate folder) to ``out`` (default
    ``folder/report.html``; a folder means ``out/report.html``) and return its path. A folder
    without results is a FileNotFoundError naming it; a place the page cannot be written is an
    OSError, raised before anything is drawn."""
    folder = Path(folder).expanduser()
    ablation = any((folder / name).is_file() for name in ABLATION_FILES)
    with user_input("folder"):
        runs = find_runs(folder, depth=4, required=False) if ablation else find_runs(folder)
    with user_input("out_dir"):
        target = report_path(folder, out)
    make = _ablation_page if ablation else _compare_page
    text = page(*make(folder, runs), footer_html=_footer(folder))

    with user_input("out_dir"):
        atomic_write_bytes(target, lambda f: f.write(text.encode("utf-8")))
    return target


def report_path(folder: Path, out: str | Path | None) -> Path:
    """Where the page goes; an error if it cannot be written there (nothing is created)."""
    target = Path(out).expanduser() if out is not None else folder / REPORT
    if target.is_dir():
        target = target / REPORT
    existing = next(p for p in target.absolute().parents if p.exists())  # where it goes, or is created below
    if existing.is_dir() and _can_write(existing):
        return target
    why, error = ((f"{existing} is a file, not a folder", NotADirectoryError) if not existing.is_dir()
                  else (f"no permission to write in {existing}", PermissionError))
    raise error(f"cannot write the report to {target}: {why}; choose another place for it (--out FILE)")


def _can_write(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def group_runs(runs, specs=()) -> dict[str, list]:
    """The runs by init spec, in the comparison's order (``specs``, from summary.json): a run in
    ``<label>/seed<k>`` belongs to the spec whose folder label is ``<label>``; any other run is
    grouped by its init and options. Each group is sorted by seed."""
    by_label = {spec_label(spec): spec for spec in specs}
    groups: dict[str, list] = {spec: [] for spec in specs}
    for run in runs:
        name = by_label.get(run.path.parent.name) or run.spec
        groups.setdefault(name, []).append(run)
    return {name: sorted(g, key=lambda r: r.result["seed"]) for name, g in groups.items() if g}


def _summary(folder: Path) -> dict[str, set[int]]:
    """summary.json's specs and their seeds, in the order the comparison gave them (summary.md's
    rows; the JSON's keys are sorted); empty without a readable summary."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
        rows = (folder / "summary.md").read_text().splitlines() if (folder / "summary.md").is_file() else []
        seeds = {spec: {int(k) for k in s["seeds"]} for spec, s in summary.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}  # no summary (a run folder, or a comparison still running): every run, by folder
    in_order = [cell for row in rows if (cell := row.strip("| ").split(" | ")[0]) in seeds]
    return {spec: seeds[spec] for spec in dict.fromkeys(in_order + list(seeds))}


def _summarised(groups: dict[str, list], summary: dict[str, set[int]]) -> tuple[dict[str, list], list[str]]:
    """(the groups cut to the specs and seeds of summary.json, the labels of the runs left out):
    the report shows the comparison that was summarised, not older runs in the same folder."""
    if not summary:
        return groups, []
    kept = {spec: [r for r in groups.get(spec, []) if r.result["seed"] in seeds] for spec, seeds in summary.items()}
    left = [r.label for name, group in groups.items() for r in group if r not in kept.get(name, [])]
    return {name: group for name, group in kept.items() if group}, left


# ----------------------------------------------------------------------------- compare
def _compare_page(folder: Path, runs):
    listed = _summary(folder)
    groups, left_out = _summarised(group_runs(runs, listed), listed)
    if not groups:
        raise FileNotFoundError(f"{folder}: none of the runs summary.json names has a result.json")
    summary = summarise({name: [r.result for r in g] for name, g in groups.items()})
    names = list(groups)
    kind = next(iter(groups.values()))[0].kind
    task = kind.task
    shared, _ = split_config(groups)
    key = summary[names[0]]["metric"]
    metric, where = METRICS.get(key, (key, "evaluation {examples}"))
    where = where.format(examples=task.examples)
    seeds = sorted({r.result["seed"] for g in groups.values() for r in g})
    what = ", ".join(f"<code>{esc(n)}</code>" for n in names)
    model = f"model <code>{esc(shared.get('model', 'several models'))}</code>"
    data = shared.get(kind.data, f"several {kind.data}s")
    options = facts(kind.config, kind.data).spec_of
    data += f" {shared[options]}" if options and shared.get(options, "{}") != "{}" else ""
    budget = (_count(shared[kind.budget], task.unit) if kind.budget in shared
              else f"several {task.unit} budgets")
    recipe = f"{model} on {'the task ' if options else ''}<code>{esc(data)}</code>, {esc(budget)}"
    figures = ("; the attention figures show where the first attention layer looks at initialisation and after "
               "training") if kind.attention_figures else ""
    several = len(names) > 1
    intro = (f"This page {'compares' if several else 'reports'} {_count(len(names), 'way')} to initialise the "
             f"{kind.subject}: {what}. Each was trained with the same recipe ({recipe}) "
             f"from {_count(len(seeds), 'seed')} ({esc(', '.join(map(str, seeds)))}); only the initialisation "
             f"differs between the rows. Runs are judged on their {esc(metric)} ({esc(where)}). Start with the "
             "results table: higher is better, and a difference smaller than the ± (the standard deviation over "
             f"seeds) is within noise. The curves show how each init learned, {task.unit} by {task.unit}{figures}.")
    title = f"{kind.title}{'s compared' if several else ''}: {', '.join(names)}"
    subtitle = f"structinit compare folder {folder.resolve()}"
    left = note(f"Left out: {len(left_out)} other finished run(s) in this folder that summary.json does not "
                f"list ({', '.join(left_out[:8])}{' …' if len(left_out) > 8 else ''}).") if left_out else ""
    sections = [("results", "Results", _results_html(summary, metric, task.unit) + left),
                ("curves", "Training curves", _curves_html(groups, task.unit, task.examples)),
                *([("attention", "Attention maps", _attention_html(groups))] if kind.attention_figures else []),
                ("configuration", "Configuration", config_html(groups)),
                ("versions", "Versions and seeds", versions_html(groups))]
    return title, subtitle, intro, sections


def _count(n, noun: str) -> str:
    return f"{n} {noun}{'' if str(n) == '1' else 's'}"


def _minutes(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes:.1f}" if minutes >= 1 else f"{minutes:.2f}" if minutes >= 0.01 else "< 0.01"


def _results_html(summary: dict, metric: str, unit: str = "epoch") -> str:
    means = sorted((s["mean"] for s in summary.values()), reverse=True)
    best = max(summary, key=lambda s: summary[s]["mean"]) if len(means) > 1 and means[0] > means[1] else None
    rows = [[spec, s["metric"], f"{100 * s['mean']:.2f} ± {100 * s['std']:.2f}",
             ", ".join(f"{100 * a:.2f}" for a in s["accs"]), len(s["accs"]), _minutes(statistics.fmean(s["wall_s"]))]
            for spec, s in summary.items()]
    html = table(["init", "metric", "accuracy % (mean ± std)", "per seed (%)", "seeds", "minutes per run"], rows,
                 numeric=(2, 4, 5), row_classes=["best" if spec == best else "" for spec in summary])
    html += (f'<p class="caption">One row per init: its {esc(metric)} after the last {unit}, as the mean ± standard '
             "deviation over seeds and for each seed (in seed order; see Versions and seeds). "
             + ("The highlighted row has the highest mean. " if best else "")
             + "Minutes per run: training wall time, mean over seeds.</p>")
    if all(len(s["accs"]) < 2 for s in summary.values()):
        html += note("Each init ran with one seed, so there is no spread (± 0.00) to judge differences by: "
                     "run more seeds (structinit compare --seeds 3) before drawing conclusions.")
    return html


def _curves_html(groups, unit: str = "epoch", examples: str = "images") -> str:
    try:
        key = primary_metric(next(iter(groups.values()))[0].result["final"])
        metric = METRICS.get(key, (key,))[0]
        fig = curves_figure({name: [r.result for r in g] for name, g in groups.items()})
        for ax, label in zip(fig.axes, (f"{metric} (%)", metric.replace("accuracy", "loss"))):
            ax.set_ylabel(label)  # the figure says held-out, whichever split was evaluated
        png = figure_png(fig)
    except (ValueError, KeyError, TypeError) as err:
        return note(f"No training curves: {_first_line(err)}")
    return figure(png, f"accuracy and loss against {unit} for every init",
                  f"Left: accuracy on the evaluation {examples} ({esc(metric)} "
                  f"here) at each evaluation {unit}; right: the loss on "
                  "them (lower is better). Lines are the mean over seeds, shaded bands ±1 standard deviation; n is the "
                  "number of seeds.")


# ----------------------------------------------------------------------------- attention
def _attention_html(groups) -> str:
    """The first layer's maps of every init's first-seed run, at init and trained, averaged over
    a few evaluation images; each init that cannot be drawn gets a visible note instead."""
    maps = {"at initialisation": {}, "after training": {}}
    notes, cache, shown = [], {}, ""
    for name, group in groups.items():
        run = group[0]
        try:
            images, num_classes, shown = _eval_images(run.config, cache)
        except Exception as err:  # no data here: the figures are left out, the page is not
            notes.append(f"{name}: no attention maps, the dataset {run.config.dataset!r} could not be loaded "
                         f"here ({_first_line(err)}).")
            continue
        try:
            for stage, (layout, m) in zip(maps, _first_layer_maps(run, images, num_classes)):
                maps[stage].setdefault(layout, {})[name] = m
        except Exception as err:  # an init that cannot be rebuilt: say so, draw the others
            notes.append(f"{name}: no attention maps ({_first_line(err)}).")
    parts = [note(n) for n in notes]
    for stage, by_layout in maps.items():
        for layout, by_init in by_layout.items():
            fig = comparison_figure(by_init, layout, title=f"first attention layer, {stage}")
            parts.append(figure(figure_png(fig), f"attention maps {stage}", (
                f"<strong>{esc(stage.capitalize())}.</strong> The first attention layer's maps, averaged over "
                f"{esc(shown)}, for each init's first-seed run. One row per init, one column per head; in each "
                "panel row <em>i</em> is a query token and column <em>j</em> a key token (the image's patches in "
                "reading order, class token left out), brighter = more attention, one square-root colour scale "
                "for all panels. White squares outline where a row of patches attends to itself. A sharp "
                "diagonal line, shifted off the centre, means every patch looks at one neighbour at a fixed "
                "offset, like a convolution (what the impulse init builds); an even wash means attention is "
                "spread over the whole image.")))
    if not any(maps.values()) and not notes:
        parts.append(note("No attention maps were drawn."))
    return "".join(parts)


def _eval_images(cfg, cache: dict):
    """(normalised first evaluation images, class count, their description) for ``cfg``'s
    data, never downloading; a load that failed fails again from the cache."""
    key = (cfg.dataset, cfg.data_dir, cfg.holdout, cfg.holdout_mode, cfg.seed)
    if key not in cache:
        try:
            cache[key] = eval_images(cfg, EVAL_IMAGES)
        except Exception as err:
            cache[key] = err
    if isinstance(cache[key], Exception):
        raise cache[key]
    return cache[key]


def _first_layer_maps(run, images, num_classes):
    """[(layout, (heads, T, T) mean map)] of the first attention layer at init and trained."""
    models = models_of(run, tuple(images.shape[1:]), num_classes)
    with torch.no_grad():
        return [(infer_layout(m), attention_maps(m, images, layers=[0])[0].mean(0)) for m in models]


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _footer(folder: Path) -> str:
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"Written by <code>structinit report</code> (structinit {esc(structinit.__version__)}) from "
            f"<code>{esc(folder.resolve())}</code> on {esc(when)}. Everything on this page is inside this one "
            "file: it loads nothing from a network.")


# ----------------------------------------------------------------------------- ablate
def _ablation_page(folder: Path, runs):
    data, problems, json_path = None, [], folder / "ablation.json"
    if json_path.is_file():
        try:
            data = json.loads(json_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            problems = [f"{json_path.name} could not be read ({_first_line(err)})."]
    md_path, png_path = folder / "ablation.md", folder / "ablation.png"
    text = md_path.read_text(errors="replace") if md_path.is_file() else ""
    heading = next((ln for ln in text.splitlines() if ln.startswith("# ")), None)
    if heading:  # the page's title: not repeated in the text
        text = text.replace(heading, "", 1)
    results = markdown(text) if md_path.is_file() else note("There is no ablation.md in this folder.")
    if png_path.is_file():
        png = png_path.read_bytes()
        results += figure(png, "ablation figure", "The ablation's figure (ablation.png), as <code>structinit "
                          "ablate</code> drew it.") if png.startswith(PNG_SIGNATURE) else \
            note("ablation.png is not a PNG image; it is left out.")
    sections = [("results", "Results", "".join(note(p) for p in problems) + results)]
    groups = group_runs(runs)
    if groups:
        sections.append(("curves", "Training curves", _curves_html(groups)))
    if isinstance(data, dict) and data:
        folded = ("config",) if groups else ()  # the runs' own settings are in Configuration
        sections.append(("details", "Details from ablation.json", json_html(data, "ablation.json", folded)))
    if groups:
        sections += [("configuration", "Configuration", config_html(groups)),
                     ("versions", "Versions and seeds", versions_html(groups))]
    title = heading[2:].replace("`", "").strip() if heading else f"Ablation: {folder.name}"
    intro = ("An ablation builds variants of one initialisation, each with a setting changed, and measures every "
             "variant the same way, to find out which settings matter. The results come first, as <code>structinit "
             "ablate</code> wrote them (ablation.md and ablation.png): compare the variants row by row, and treat a "
             "difference smaller than the spread over seeds as noise. "
             + ("The variants were also trained: their training curves, configuration and versions follow."
                if groups else "All that ablation.json records follows."))
    return title, f"structinit ablate folder {folder.resolve()}", intro, sections

