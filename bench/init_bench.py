"""Impulse fidelity at init on real CIFAR-10 test images (docs/results/impulse-fidelity.md). By
default, the init time and fidelity of every impulse solver on four ViTs, with the position-only
pseudo input and with real images. ``--hf`` instead sets a Hugging Face ``transformers`` ViT
beside the structinit ViT of the same size: the layout found, init time and fidelity, with and
without the old hints. ``--runs FOLDER …`` instead sets held-out accuracy against fidelity at
init, one row per init spec of those ``structinit compare`` folders (each run's model rebuilt as
the run built it; inits without impulse offsets are measured against the first impulse spec's),
with a figure.

    .venv/bin/python bench/init_bench.py                 # full run (≈ 20 min on 2 cores)
    .venv/bin/python bench/init_bench.py --quick         # smoke run
    .venv/bin/python bench/init_bench.py --hf            # needs transformers
    .venv/bin/python bench/init_bench.py --runs runs/c9 --figure runs/c9/fidelity_accuracy.png

The gd solver runs its full 10,000 steps on ``--gd-full-model`` only; elsewhere its time is
(time per step after warm-up) × 10,000 and its fidelity a ``--gd-fidelity-steps`` fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DATA_DIR, cifar_test_images, fidelity_row, markdown, pyplot, timed_init

import structinit as si
from structinit.harness.config import ImageConfig
from structinit.harness.finished import find_runs
from structinit.harness.run.checkpoint import write_png
from structinit.harness.summary import primary_metric
from structinit.harness.tasks.image import load_train_split, plan_model

GD_STEPS = 10_000


def fresh(name: str, seed: int):
    model = si.create_model(name)
    si.init_(model, "pytorch", seed=seed)  # the 2024 setting: everything else at PyTorch defaults
    return model


def gd_seconds_per_step(name: str, seed: int, steps: int = 30) -> float:
    model = fresh(name, seed)
    si.init_(model, "impulse", solver="gd", steps=5, seed=seed)  # warm-up
    start = time.perf_counter()
    si.init_(model, "impulse", solver="gd", steps=steps, seed=seed)
    return (time.perf_counter() - start) / steps


HF_CONFIG = dict(image_size=32, patch_size=4, hidden_size=192, num_attention_heads=3, num_hidden_layers=4,
                 intermediate_size=768, num_labels=10)


def hf_vit(seed: int):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    return ViTForImageClassification(ViTConfig(**HF_CONFIG))


def structinit_vit(seed: int):
    torch.manual_seed(seed)
    return si.models.VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=192, depth=4,
                                       num_heads=3, mlp_ratio=4.0, class_token=True, global_pool="token")


def hinted_options(model) -> dict:
    """The hints a user needed before position discovery, on HF's own learned table."""
    pe = model.vit.embeddings.position_embeddings.detach()[0, 1:]
    return dict(grid=(8, 8), num_prefix_tokens=1, pos_embed=pe, pe_scale=None, reserve="none")


HF_ROWS = [  # (label, model builder, the options: a function of the model); all impulse
    ("HF ViT: impulse, HF learned PE kept (old hints)", hf_vit, hinted_options),
    ("HF ViT: impulse, no hints (defaults)", hf_vit, lambda model: {}),
    ("structinit ViT same size: impulse defaults", structinit_vit, lambda model: {}),
]


def hf_table(images: torch.Tensor, seed: int, repeats: int) -> None:
    """--hf: per row, the layout found, the init time (median of ``repeats``) and real-image fidelity."""
    print(f"{len(images)} CIFAR-10 test images, seed {seed}, init time = median of {repeats}\n")
    rows = []
    for label, build, options in HF_ROWS:
        model, seconds = timed_init(lambda: build(seed), "impulse", seed, repeats, options)
        layout = si.infer_layout(model)
        where = si.find_position_embedding(model).pos_embed_name
        found = f"{layout.grid[0]}×{layout.grid[1]} + {layout.num_prefix_tokens} prefix, `{where}`"
        fidelity = fidelity_row(si.impulse_fidelity(model, images))
        rows.append([label, found, f"{seconds:.3f}", *(f"{v:.3f}" for v in fidelity)])
    print(markdown(["model and init", "layout found", "init s", "mass L1", "hit L1", "mass mean", "hit mean"],
                   "llrrrrr", rows))


