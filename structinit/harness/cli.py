"""Command line (``structinit …`` or ``python -m structinit …``), thin over the library:

    structinit train   --recipe cpu-cifar --data-dir DIR --init impulse [--resume]
    structinit compare --recipe digits --inits pytorch,timm,mimetic,impulse --seeds 3
    structinit demo    (init fidelity of every scheme)
"""

from __future__ import annotations

import argparse
import os
import sys

from structinit.harness.specs import parse_init_spec, parse_literal, split_init_specs
from structinit.models import list_models

# Flags that set a TrainConfig field directly: flag → (field, type).
_FIELDS = {"--dataset": ("dataset", str), "--data-dir": ("data_dir", str), "--model": ("model", str),
           "--epochs": ("epochs", int), "--batch-size": ("batch_size", int), "--lr": ("lr", float),
           "--train-size": ("train_size", int), "--precision": ("precision", str),
           "--ema-decay": ("ema_decay", float), "--augment": ("augment", str), "--eval-every": ("eval_every", int)}


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    from structinit.harness.recipes import RECIPES

    p.add_argument("--recipe", default="digits", choices=sorted(RECIPES), help="base settings (default: digits)")
    for flag, (name, typ) in _FIELDS.items():
        p.add_argument(flag, dest=name, type=typ, default=None)
    p.add_argument("--download", action="store_true", default=None, help="fetch the dataset if missing")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other TrainConfig field, e.g. --set warmup_epochs=5 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config(args: argparse.Namespace, **extra):
    from structinit.harness.recipes import recipe

    overrides = {name: getattr(args, name) for name, _ in _FIELDS.values() if getattr(args, name) is not None}
    for flag in ("download", "compile"):
        if getattr(args, flag):
            overrides[flag] = True
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.replace("-", "_")] = parse_literal(value)
    return recipe(args.recipe, **{**overrides, **extra})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structinit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="train one model")
    _add_training_flags(p_train)
    p_train.add_argument("--init", default="impulse", help="scheme, with options: impulse:target_mass=0.3")
    p_train.add_argument("--seed", type=int, default=0)
    p_train.add_argument("--out", default=None, help="run folder (default runs/<recipe>-<init>-seed<k>)")
    p_train.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")

    p_cmp = sub.add_parser("compare", help="train several inits × seeds and summarise")
    _add_training_flags(p_cmp)
    p_cmp.add_argument("--inits", default="pytorch,timm,mimetic,impulse",
                       help="comma-separated init specs: pytorch,impulse:pe_scale=1.0,target_mass=0.3,mimetic")
    p_cmp.add_argument("--init", action="append", default=[], metavar="SPEC",
                       help="an extra init with options, e.g. impulse:target_mass=0.3,pe_scale=2 (repeatable)")
    p_cmp.add_argument("--seeds", default="3", help="a count (3 → seeds 0,1,2) or a list (0,4,7)")
    p_cmp.add_argument("--out", default=None, help="comparison folder (default runs/compare-<recipe>)")

    p_demo = sub.add_parser("demo", help="initialise a ViT with every scheme and print impulse fidelity")
    p_demo.add_argument("--model", default="vit_tiny_patch4_32", choices=list_models())
    p_demo.add_argument("--seed", type=int, default=0)

    args = parser.parse_args(argv)
    if args.command == "demo":
        from structinit.harness.demo import fidelity_rows, format_table

        print(format_table(fidelity_rows(args.model, seed=args.seed),
                           f"{args.model}: attention at init, position-only pseudo input"))
    elif args.command == "train":
        from structinit.harness.train import train

        init, options = parse_init_spec(args.init)
        out = args.out or f"runs/{args.recipe}-{args.init.replace(':', '_')}-seed{args.seed}"
        cfg = _config(args, init=init, init_options=options, seed=args.seed, out_dir=out)
        result = train(cfg, resume=args.resume, progress=not args.no_progress)
        if os.environ.get("RANK", "0") == "0":
            print({k: round(v, 4) for k, v in result["final"].items()}, f"→ {out}/result.json")
    elif args.command == "compare":
        from structinit.harness.compare import compare, format_summary

        inits = split_init_specs(args.inits) + args.init
        seeds = list(range(int(args.seeds))) if args.seeds.isdigit() else [int(s) for s in args.seeds.split(",")]
        cfg = _config(args)
        out = args.out or f"runs/compare-{args.recipe}"
        summary = compare(cfg, inits, seeds, out, progress=not args.no_progress)
        print(format_summary(summary) + f"\n→ {out}/summary.md, summary.json, accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
