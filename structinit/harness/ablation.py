"""The ablations of ``structinit ablate NAME`` (what each measures: that command's help): one
reviewer question each, as variants. A variant is an init spec (``impulse:kernel_size=5``)
and, where the question is about the architecture, model keyword arguments (``num_heads``).
The ``gd`` variants fit ``--steps`` steps, by default a tenth of the published fit so that an
ablation stays short; its table says so and scales each gd time to the published length."""

from __future__ import annotations

import dataclasses
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from structinit.analysis import attention_metrics, fidelity_summary, impulse_fidelity
from structinit.functional import PSEUDO_INPUTS
from structinit.harness.compare import check_specs, compare, run_config
from structinit.harness.errors import input_parameter, user_input
from structinit.harness.recipes import recipe as make_recipe
from structinit.harness.run.checkpoint import atomic_write_bytes, write_json, write_png
from structinit.harness.run.device import versions
from structinit.harness.run.folder import check_out_dir
from structinit.harness.run.lifecycle import construct_and_plan
from structinit.harness.specs import parse_init_spec, parse_literal, parse_seeds
from structinit.harness.summary import mean_std
from structinit.harness.tasks import make_task
from structinit.harness.tasks.image import test_images
from structinit.schemes.registry import plan_init
from structinit.utils import is_int
from structinit.utils.optional_imports import require

__all__ = ["ABLATIONS", "PUBLISHED_GD_STEPS", "Ablation", "Variant", "ablate", "command_line", "format_markdown",
           "format_table", "plot_ablation", "variants"]

PUBLISHED_GD_STEPS = 10_000  # the 2024 paper's fit length
DEFAULT_STEPS = 1000  # an ablation's gd fit length unless --steps says otherwise
# The config fields each command sets from its own flags (field: the flag), which --set must not.
OWNED = {"train": {"out_dir": "--out", "init": "--init", "init_options": "--init", "seed": "--seed"},
         "compare": {"out_dir": "--out", "init": "--inits", "seed": "--seeds"},
         "ablate": {"out_dir": "--out", "init": "NAME", "init_options": "NAME", "seed": "--seeds"}}


@dataclass(frozen=True)
class Variant:
    """One row of an ablation: a short label, the init spec, and model keyword arguments."""

    label: str
    spec: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """A folder name for the variant's runs (unique within its ablation)."""
        text = self.label.replace("=", "-").replace(" ", "_")
        return "".join(ch if ch.isalnum() or ch in "._-+" else "_" for ch in text)


@dataclass(frozen=True)
class Ablation:
    """A question, and how to build its variants from the gd step count."""

    title: str
    question: str
    build: Callable[[int], list[Variant]]


def _gd(steps: int, extra: str = "") -> str:
    return f"impulse:solver=gd,steps={steps}{',' + extra if extra else ''}"


def _sharing(steps: int) -> list[Variant]:
    return [
        Variant("analytic, shared offsets", "impulse:per_layer_offsets=False"),
        Variant("analytic, per-layer offsets", "impulse:per_layer_offsets=True"),
        Variant("gd, shared solution", _gd(steps, "share_solution=True")),
        Variant("gd, per-layer solution", _gd(steps, "share_solution=False")),
        Variant("gd, per-layer solution and offsets", _gd(steps, "share_solution=False,per_layer_offsets=True")),
    ]


def _impulse(key: str, values: tuple) -> Callable[[int], list[Variant]]:
    """Variants ``impulse:<key>=<value>``, labelled ``<key>=<value>`` (no gd: the step count plays no part)."""
    return lambda steps: [Variant(f"{key}={v}", f"impulse:{key}={v}") for v in values]


