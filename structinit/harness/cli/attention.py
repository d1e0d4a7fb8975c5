"""``structinit attention``: pictures of the attention, at init or before and after training.

    structinit attention --model vit_cpu_patch4_32 --init impulse,mimetic,pytorch \\
        --dataset cifar10 --data-dir DIR
    structinit attention --run runs/compare-cpu-cifar/impulse/seed0

With ``--model`` and ``--init``: for every init, the N×N map of every head at the chosen
layers (default: first, middle, last) with a zoom on its top-left block, the attention of a
few query tokens laid over an image, and (several inits) one figure comparing them side by
side at the first chosen layer. With ``--run``: the same maps at initialisation (rebuilt from
the run's config and checked against its fingerprint) and after training, side by side on the
same images, with impulse fidelity, mean attention distance, entropy and local mass of both.

Without a dataset the maps come from the position-only pseudo input LayerNorm(PE) fed to
every layer, as in the papers (content-free tokens for a layer with a relative position bias);
with one, from the first ``--images`` test images. A windowed layer (Swin) shows the first
window's map, with no overlay; an MLP-Mixer shows each token-mixing MLP's N×N map
(:mod:`structinit.analysis.token_mixing`) as one head, scored against its tap.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from structinit.adapters import (
    ModelSurvey,
    TokenLayout,
    adapter_for,
    find_attention_layers,
    find_token_mixing_layers,
    is_token_mixing,
    select_layers,
    token_grid,
)
from structinit.analysis import (
    attention_figure,
    attention_maps,
    attention_metrics,
    comparison_figure,
    impulse_fidelity,
    overlay_figure,
)
from structinit.analysis.fidelity import layer_layouts, position_only_layers
from structinit.analysis.figures import COLORBAR_LABEL, MIXING_LABEL
from structinit.analysis.token_mixing import token_mixing_fidelity, token_mixing_maps
from structinit.harness.cli.flags import UsageError, out_path
from structinit.harness.errors import user_input
from structinit.harness.finished import load_run, models_of
from structinit.harness.run.checkpoint import atomic_write_bytes
from structinit.harness.run.folder import check_out_dir
from structinit.harness.specs import parse_init_spec, spec_label, split_init_specs
from structinit.harness.tasks.image import test_images
from structinit.models import create_model
from structinit.schemes.records import get_record, set_record
from structinit.schemes.registry import init_
from structinit.utils.optional_imports import require

COMMAND = "attention"
HELP = "attention-map figures of inits (--model/--init) or of a run before and after training (--run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a registered model (see structinit.list_models()), with --init")
    src.add_argument("--run", help="a finished run folder (structinit train --out / a compare run)")
    p.add_argument("--init", default="impulse", help="comma-separated init specs for --model (default impulse)")
    p.add_argument("--layers", default=None, help="attention layer indices, e.g. 0,3,-1 (default: first, middle, last)")
    p.add_argument("--dataset", default=None, help="images to look at (default: the run's; none: position only)")
    p.add_argument("--data-dir", dest="data_dir", default=None, help="where the --dataset files are read from")
    p.add_argument("--images", type=int, default=8, help="test images averaged in the metrics (default 8)")
    p.add_argument("--queries", default=None, help="grid tokens for the overlays (default: corner, centre, far corner)")
    p.add_argument("--seed", type=int, default=0, help="init seed for --model (default 0)")
    p.add_argument("--out", default=None, type=out_path, help="output folder (default runs/attention-<model or run>)")


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers, e.g. 0,3,-1") from None


def _images(dataset: str | None, data_dir: str | None, n: int):
    """(normalised images, the same in [0, 1]) of the first ``n`` test images, or (None, None)
    for no dataset (``None``, or ``none`` as ``--dataset`` says it: position only)."""
    return (None, None) if _position_only(dataset) else test_images(dataset, data_dir, n)[:2]


def _position_only(dataset: str | None) -> bool:
    return dataset is None or str(dataset).strip().lower() == "none"


def _is_mixer(model) -> bool:
    """No attention, token-mixing MLPs: its maps are the MLPs' (structinit.analysis.token_mixing)."""
    return (not any(adapter_for(m) is not None for m in model.modules())
            and any(is_token_mixing(m) for m in model.modules()))


