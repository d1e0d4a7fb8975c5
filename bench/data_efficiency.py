"""Data efficiency on real CIFAR-10 at CPU scale: does the init help a ViT trained on 5k images?

``structinit compare`` with the ``cpu-cifar`` recipe in fp32, and its flags: a class-stratified
5,000-image subset of training batches 1–4, evaluated on the last 10,000 training images (batch
5: lossless, unlike the test batch's JPEG-recovered images), ViT dim 128 / depth 6 / 4 heads /
patch 4, 30 epochs. Each init is trained with every seed (seed-major, resumable: rerun the
same command to continue). After the summary it prints impulse's gain over the better default.

    .venv/bin/python bench/data_efficiency.py                       # 4 inits × 3 seeds
    .venv/bin/python bench/data_efficiency.py --inits pytorch,impulse --seeds 1

The same protocol on the other architectures (``--model``; the ViT's recipe otherwise), and
with constructor arguments of the model (``--set model_kwargs=…``), e.g. a Swin built with
PyTorch's Linear defaults, so that a structured init is added to the same rest as on the ViT:

    .venv/bin/python bench/data_efficiency.py --model swin_cpu_patch2_32 --out runs/cpu-cifar-swin
    .venv/bin/python bench/data_efficiency.py --model swin_cpu_patch2_32 --inits mimetic,impulse \\
        --set 'model_kwargs={"weight_init": "pytorch"}' --out runs/cpu-cifar-swin-pytorch-rest
"""

from __future__ import annotations

import argparse
import sys

from common import DATA_DIR

from structinit.harness.cli.flags import add_training_flags, config_from_args, out_path
from structinit.harness.cli.main import OWNED
from structinit.harness.cli.messages import format_error
from structinit.harness.compare import compare
from structinit.harness.specs import parse_seeds, split_init_specs
from structinit.harness.summary import format_summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_flags(ap, OWNED["compare"])  # compare's own flags, --set included
    ap.add_argument("--inits", default="pytorch,timm,mimetic,impulse",
                    help="init specs, e.g. pytorch,impulse:pe_scale=2.0,target_mass=0.3 (';' between specs works too)")
    ap.add_argument("--seeds", default="3", help="a count (3 → seeds 0,1,2) or a list (0,4,7)")
    ap.add_argument("--out", default="runs/data-efficiency", type=out_path)
    # pinned, not "auto": a rerun on a CPU with native bf16 computes the same thing
    ap.set_defaults(recipe="cpu-cifar", precision="fp32", data_dir=DATA_DIR)
    args = ap.parse_args(argv)
    try:  # bad flags, settings and specs are named before the first run
        cfg = config_from_args(args, OWNED["compare"])
        summary = compare(cfg, split_init_specs(args.inits), parse_seeds(args.seeds), args.out,
                          progress=not args.no_progress, wait=args.wait)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(format_error(err, "compare"))  # in the words of compare's flags, which these are
    print(f"\n### {cfg.model}, CIFAR-10, 5,000 training images, held-out accuracy (last 10,000 training images)\n")
    print(format_summary(summary))
    means = {k: v["mean"] for k, v in summary.items()}
    if {"pytorch", "timm", "mimetic", "impulse"} <= set(means):
        gap = 100 * (means["impulse"] - max(means["pytorch"], means["timm"]))
        print(f"impulse − better default = {gap:+.2f} points (goal ≥ +3); "
              f"impulse − mimetic = {100 * (means['impulse'] - means['mimetic']):+.2f} points (goal ≥ +1)")


if __name__ == "__main__":
    main()