ABLATIONS: dict[str, Ablation] = {
    "pseudo": Ablation("pseudo input of the gd fit", "Does the fit need the position embedding, or does noise do "
                       "(the 2024 paper's Table 6)?",
                       lambda steps: [Variant(f"pseudo={k}", _gd(steps, f"pseudo={k}")) for k in PSEUDO_INPUTS]),
    "kernel": Ablation("kernel size", "How does the impulse's kernel size (3, 5, 7) change fidelity and "
                       "accuracy?", _impulse("kernel_size", (3, 5, 7))),
    "heads": Ablation("heads at fixed width", "How many heads (narrower heads) can carry the impulse?",
                      lambda steps: [Variant(f"num_heads={h}", "impulse", {"num_heads": h}) for h in (2, 4, 8)]),
    "offsets": Ablation("offset choice", "Random offsets per head, or the enumerated ones (centre, up, right, "
                        "left, …)?", _impulse("offsets", ("random", "enumerated"))),
    "sharing": Ablation("shared vs per-layer", "One offset draw and one solution for every layer, or new ones per "
                        "layer?", _sharing),
    "sharpness": Ablation("sharpness (target_mass)", "How sharp should the maps be at init?",
                          _impulse("target_mass", (0.3, 0.5, 0.7, 0.9))),
    "pe-scale": Ablation("position-embedding scale", "How large should the written sin-cos PE be?",
                         lambda steps: [Variant(f"pe_scale={s:g}", f"impulse:pe_scale={s!r}")
                                        for s in (0.5, 1.0, 2.0, 4.0)]),
    "solvers": Ablation("solvers and their cost", "What do the analytic, closed-form (2025) and gd (2024) "
                        "solvers cost, and how faithful are they?",
                        lambda steps: [Variant("analytic", "impulse:solver=analytic"),
                                       Variant("closed_form", "impulse:solver=closed_form"),
                                       Variant(f"gd ({steps} steps)", _gd(steps))]),
}


def variants(name: str, steps: int = DEFAULT_STEPS) -> list[Variant]:
    """The variants of the ablation ``name``, its gd variants fitted for ``steps`` steps."""
    if name not in ABLATIONS:
        raise ValueError(f"ablation {name!r}: unknown; valid: {', '.join(ABLATIONS)}")
    return ABLATIONS[name].build(steps)


# (JSON key, column head) of the numbers measured per variant and seed, in table order.
METRICS = (("pe_mass_l1", "PE mass L1"), ("pe_hit_l1", "PE hit L1"), ("pe_mass_mean", "PE mass mean"),
           ("pe_hit_mean", "PE hit mean"), ("real_mass_l1", "real mass L1"), ("real_hit_l1", "real hit L1"),
           ("real_mass_mean", "real mass mean"), ("real_hit_mean", "real hit mean"),
           ("distance_l1", "distance L1 (patches)"), ("local_mass_l1", "k×k mass L1"))
# What the figure shows, real images: (key, legend).
FIGURE_BARS = (("real_hit_l1", "hit, layer 1"), ("real_hit_mean", "hit, mean over layers"),
               ("real_mass_l1", "mass, layer 1"), ("real_mass_mean", "mass, mean over layers"))


def _count(name: str, value: Any, flag: str) -> int:
    with user_input(name):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} ({flag}): expected a positive whole number")
    return int(value)


def command_line(name: str, settings: dict[str, Any], overrides: dict[str, Any]) -> str:
    """The ``structinit ablate`` command that reproduces these settings."""
    s = settings
    seeds = str(len(s["seeds"])) if s["seeds"] == list(range(len(s["seeds"]))) else ",".join(map(str, s["seeds"]))
    parts = ["structinit", "ablate", name, "--recipe", s["recipe"]]
    if s["data_dir"] is not None:
        parts += ["--data-dir", str(s["data_dir"])]
    parts += ["--seeds", seeds, "--images", str(s["images_requested"]), "--steps", str(s["steps"]),
              "--repeats", str(s["repeats"]), *(["--train"] if s["train"] else []), "--out", str(s["out"])]
    for key, value in sorted(overrides.items()):
        text = value if isinstance(value, str) and parse_literal(value) == value else repr(value)
        if '"' not in text:  # {"patch_size": 1} reads better in a shell than {'patch_size': 1}
            text = text.replace("'", '"')
        parts += ["--set", f"{key}={text}"]
    return shlex.join(parts)


def _variant_config(base, variant: Variant, seed: int, runs_dir: Path):
    """The ImageConfig the variant's run with ``seed`` trains (as :func:`compare` builds it)."""
    with user_input("init"):
        name, options = parse_init_spec(variant.spec)
    return run_config(_variant_base(base, variant), variant.spec, name, options, seed, runs_dir / variant.key)


def _variant_base(base, variant: Variant):
    """The recipe with the variant's model keyword arguments."""
    return dataclasses.replace(base, model_kwargs={**base.model_kwargs, **variant.model_kwargs})


