"""Data efficiency on real CIFAR-10 at CPU scale: does the init help a ViT trained on 5k images?

The ``cpu-cifar`` recipe: a class-stratified 5,000-image subset of training batches 1–4,
evaluated on the last 10,000 training images (batch 5: lossless, unlike the test batch's
JPEG-recovered images), ViT dim 128 / depth 6 / 4 heads / patch 4, 30 epochs. Each init is
trained with every seed (seed-major, resumable: rerun the same command to continue).

    .venv/bin/python bench/data_efficiency.py                       # 4 inits × 3 seeds (≈ 85 min)
    .venv/bin/python bench/data_efficiency.py --inits pytorch,impulse --seeds 0

The same protocol on the other architectures (``--model``; the ViT's recipe otherwise):

    .venv/bin/python bench/data_efficiency.py --model swin_cpu_patch2_32 --out runs/cpu-cifar-swin
    .venv/bin/python bench/data_efficiency.py --model mixer_cpu_patch4_32 --out runs/cpu-cifar-mixer

``--model-kwargs`` passes constructor arguments, e.g. a Swin built with PyTorch's Linear
defaults, so that a structured init is added to the same rest as on the ViT and the Mixer:

    .venv/bin/python bench/data_efficiency.py --model swin_cpu_patch2_32 --inits mimetic,impulse \
        --model-kwargs '{"weight_init": "pytorch"}' --out runs/cpu-cifar-swin-pytorch-rest
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from structinit.harness.compare import compare
from structinit.harness.recipes import recipe
from structinit.harness.specs import split_init_specs
from structinit.harness.summary import format_summary

DEFAULT_INITS = "pytorch,timm,mimetic,impulse"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=Path("../shared/datasets"))
    ap.add_argument("--inits", default=DEFAULT_INITS,
                    help="init specs, e.g. pytorch,impulse:pe_scale=2.0,target_mass=0.3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=None, help="override the recipe's 30 epochs")
    ap.add_argument("--model", default=None, help="a registered model instead of the recipe's ViT, "
                                                   "e.g. swin_cpu_patch2_32, mixer_cpu_patch4_32")
    ap.add_argument("--model-kwargs", default=None, metavar="JSON",
                    help='constructor arguments of the model as a JSON object, e.g. \'{"weight_init": "pytorch"}\'')
    ap.add_argument("--out", default="runs/data-efficiency")
    args = ap.parse_args()
    if not (args.data_dir / "cifar-10-batches-py").is_dir():
        sys.exit(f"error: {args.data_dir}/cifar-10-batches-py not found: pass --data-dir (CIFAR-10 python batches)")
    inits = split_init_specs(args.inits)
    # pinned, not "auto": a rerun on a CPU with native bf16 computes the same thing
    overrides = {"data_dir": str(args.data_dir), "precision": "fp32"} | ({"epochs": args.epochs} if args.epochs else {})
    if args.model:
        overrides["model"] = args.model
    if args.model_kwargs:
        try:
            overrides["model_kwargs"] = json.loads(args.model_kwargs)
        except json.JSONDecodeError as err:
            sys.exit(f"error: --model-kwargs {args.model_kwargs!r}: not a JSON object ({err})")
        if not isinstance(overrides["model_kwargs"], dict):
            sys.exit(f"error: --model-kwargs {args.model_kwargs!r}: expected a JSON object, "
                     """e.g. '{"weight_init": "pytorch"}'""")
    try:  # bad settings and specs are found before the first run, and named
        summary = compare(recipe("cpu-cifar", **overrides), inits, [int(s) for s in args.seeds.split(",")],
                          args.out, progress=False)
    except ValueError as err:
        sys.exit(f"error: {err}")
    model = args.model or recipe("cpu-cifar").model
    print(f"\n### {model}, CIFAR-10, 5,000 training images, held-out accuracy (last 10,000 training images)\n")
    print(format_summary(summary))
    means = {k: v["mean"] for k, v in summary.items()}
    if {"pytorch", "timm", "mimetic", "impulse"} <= set(means):
        best_default = max(means["pytorch"], means["timm"])
        gap = 100 * (means["impulse"] - best_default)
        print(f"impulse − better default = {gap:+.2f} points (goal ≥ +3); "
              f"impulse − mimetic = {100 * (means['impulse'] - means['mimetic']):+.2f} points (goal ≥ +1)")


if __name__ == "__main__":
    main()