def _maps(model, layers, images):
    """Per chosen layer: the (heads, T, T) maps of the first image (its first window for a
    windowed layer) or of position only; the layout each is drawn in (layers may differ: a
    class token that joins later, another window); whether one map covers the whole image (so
    it can be laid over it); and the colour bar's label. A Mixer's maps are signed Jacobians,
    drawn by magnitude."""
    if _is_mixer(model):  # one map per layer, shown as one head
        maps = token_mixing_maps(model, None if images is None else images[:1], layers)
        layout = TokenLayout(token_grid(model, maps[0].shape[-1]))
        return [m.abs()[None] for m in maps], [layout] * len(maps), True, MIXING_LABEL
    survey = ModelSurvey(model)
    with user_input("layers"):
        chosen = select_layers(survey.layers(), layers)
        layouts = layer_layouts(survey, chosen)
    if images is None:  # the model's own maps, each chosen layer fed its position-only input
        with user_input("dataset"):
            full = [real.probs for real, _ in position_only_layers(survey, chosen, layouts)]
    else:
        full = attention_maps(model, images[:1], layers=layers)
    return [m[0] for m in full], layouts, all(m.shape[0] == 1 for m in full), COLORBAR_LABEL


def _resolve_layers(model, layers: list[int] | None) -> list[int]:
    """The chosen layer indices (attention, or a Mixer's token-mixing MLPs), checked and
    non-negative (default: first, middle, last)."""
    found = find_token_mixing_layers(model) if _is_mixer(model) else find_attention_layers(model)
    if layers is None:
        return sorted({0, len(found) // 2, len(found) - 1})
    with user_input("layers"):
        select_layers(found, layers)
    return [i % len(found) for i in layers]


def _metrics(model, images, layers, offsets=None) -> dict:
    """Per chosen layer and head: impulse fidelity (when the model has impulse offsets) and the
    attention metrics, on ``images`` (or position only: fidelity alone). A Mixer's token-mixing
    maps get fidelity only (they are not probabilities)."""
    out = {}
    try:
        if _is_mixer(model):
            fid = {k: v[:, None] for k, v in token_mixing_fidelity(model, images, layers).items()}
        else:
            fid = impulse_fidelity(model, images, layers=layers, offsets=offsets)
        out |= {"hit": fid["hit"].tolist(), "mass": fid["mass"].tolist()}
    except ValueError as err:
        if "offsets" not in str(err) and "no impulse record" not in str(err):  # no record: no fidelity
            raise
    if images is not None and not _is_mixer(model):
        out |= {k: v.tolist() for k, v in attention_metrics(model, images, layers=layers).items()}
    return out


def _summary_line(label: str, layer: int, metrics: dict, row: int) -> str:
    def mean(key):
        values = [v for v in metrics[key][row] if v == v]  # NaN-free
        return f"{sum(values) / len(values):.3f}" if values else "–"

    cols = [mean(k) if k in metrics else "–" for k in ("hit", "mass", "distance", "distance_px", "entropy",
                                                         "local_mass")]
    return f"| {label} | {layer} | " + " | ".join(cols) + " |"


TABLE_HEAD = ("| model | layer | impulse hit | impulse mass | distance (patches) | distance (pixels) | entropy (nats) "
              "| 3×3 mass |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def _model_figures(args, out: Path, images, raw, layers) -> list[str]:
    with user_input("init"):
        specs = split_init_specs(args.init)
        parsed = [parse_init_spec(s) for s in specs]
    firsts, lines = {}, [TABLE_HEAD]
    for spec, (name, options) in zip(specs, parsed):
        with torch.random.fork_rng(devices=[]), user_input("model"):
            torch.manual_seed(args.seed)
            model = create_model(args.model, **({} if images is None else
                                                {"img_size": images.shape[-1], "in_chans": images.shape[1]}))
        with user_input("init"):
            init_(model, name, seed=args.seed, **options)
        layers_here = _resolve_layers(model, layers)
        maps, shown, whole, label = _maps(model, layers_here, images)
        tag = spec_label(spec)
        source = "position-only input" if images is None else "first test image"
        attention_figure(maps, shown, layer_names=[f"layer {i}" for i in layers_here], path=out / f"maps_{tag}.png",
                         title=f"{args.model}, init {spec}, {source}", label=label)
        if raw is not None and whole:  # a window's map does not cover the image: no overlay
            overlay_figure(raw[0], maps[0], shown[0], _queries(args, shown[0]), path=out / f"overlay_{tag}.png",
                           title=f"{args.model}, init {spec}, layer {layers_here[0]}", label=label)
        firsts[spec] = maps[0]
        metrics = _metrics(model, images, layers_here)
        lines += [_summary_line(spec, layer, metrics, r) for r, layer in enumerate(layers_here)]
    if len(firsts) > 1:
        comparison_figure(firsts, shown[0], path=out / "comparison.png",
                          title=f"{args.model} at init, layer {layers_here[0]}, {source}", label=label)
    return lines


def _queries(args, layout) -> list[int]:
    q = _ints(args.queries, "--queries")
    h, w = layout.grid
    if q is not None and not all(0 <= i < h * w for i in q):
        raise UsageError(f"--queries {args.queries}: grid token indices must lie in 0 … {h * w - 1} ({h}×{w} grid)")
    return q if q is not None else [0, (h // 2) * w + w // 2, h * w - 1]


def _run_figures(args, out: Path, layers) -> list[str]:
    with user_input("run"):
        run = load_run(args.run)
    cfg = run.config
    # the run's own images give the models their input shape, whatever --dataset shows them
    own, _ = _images(cfg.dataset, cfg.data_dir if args.dataset else args.data_dir or cfg.data_dir, 1)
    images, raw = (None, None) if _position_only(args.dataset) and args.dataset else _images(
        args.dataset or cfg.dataset, args.data_dir or cfg.data_dir, args.images)
    if images is not None and images.shape[1:] != own.shape[1:]:
        raise UsageError(f"--dataset {args.dataset}: its images are {tuple(images.shape[1:])}, but the run trained "
                         f"on {cfg.dataset} images of {tuple(own.shape[1:])}; show it images of its own kind, or "
                         "--dataset none for position only")
    with user_input("run"):
        initial, trained = models_of(run, tuple(own.shape[1:]), run.num_classes)
    layers = _resolve_layers(initial, layers)
    offsets = None
    if not _is_mixer(initial):
        found = find_attention_layers(initial)
        records = [get_record(found[i][1].module, "impulse") for i in layers]
        offsets = [r["offsets"] for r in records] if all(records) else None
    lines = [TABLE_HEAD]
    maps = {}
    for when, tag, model in (("at init", "init", initial), ("trained", "trained", trained)):
        if _is_mixer(model) and model is trained:  # a record lives only in the process that initialised the
            # model: lend the init's impulse records of each token-mixing MLP to its trained twin
            for (_, a), (_, b) in zip(find_token_mixing_layers(initial), find_token_mixing_layers(trained)):
                set_record(b, "impulse", get_record(a, "impulse"))
        model_maps, shown, whole, label = _maps(model, layers, images)
        for layer, m, lay in zip(layers, model_maps, shown):
            maps[f"{when}, layer {layer}"] = m, lay
        metrics = _metrics(model, images, layers, offsets=offsets)
        lines += [_summary_line(when, layer, metrics, r) for r, layer in enumerate(layers)]
        if whole and raw is not None:
            overlay_figure(raw[0], model_maps[0], shown[0], _queries(args, shown[0]), path=out / f"overlay_{tag}.png",
                           title=f"{run.label}, {when}, layer {layers[0]}", label=label)
    ordered = {k: maps[k] for layer in layers for k in (f"at init, layer {layer}", f"trained, layer {layer}")}
    comparison_figure({k: m for k, (m, _) in ordered.items()}, [lay for _, lay in ordered.values()],
                      path=out / "before_after.png",
                      title=f"{run.label} ({cfg.model}): attention at init and after training, first test image",
                      label=label)
    return lines


def run(args: argparse.Namespace) -> int:
    name = args.model or Path(args.run).resolve().name
    out = Path(args.out or f"runs/attention-{name}")
    with user_input("out_dir"):
        check_out_dir(out)
    layers = _ints(args.layers, "--layers")
    plt = require("matplotlib.pyplot", "structinit attention's figures")

    try:
        if args.run:
            out.mkdir(parents=True, exist_ok=True)
            lines = _run_figures(args, out, layers)
        else:
            images, raw = _images(args.dataset, args.data_dir, args.images)
            out.mkdir(parents=True, exist_ok=True)
            lines = _model_figures(args, out, images, raw, layers)
    finally:
        plt.close("all")  # the figures are written; a long session (or a test run) must not keep them
    table = "\n".join(lines)
    atomic_write_bytes(out / "attention.md", lambda f: f.write(f"{table}\n".encode()))
    record = json.dumps({"args": vars(args), "table": lines}, indent=1, default=str)
    atomic_write_bytes(out / "attention.json", lambda f: f.write(record.encode()))
    print(table)
    print(f"→ {out}/ ({', '.join(sorted(p.name for p in out.glob('*.png')))})")
    return 0