def _check_variants(ablation: str, base, found: list[Variant], seed: int, runs_dir: Path) -> None:
    """Plan every variant on its model as :func:`~structinit.harness.compare.check_specs` does (gd
    with 0 steps: the options, not the fit): a variant the model cannot take fails before any measuring."""
    unfitted = ABLATIONS[ablation].build(0)  # the same variants in the same order, gd with 0 steps
    for variant, check in zip(found, unfitted):
        cfg = _variant_base(base, variant)
        try:
            check_specs(cfg, [check.spec], [seed], runs_dir / variant.key)
        except (TypeError, ValueError) as err:
            if input_parameter(err) != "init":  # the model itself, not this variant: the same for every variant
                raise
            reason = err.__cause__ or err  # check_specs names the spec; the message names the variant
            with user_input("model"):
                model = cfg.model + (f" {cfg.model_kwargs}" if cfg.model_kwargs else "")
                raise ValueError(f"ablation {ablation!r}, variant {variant.label!r} ({variant.spec}) does not fit "
                                 f"model {model}: {reason}; choose another model (--model) or its size "
                                 "(--set model_kwargs=…)") from err


def _measure(cfg, sizes: dict[str, Any], images, repeats: int) -> tuple[dict[str, float], list[float]]:
    """Fidelity and attention metrics of one variant and seed at init, and the seconds each of
    ``repeats`` inits took on a freshly constructed model (construction not counted), built
    exactly as its run builds it on ``sizes`` (what the data decides)."""
    seed, seconds = cfg.seed if cfg.init_seed is None else cfg.init_seed, []
    for _ in range(repeats):
        model, _ = construct_and_plan(dataclasses.replace(cfg, init="pytorch", init_options={}), sizes)  # not applied
        start = time.perf_counter()
        with user_input("init"):
            plan_init(model, cfg.init, seed=seed, **cfg.init_options).commit()
        seconds.append(time.perf_counter() - start)
    pe = fidelity_summary(impulse_fidelity(model))
    real = fidelity_summary(impulse_fidelity(model, images))
    att = attention_metrics(model, images, layers=[0], kernel_size=cfg.init_options.get("kernel_size", 3))
    values = {"pe_mass_l1": pe.mass_first, "pe_hit_l1": pe.hit_first, "pe_mass_mean": pe.mass_mean,
              "pe_hit_mean": pe.hit_mean, "real_mass_l1": real.mass_first, "real_hit_l1": real.hit_first,
              "real_mass_mean": real.mass_mean, "real_hit_mean": real.hit_mean,
              "distance_l1": att["distance"][0].nanmean().item(),
              "local_mass_l1": att["local_mass"][0].nanmean().item()}
    return values, seconds


def _row(variant: Variant, per_seed: list[dict[str, float]], seconds: list[float], steps: int) -> dict[str, Any]:
    gd = parse_init_spec(variant.spec)[1].get("solver") == "gd"
    init_s = statistics.median(seconds)
    return {"label": variant.label, "spec": variant.spec, "model_kwargs": variant.model_kwargs, "key": variant.key,
            "metrics": {key: mean_std([m[key] for m in per_seed], "per_seed") for key, _ in METRICS},
            "init_s": init_s, "init_s_all": seconds, "gd_steps": steps if gd else None,
            "init_s_published_steps": init_s / steps * PUBLISHED_GD_STEPS if gd and steps else None,
            "accuracy": None}


