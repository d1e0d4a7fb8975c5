"""Command line (``structinit …`` or ``python -m structinit …``), thin over the library:

    structinit train   --recipe cpu-cifar --data-dir DIR --init impulse [--resume]
    structinit train   --recipe cpu-cifar-lipschitz --data-dir DIR --init pytorch   (--loss hinge --certify 36/255)
    structinit compare --recipe digits --inits pytorch,timm,mimetic,impulse --seeds 3
    structinit compare --task copy:length=64 --model mamba_seq_2x64 --inits default,mimetic --seeds 5
    structinit demo    (init fidelity of every scheme)
    structinit attention --model vit_cpu_patch4_32 --init impulse,mimetic  |  --run RUN_DIR
    structinit cka RUN_A RUN_B
    structinit ablate kernel --recipe cpu-cifar --data-dir DIR [--train]
    structinit report COMPARE_OR_ABLATE_DIR

An error in what you typed (a flag's value, the data, --out, a checkpoint of another run) is
one line on stderr, ``structinit <command>: error: …``, naming the flag and the fix, with exit
status 2; --debug shows the traceback instead. A run whose loss diverged exits with 1.
Another process training the same run folder is refused (exit 2) unless --wait is given,
which waits for it. Ctrl-C exits with 130; the last finished epoch is kept for --resume.
"""

from __future__ import annotations

import argparse
import os
import sys

from structinit.harness.cli_errors import FIELD_FLAGS, UsageError, check_set_item, exit_code, format_error
from structinit.harness.errors import user_input
from structinit.harness.specs import parse_init_spec, split_init_specs
from structinit.models import list_models

# Commands that live in a module of their own, one per line. Each module has COMMAND (its
# name), HELP (one line), add_arguments(parser) and run(args) -> exit status; heavy imports
# stay inside run() so that `structinit --help` stays fast.
MODULE_COMMANDS = [
    "structinit.harness.attention_command",
    "structinit.harness.cka_command",
    "structinit.harness.ablate",
    "structinit.harness.report",
]



def radius(text: str) -> float:
    """A radius from the command line: a number (``0.1412``) or a fraction (``36/255``), read
    without eval.

    Examples:
        >>> radius("36/255") == 36 / 255, radius("0.5")
        (True, 0.5)
    """
    num, slash, den = text.partition("/")
    try:
        value = float(num) / float(den) if slash else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number or a fraction such as 36/255") from None
    return value


# TrainConfig fields that have a flag of their own, with the flag's type.
_TYPES = {"dataset": str, "data_dir": str, "model": str, "epochs": int, "batch_size": int, "lr": float,
          "train_size": int, "precision": str, "ema_decay": float, "augment": str, "eval_every": int,
          "loss": str, "certify_eps": radius}
_HELP = {"loss": "ce (default) or hinge: the multi-class hinge loss of certified training",
         "certify_eps": "ℓ₂ radius in pixel space, e.g. 36/255: adds certified (and final PGD) accuracy"}
# The fields each command sets itself: --set must not (its value would be silently replaced).
_OWNED = {"train": {"out_dir": "--out", "init": "--init", "init_options": "--init", "seed": "--seed"},
          "compare": {"out_dir": "--out", "init": "--inits", "seed": "--seeds"}}


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    from structinit.harness.recipes import RECIPES, SEQUENCE_RECIPES

    p.add_argument("--recipe", default=None, choices=sorted({*RECIPES, *SEQUENCE_RECIPES}),
                   help="base settings (default: digits; seq-cpu with --task)")
    for name, typ in _TYPES.items():
        p.add_argument(FIELD_FLAGS[name], dest=name, type=typ, default=None, help=_HELP.get(name),
                       metavar="EPS" if name == "certify_eps" else None)
    p.add_argument("--task", default=None, metavar="SPEC",
                   help="a sequence task instead of images: copy:length=64,vocab=16 or mqar:pairs=8,length=64")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps of a --task run")
    p.add_argument("--download", action="store_true", default=None, help="fetch the dataset if missing")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other TrainConfig field, e.g. --set warmup_epochs=5 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--wait", action="store_true",
                   help="if another process is training a run folder, wait for it instead of stopping")