def finished_runs(folders: list[Path]) -> dict[str, list[dict]]:
    """{run label: [result.json of each finished seed]} over every folder, in folder order."""
    runs: dict[str, list[dict]] = {}
    for folder in folders:
        try:  # a clear error for a folder that is missing or holds no finished run
            found = find_runs(folder, depth=2)
        except FileNotFoundError as err:
            sys.exit(f"error: --runs {folder}: {err}")
        for run in found:
            runs.setdefault(f"{folder.name}/{run.path.parent.name}", []).append(run.result)
    return runs


def fidelity_at_init(cfg: ImageConfig, train_ds, images, offsets) -> tuple[tuple, list | None]:
    """:func:`fidelity_row` of the run's model at init, and the offsets its impulse init recorded
    (None for other inits, which are then measured against ``offsets``)."""
    model, plan = plan_model(cfg, train_ds.image_shape, train_ds.num_classes)
    plan.commit()
    record = si.get_record(si.find_attention_layers(model)[0][1].module)
    fid = si.impulse_fidelity(model, images, offsets=None if record else offsets)
    return fidelity_row(fid), (record["offsets"] if record else None)


def accuracy_table(folders: list[Path], data_dir: str, images: torch.Tensor, figure: Path) -> None:
    """--runs: per init spec, held-out accuracy (mean ± std over seeds) and mean fidelity at init."""
    runs = finished_runs(folders)
    # Impulse runs first, so that inits without offsets are measured against a real impulse draw.
    order = sorted(runs, key=lambda k: runs[k][0]["config"]["init"] != "impulse")
    rows, offsets, datasets = [], None, {}
    for label in order:
        accs, fids = [], []
        for result in runs[label]:
            cfg = ImageConfig(**{**result["config"], "data_dir": data_dir})
            key = (cfg.dataset, cfg.data_dir)
            if key not in datasets:  # only the image shape and class count are needed
                datasets[key] = load_train_split(dataclasses.replace(cfg, train_size=10))
            fidelity, recorded = fidelity_at_init(cfg, datasets[key], images, offsets)
            offsets = offsets or recorded
            accs.append(result["final"][primary_metric(result["final"])])
            fids.append(fidelity)
        config = runs[label][0]["config"]
        spec = config["init"] + "".join(f",{k}={v}" for k, v in config["init_options"].items())
        mean = [statistics.fmean(f[i] for f in fids) for i in range(4)]
        rows.append((label, spec, len(accs), statistics.fmean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     *mean))
    print(f"\n### Held-out accuracy against real-image fidelity at init ({len(images)} CIFAR-10 test images)\n")
    cells = [[label, spec, n, f"{100 * acc:.2f} ± {100 * std:.2f}", *(f"{v:.3f}" for v in fidelity)]
             for label, spec, n, acc, std, *fidelity in sorted(rows, key=lambda r: -r[3])]
    print(markdown(["run folder", "init", "seeds", "held-out acc %", "mass L1", "hit L1", "mass mean", "hit mean"],
                   "llrrrrrr", cells))
    plot_accuracy(rows, figure)


