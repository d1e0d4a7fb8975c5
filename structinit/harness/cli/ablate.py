"""``structinit ablate NAME``: one reviewer question, answered at CPU scale.

    structinit ablate kernel --recipe cpu-cifar --data-dir DIR
    structinit ablate solvers --recipe digits --seeds 3
    structinit ablate sharpness --recipe digits --train --set epochs=10

Every variant of the ablation (``structinit.harness.ablation``: pseudo, kernel, heads,
offsets, sharing, sharpness, pe-scale, solvers) is built as a training run would build it
(same recipe, model and init seed) and measured at init: impulse fidelity (mean attention mass
on each head's target and argmax hit rate, layer 1 and mean over layers) with the
position-only pseudo input LayerNorm(PE) and with the first ``--images`` test images of the
recipe's dataset, the init's wall time, and at layer 1 the mean attention distance and the mass
inside the variant's k×k neighbourhood. With ``--train`` every variant is also trained with
the recipe (``structinit compare`` into ``<out>/runs``: finished runs are reused, interrupted
ones resume) and its accuracy added. The gd solver fits ``--steps`` steps instead of the
published 10,000; its time is also given scaled to 10,000 steps.

Writes ``ablation.md`` (the command line, then the table), ``ablation.json`` (rows, settings,
versions) and ``ablation.png`` into ``--out`` (default ``runs/ablate-<name>-<recipe>``).
"""

from __future__ import annotations

import argparse

from structinit.harness.ablation import ABLATIONS, DEFAULT_STEPS, OWNED, PUBLISHED_GD_STEPS, ablate, format_table
from structinit.harness.cli.flags import check_set_item, out_path
from structinit.harness.config import ImageConfig
from structinit.harness.recipes import RECIPES

COMMAND = "ablate"
HELP = "one ablation (kernel, heads, sharpness, solvers, …): fidelity at init, init time, optionally accuracy"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=list(ABLATIONS), metavar="NAME",
                   help=f"the ablation: {', '.join(ABLATIONS)}")
    p.add_argument("--recipe", default="cpu-cifar", choices=sorted(RECIPES), help="base settings (default cpu-cifar)")
    p.add_argument("--data-dir", dest="data_dir", default=None, help="where the recipe's dataset is")
    p.add_argument("--download", action="store_true", help="fetch the dataset if missing")
    p.add_argument("--model", default=None, help="another model than the recipe's")
    p.add_argument("--seeds", default="1", help="a count (3 → seeds 0,1,2) or a list (0,4,7); default 1")
    p.add_argument("--images", type=int, default=256, help="test images fidelity is measured on (default 256)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"gd fit steps (default {DEFAULT_STEPS}; published: {PUBLISHED_GD_STEPS})")
    p.add_argument("--repeats", type=int, default=3, help="timed inits per variant, the median is shown (default 3)")
    p.add_argument("--train", action="store_true", help="also train every variant and report its accuracy")
    p.add_argument("--epochs", type=int, default=None, help="with --train: epochs (default the recipe's)")
    p.add_argument("--train-size", dest="train_size", type=int, default=None, help="with --train: training images")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other ImageConfig field, e.g. --set model_kwargs={'patch_size':1} (repeatable)")
    p.add_argument("--out", default=None, type=out_path, help="output folder (default runs/ablate-<name>-<recipe>)")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.add_argument("--wait", action="store_true", help="with --train: wait for a run another process is training")


def run(args: argparse.Namespace) -> int:
    overrides = {k: getattr(args, k) for k in ("model", "epochs", "train_size") if getattr(args, k) is not None}
    if args.download:
        overrides["download"] = True
    overrides |= dict(check_set_item(item, OWNED[COMMAND], ImageConfig) for item in args.set)
    result = ablate(args.name, recipe=args.recipe, data_dir=args.data_dir, seeds=args.seeds,
                    images=args.images, train=args.train, out=args.out, steps=args.steps, repeats=args.repeats,
                    progress=not args.no_progress, wait=args.wait, **overrides)
    out = result["settings"]["out"]
    print(format_table(result["rows"]) + f"\n→ {out}/ablation.md, ablation.json, ablation.png")
    return 0