def _add_debug_flag(p: argparse.ArgumentParser, default) -> None:
    # SUPPRESS on the sub-commands: their default would overwrite a --debug given before them
    p.add_argument("--debug", action="store_true", default=default, help="show the traceback of an error")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structinit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_debug_flag(parser, False)
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
    subs = [p_train, p_cmp, p_demo]
    for module in _command_modules():
        subs.append(sub.add_parser(module.COMMAND, help=module.HELP, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter))
        module.add_arguments(subs[-1])
    for p in subs:
        _add_debug_flag(p, argparse.SUPPRESS)
    return parser


def _command_modules():
    import importlib

    return [importlib.import_module(name) for name in MODULE_COMMANDS]


def _config(args: argparse.Namespace, **extra):
    from structinit.harness.recipes import recipe
    from structinit.harness.sequence_cli import check_recipe_kind, sequence_config

    if args.task is not None:
        return sequence_config(args, _OWNED[args.command], **extra)
    if args.steps is not None:
        raise UsageError("--steps sets the budget of a --task run; image runs count --epochs")
    overrides = {name: getattr(args, name) for name in _TYPES if getattr(args, name) is not None}
    for flag in ("download", "compile"):
        if getattr(args, flag):
            overrides[flag] = True
    for item in args.set:
        key, value = check_set_item(item, _OWNED[args.command])
        overrides[key] = value
    return recipe(check_recipe_kind(args), **{**overrides, **extra})


def _seeds(text: str) -> list[int]:
    try:
        return list(range(int(text))) if text.strip().isdigit() else [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(f"--seeds {text!r}: expected a count (3 means seeds 0, 1, 2) or a list (0,4,7)") from None


def _train(args: argparse.Namespace) -> int:
    from structinit.harness.train import train

    with user_input("init"):
        init, options = parse_init_spec(args.init)
    out = args.out or f"runs/{_run_name(args)}-{args.init.replace(':', '_')}-seed{args.seed}"
    cfg = _config(args, init=init, init_options=options, seed=args.seed, out_dir=out)
    if args.task is not None:
        from structinit.harness.train_sequence import train_sequence as train
    result = train(cfg, resume=args.resume, progress=not args.no_progress, wait=args.wait)
    if os.environ.get("RANK", "0") == "0":
        print({k: round(v, 4) for k, v in result["final"].items()}, f"→ {out}/result.json")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from structinit.harness.compare import compare, format_summary

    with user_input("init"):
        inits = split_init_specs(args.inits) + args.init
    seeds = _seeds(args.seeds)
    cfg = _config(args)
    out = args.out or f"runs/compare-{_run_name(args)}"
    summary = compare(cfg, inits, seeds, out, progress=not args.no_progress, wait=args.wait)
    print(format_summary(summary) + f"\n→ {out}/summary.md, summary.json, accuracy.png, report.html")
    return 0


def _run_name(args: argparse.Namespace) -> str:
    """The default folder name of a command's runs: the recipe, and the task spec if any."""
    from structinit.harness.compare import spec_label
    from structinit.harness.sequence_cli import check_recipe_kind

    recipe = check_recipe_kind(args)
    return recipe if args.task is None else f"{recipe}-{spec_label(args.task)}"


def _demo(args: argparse.Namespace) -> int:
    from structinit.harness.demo import fidelity_rows, format_table

    print(format_table(fidelity_rows(args.model, seed=args.seed),
                       f"{args.model}: attention at init, position-only pseudo input"))
    return 0


_COMMANDS = {"train": _train, "compare": _compare, "demo": _demo}


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns the exit status (errors in the input: 2, see the module docstring)."""
    args = _parser().parse_args(argv)
    commands = {**_COMMANDS, **{m.COMMAND: m.run for m in _command_modules()}}
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        keep = {"train": "; the last finished epoch is kept: run it again with --resume to continue",
                "compare": "; finished runs and epochs are kept: run it again to continue"}.get(args.command, "")
        print(f"structinit {args.command}: interrupted{keep}", file=sys.stderr)
        return 130
    except Exception as err:
        code = exit_code(err)
        if args.debug or code is None:  # a bug, or asked for: the whole traceback
            raise
        print(format_error(err, args.command), file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