def plot_accuracy(rows, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, (col, name) in zip(axes, [(8, "argmax hit on target, mean over layers"),
                                       (7, "attention mass on target, mean over layers")]):
        for row in rows:
            ax.errorbar(row[col], 100 * row[3], yerr=100 * row[4], fmt="o", capsize=3,
                        label=f"{row[1]} ({row[2]} seed{'s' if row[2] > 1 else ''})")
        ax.set(xlabel=f"{name} (real images, at init)", xlim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy % (mean ± std over seeds)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Does keeping the structure pay? (cpu-cifar, CIFAR-10 5k images)")
    fig.tight_layout()
    print(f"\nfigure: {write_png(path, fig, dpi=120)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models",
                    default="vit_cpu_patch4_32,vit_tiny_patch2_32,vit_tiny_patch16_224,vit_base_patch16_224")
    ap.add_argument("--data-dir", default=DATA_DIR,
                    help="the folder that holds cifar-10-batches-py, that folder itself, or the .tar.gz")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fidelity-pe-scale", type=float, default=4.0,
                    help="pe_scale of the fidelity rows (the default, 1, is the one that trains best)")
    ap.add_argument("--sharp-mass", type=float, default=0.995, help="target_mass of the max-fidelity row")
    ap.add_argument("--gd-full-model", default="vit_tiny_patch2_32", help="model whose gd fit runs all 10k steps")
    ap.add_argument("--gd-fidelity-steps", type=int, default=1000, help="gd fit length for fidelity elsewhere")
    ap.add_argument("--solvers", default="analytic,closed_form,gd", help="which solvers' rows to run")
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 images, short gd, Ti models only")
    ap.add_argument("--hf", action="store_true", help="the Hugging Face ViT's table instead (needs transformers)")
    ap.add_argument("--repeats", type=int, default=3, help="init-time repeats of the --hf rows")
    ap.add_argument("--runs", type=Path, nargs="+", default=None, help="compare folder(s): accuracy against fidelity")
    ap.add_argument("--figure", type=Path, default=None,
                    help="--runs: the figure's PNG path (default: <first --runs>/fidelity_accuracy.png)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.hf:
        hf_table(cifar_test_images(args.data_dir, args.images), args.seed, args.repeats)
        return
    if args.runs:
        figure = args.figure or args.runs[0] / "fidelity_accuracy.png"
        accuracy_table(args.runs, str(args.data_dir), cifar_test_images(args.data_dir, args.images), figure)
        return
    models = args.models.split(",")
    if args.quick:
        args.images, args.gd_fidelity_steps, args.gd_full_model = 16, 100, ""
        models = [m for m in models if "base" not in m]
    images32 = cifar_test_images(args.data_dir, args.images)

    rows, speed = [], {}
    for name in models:
        size = si.create_model(name).patch_embed.img_size[0]
        images = images32 if size == 32 else F.interpolate(images32, size=size, mode="bilinear", align_corners=False)
        fid = {"solver": "analytic", "pe_scale": args.fidelity_pe_scale}
        variants = [
            ("analytic", {"solver": "analytic"}, 5),  # the defaults (pe_scale=1)
            (f"analytic, pe_scale={args.fidelity_pe_scale:g}", fid, 5),
            (f"analytic, pe_scale={args.fidelity_pe_scale:g}, target_mass={args.sharp_mass}",
             {**fid, "target_mass": args.sharp_mass}, 5),
            ("closed_form", {"solver": "closed_form"}, 1),
        ]
        full_gd = name == args.gd_full_model
        gd_steps = GD_STEPS if full_gd else args.gd_fidelity_steps
        variants.append((f"gd ({gd_steps} steps)", {"solver": "gd", "steps": gd_steps}, 1))
        for label, opts, repeats in [v for v in variants if v[1]["solver"] in args.solvers.split(",")]:
            model, seconds = timed_init(lambda: fresh(name, args.seed), "impulse", args.seed, repeats, lambda _: opts)
            time_note = ""
            if opts["solver"] == "gd" and not full_gd:
                seconds = gd_seconds_per_step(name, args.seed) * GD_STEPS
                time_note = " (per-step × 10k)"
            speed[(name, opts["solver"], label)] = seconds
            pe = fidelity_row(si.impulse_fidelity(model))
            real = fidelity_row(si.impulse_fidelity(model, images))
            # fidelity_row gives (mass L1, hit L1, mass mean, hit mean); the table shows the masses first
            rows.append([name, label, f"{seconds:.3f}{time_note}",
                         *(f"{fid[i]:.3f}" for fid in (pe, real) for i in (0, 2, 1, 3))])
            print(f"[{name}] {label}: {seconds:.3f}s  PE {pe}  real {real}", file=sys.stderr, flush=True)

    print(f"\n### Impulse init: time and fidelity ({args.images} CIFAR-10 test images, seed {args.seed})\n")
    fidelity = ["mass L1", "mass mean", "hit L1", "hit mean"]
    head = ["model", "solver", "init time (s)", *(f"PE {c}" for c in fidelity), *(f"real {c}" for c in fidelity)]
    print(markdown(head, "ll" + "r" * 9, rows))
    print("\n### Speed-up of analytic over closed_form (same run)\n")
    both = [(n, speed[n, "analytic", "analytic"], speed[n, "closed_form", "closed_form"]) for n in models
            if (n, "closed_form", "closed_form") in speed and (n, "analytic", "analytic") in speed]
    print(markdown(["model", "analytic (s)", "closed_form (s)", "ratio"], "lrrr",
                   [[n, f"{a:.3f}", f"{c:.3f}", f"{c / a:.0f}×"] for n, a, c in both]))


if __name__ == "__main__":
    main()