def _fmt(stat: dict[str, Any], scale: float = 1.0, digits: int = 3) -> str:
    text = f"{scale * stat['mean']:.{digits}f}"
    return text + (f" ± {scale * stat['std']:.{digits}f}" if len(stat["per_seed"]) > 1 else "")


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of an ablation's rows (an accuracy column once trained)."""
    trained = any(r["accuracy"] for r in rows)
    heads = ["variant", "init spec", "init (s)", *(h for _, h in METRICS), *(["accuracy (%)"] if trained else [])]
    lines = ["| " + " | ".join(heads) + " |", "|---|---|" + "---:|" * (len(heads) - 2)]
    for r in rows:
        secs = f"{r['init_s']:.3f}"
        if r["init_s_published_steps"] is not None:
            secs += f" (≈ {r['init_s_published_steps']:.1f} at {PUBLISHED_GD_STEPS:,} steps)"
        cells = [r["label"], f"`{r['spec']}`" + (f" {r['model_kwargs']}" if r["model_kwargs"] else ""), secs,
                 *(_fmt(r["metrics"][key]) for key, _ in METRICS)]
        if trained:
            cells.append(_fmt(r["accuracy"], scale=100, digits=2) if r["accuracy"] else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_markdown(result: dict[str, Any]) -> str:
    """``ablation.md``: the command line, what was measured, the table."""
    s = result["settings"]
    gd = any(r["gd_steps"] for r in result["rows"])
    kwargs = f" {s['config']['model_kwargs']}" if s["config"]["model_kwargs"] else ""
    spread = " (mean ± std over seeds)" if len(s["seeds"]) > 1 else ""
    notes = [f"Recipe `{s['recipe']}`, model `{s['config']['model']}`{kwargs}, seeds "
             f"{', '.join(map(str, s['seeds']))}{spread}.",
             "Fidelity at init: mean attention mass on each head's target and argmax hit rate, at layer 1 (L1) and "
             "averaged over layers; PE: the position-only pseudo input LayerNorm(PE) in every layer; real: the first "
             f"{s['images']} test images of `{s['config']['dataset']}`, normalised as in training. Distance and k×k "
             "mass: mean attention distance and the mass inside the variant's k×k neighbourhood at layer 1, real "
             f"images. Init (s): median wall time of the init over {s['repeats']} repeat(s), 1 for gd."]
    if gd:
        notes.append(f"gd fits {s['steps']} steps here (published: {PUBLISHED_GD_STEPS:,}); its time at "
                     f"{PUBLISHED_GD_STEPS:,} steps is the measured time per step × {PUBLISHED_GD_STEPS:,}.")
    if any(r["accuracy"] for r in result["rows"]):
        metric = next(r["accuracy"]["metric"] for r in result["rows"] if r["accuracy"])
        notes.append(f"Accuracy: `{metric}` after training with the recipe (runs in `{s['out']}/runs`).")
    return (f"# Ablation `{s['ablation']}`: {s['title']}\n\n```\n{s['command']}\n```\n\n{s['question']}\n\n"
            + "\n".join(notes) + "\n\n" + format_table(result["rows"]))


def plot_ablation(result: dict[str, Any], path: str | Path) -> None:
    """Grouped bars of the real-image fidelity per variant (± std over seeds), and the
    accuracy per variant when trained."""
    require("matplotlib", "the ablation figure").use("Agg")
    plt = require("matplotlib.pyplot", "the ablation figure")
    rows, s = result["rows"], result["settings"]
    trained = [r for r in rows if r["accuracy"]]
    width = max(5.0, 1.1 * len(rows) + 2)
    fig, axes = plt.subplots(1, 2 if trained else 1, figsize=(width * (2 if trained else 1), 4.2), dpi=110,
                             squeeze=False)
    ax, x = axes[0][0], list(range(len(rows)))
    bar = 0.8 / len(FIGURE_BARS)
    for j, (key, legend) in enumerate(FIGURE_BARS):
        offset = (j - (len(FIGURE_BARS) - 1) / 2) * bar
        ax.bar([i + offset for i in x], [r["metrics"][key]["mean"] for r in rows], bar, label=legend,
               yerr=[r["metrics"][key]["std"] for r in rows] if len(s["seeds"]) > 1 else None, capsize=2)
    ax.set_xticks(x, [r["label"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_xlabel("variant")
    ax.set_ylabel(f"fidelity at init ({s['images']} test images)")
    ax.set_ylim(0, 1.05)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    if trained:
        acc = axes[0][1]
        means = [100 * r["accuracy"]["mean"] for r in trained]
        spread = [100 * r["accuracy"]["std"] for r in trained] if len(s["seeds"]) > 1 else None
        acc.bar(range(len(trained)), means, 0.6, yerr=spread, capsize=3)
        acc.set_xticks(range(len(trained)), [r["label"] for r in trained], rotation=20, ha="right", fontsize=8)
        acc.set_xlabel("variant")
        acc.set_ylabel(f"{trained[0]['accuracy']['metric']} (%)")
        acc.set_ylim(max(0.0, min(means) - 10), min(100.0, max(means) + 5))
        acc.grid(axis="y", alpha=0.3)
    kwargs = f" {s['config']['model_kwargs']}" if s["config"]["model_kwargs"] else ""
    seeds = f", mean ± std over {len(s['seeds'])} seeds" if len(s["seeds"]) > 1 else ""
    fig.suptitle(f"ablation {s['ablation']}: {s['title']} ({s['recipe']}, {s['config']['model']}{kwargs}{seeds})",
                 fontsize=9)
    fig.tight_layout()
    write_png(Path(path), fig)


def _write(result: dict[str, Any], out: Path) -> None:
    write_json(out / "ablation.json", result)
    atomic_write_bytes(out / "ablation.md", lambda f: f.write(format_markdown(result).encode()))
    plot_ablation(result, out / "ablation.png")


def ablate(name: str, *, recipe: str = "cpu-cifar", data_dir: str | Path | None = None, seeds: int | list[int] = 1,
           images: int = 256, train: bool = False, out: str | Path | None = None, steps: int = DEFAULT_STEPS,
           progress: bool = False, repeats: int = 3, wait: bool = False, **overrides: Any) -> dict[str, Any]:
    """Run the ablation ``name`` (see :data:`ABLATIONS`) and
    write ``ablation.md``, ``ablation.json`` and ``ablation.png`` into ``out`` (default
    ``runs/ablate-<name>-<recipe>``). Returns what ``ablation.json`` holds: ``rows`` (one per
    variant: ``metrics`` {key: mean, std, per_seed}, ``init_s``, ``accuracy`` or None),
    ``settings`` and ``versions``.

    ``recipe`` and ``overrides`` (ImageConfig fields: ``model``, ``model_kwargs``, ``epochs``,
    ``train_size`` …) give the model every variant is built on and, with ``train=True``, the
    training; ``seeds`` is a count or a list; ``images`` the test images fidelity is measured
    on; ``steps`` the gd fit length; ``repeats`` the timed inits (median; gd once).
    ``out`` and the data are checked, and every variant planned on its model, before anything
    is measured; training reuses finished runs and resumes interrupted ones (:func:`compare`).
    """
    ablation_variants = variants(name, _count("steps", steps, "--steps"))
    seed_list, n_images = parse_seeds(seeds), _count("images", images, "--images")
    repeats = _count("repeats", repeats, "--repeats")
    with user_input("set"):
        owned = sorted(set(overrides) & set(OWNED["ablate"]))
        if owned:
            raise TypeError(f"ablate sets {', '.join(owned)} itself (the variants, the seeds and out); "
                            "do not pass them as training options")
        cfg = make_recipe(recipe, **({"data_dir": str(data_dir)} if data_dir is not None else {}), **overrides)
    out = Path(out if out is not None else f"runs/ablate-{name}-{recipe}")
    with user_input("out_dir"):
        check_out_dir(out)
    task = make_task(cfg)
    task.check()
    x, _, _ = test_images(cfg.dataset, cfg.data_dir, n_images, download=cfg.download)
    sizes, runs_dir = task.model_sizes(), out / "runs"
    _check_variants(name, cfg, ablation_variants, seed_list[0], runs_dir)
    configs = {v.key: [_variant_config(cfg, v, seed, runs_dir) for seed in seed_list] for v in ablation_variants}

    settings = {"ablation": name, "title": ABLATIONS[name].title, "question": ABLATIONS[name].question,
                "recipe": recipe, "data_dir": None if data_dir is None else str(data_dir), "config": cfg.to_dict(),
                "seeds": seed_list, "images_requested": n_images, "images": int(x.shape[0]), "steps": steps,
                "published_gd_steps": PUBLISHED_GD_STEPS, "repeats": repeats, "train": bool(train), "out": str(out)}
    settings["command"] = command_line(name, settings, overrides)
    result = {"settings": settings, "versions": versions(), "rows": []}
    for v in ablation_variants:
        per_seed, seconds = [], []
        for i, vcfg in enumerate(configs[v.key]):
            once = i > 0 or vcfg.init_options.get("solver") == "gd"
            values, secs = _measure(vcfg, sizes, x, 1 if once else repeats)
            per_seed.append(values)
            seconds += secs
        result["rows"].append(_row(v, per_seed, seconds, steps))
        if progress:
            m = result["rows"][-1]["metrics"]
            print(f"[ablate {name}] {v.label}: init {result['rows'][-1]['init_s']:.3f} s, real hit L1 "
                  f"{m['real_hit_l1']['mean']:.3f}, mean {m['real_hit_mean']['mean']:.3f}", file=sys.stderr, flush=True)
    _write(result, out)
    if train:
        for v, row in zip(ablation_variants, result["rows"]):
            summary = compare(_variant_base(cfg, v), [v.spec], seed_list, runs_dir / v.key, progress=progress,
                              wait=wait)[v.spec]
            row["accuracy"] = {"metric": summary["metric"], **mean_std(summary["accs"], "per_seed"),
                               "seeds": summary["seeds"]}
        _write(result, out)
    return result
