"""Init speed and impulse fidelity of every impulse solver, on four ViTs, in one run.

For each model (the ``cpu-cifar`` training model and three paper-size ViTs) and solver:
whole-model init time, and fidelity (mean attention mass on the target, argmax hit rate;
layer 1 and mean over layers) with the position-only pseudo input and with real CIFAR-10
test images (0 … n−1, the exact ones; resized to 224 for the 224 models). The gd solver is
timed in full on ``--gd-full-model`` (ViT-Ti/2); on the others its time is (time per step,
measured after warm-up) × 10,000 and its fidelity comes from a ``--gd-fidelity-steps`` fit.
Analytic runs at its defaults (``pe_scale=1``, the scale that trains best), at the fidelity
scale ``pe_scale=4`` (the structure survives real content in every layer), and at
``pe_scale=4`` with its maximum-fidelity sharpness.

    .venv/bin/python bench/init_bench.py                 # full run (≈ 20 min on 2 cores)
    .venv/bin/python bench/init_bench.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from common import DATA_DIR, cifar_test_images, fidelity_row, markdown, timed_init

import structinit as si

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
    args = ap.parse_args()
    torch.set_num_threads(2)
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
            rows.append((name, label, f"{seconds:.3f}{time_note}", *pe, *real))
            print(f"[{name}] {label}: {seconds:.3f}s  PE {pe}  real {real}", file=sys.stderr, flush=True)

    print(f"\n### Impulse init: time and fidelity ({args.images} CIFAR-10 test images, seed {args.seed})\n")
    print("| model | solver | init time (s) | PE mass L1 | PE mass mean | PE hit L1 | PE hit mean "
          "| real mass L1 | real mass mean | real hit L1 | real hit mean |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, label, secs, pm1, ph1, pmm, phm, rm1, rh1, rmm, rhm in rows:
        print(f"| {name} | {label} | {secs} | {pm1:.3f} | {pmm:.3f} | {ph1:.3f} | {phm:.3f} "
              f"| {rm1:.3f} | {rmm:.3f} | {rh1:.3f} | {rhm:.3f} |")
    print("\n### Speed-up of analytic over closed_form (same run)\n")
    both = [(n, speed[n, "analytic", "analytic"], speed[n, "closed_form", "closed_form"]) for n in models
            if (n, "closed_form", "closed_form") in speed and (n, "analytic", "analytic") in speed]
    print(markdown(["model", "analytic (s)", "closed_form (s)", "ratio"], "lrrr",
                   [[n, f"{a:.3f}", f"{c:.3f}", f"{c / a:.0f}×"] for n, a, c in both]))


if __name__ == "__main__":
    main()
