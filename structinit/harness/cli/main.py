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
which waits for it. Ctrl-C exits with 130, SIGTERM with 143; the last finished epoch is kept for --resume.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings

import structinit
from structinit.analysis.fidelity import fidelity_rows, format_fidelity_table
from structinit.harness.ablation import OWNED
from structinit.harness.cli import ablate, attention, cka
from structinit.harness.cli.flags import add_training_flags, config_from_args, out_path, run_name
from structinit.harness.cli.messages import exit_code, format_error
from structinit.harness.compare import compare
from structinit.harness.errors import user_input
from structinit.harness.report.page import write_report
from structinit.harness.specs import parse_init_spec, parse_seeds, spec_label, split_init_specs
from structinit.harness.summary import format_summary
from structinit.harness.tasks import train
from structinit.models import list_models
from structinit.utils.optional_imports import require_harness

# Commands in a module of their own: each has COMMAND (its name), HELP (one line),
# add_arguments(parser) and run(args) -> exit status.
MODULE_COMMANDS = [attention, cka, ablate]
# The demo's inits (label, scheme, options); gd fits a tenth of the published 10,000 steps, so that the demo is quick.
DEMO_INITS: list[tuple[str, str, dict]] = [
    ("impulse analytic", "impulse", {"solver": "analytic"}),
    ("impulse analytic sharp", "impulse", {"solver": "analytic", "target_mass": 0.98}),
    ("impulse closed_form", "impulse", {"solver": "closed_form"}),
    ("impulse gd (1000 steps)", "impulse", {"solver": "gd", "steps": 1000}),
    ("mimetic", "mimetic", {}),
    *[(name, name, {}) for name in ("pytorch", "timm", "jax", "xavier", "xavier_fused")],
]


def _add_debug_flag(p: argparse.ArgumentParser, default) -> None:
    # SUPPRESS on the sub-commands: their default would overwrite a --debug given before them
    p.add_argument("--debug", action="store_true", default=default, help="show the traceback of an error")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structinit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_debug_flag(parser, False)
    parser.add_argument("--version", action="version", version=f"structinit {structinit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="train one model")
    add_training_flags(p_train, OWNED["train"])
    p_train.add_argument("--init", default="impulse", help="scheme, with options: impulse:target_mass=0.3")
    p_train.add_argument("--seed", type=int, default=0, help="seed of the data order, the model and its init")
    p_train.add_argument("--out", default=None, type=out_path, help="run folder (default runs/<recipe>-<init>-seed<k>)")
    p_train.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")

    p_cmp = sub.add_parser("compare", help="train several inits × seeds and summarise")
    add_training_flags(p_cmp, OWNED["compare"])
    p_cmp.add_argument("--inits", default="pytorch,timm,mimetic,impulse",
                       help="comma-separated init specs: pytorch,impulse:pe_scale=1.0,target_mass=0.3,mimetic")
    p_cmp.add_argument("--init", action="append", default=[], metavar="SPEC",
                       help="an extra init with options, e.g. impulse:target_mass=0.3,pe_scale=2 (repeatable)")
    p_cmp.add_argument("--seeds", default="3", help="a count (3 → seeds 0,1,2) or a list (0,4,7)")
    p_cmp.add_argument("--out", default=None, type=out_path, help="comparison folder (default runs/compare-<recipe>)")

    p_demo = sub.add_parser("demo", help="initialise a ViT with every scheme and print impulse fidelity")
    p_demo.add_argument("--model", default="vit_tiny_patch4_32", choices=list_models(),
                        help="the registered model to initialise (default vit_tiny_patch4_32)")
    p_demo.add_argument("--seed", type=int, default=0, help="the seed of every init (default 0)")

    p_report = sub.add_parser("report", help="write one self-contained HTML page (report.html) for a compare or "
                              "ablate folder")
    p_report.add_argument("folder", help="a folder written by structinit compare (or structinit ablate)")
    p_report.add_argument("--out", default=None, type=out_path, metavar="FILE",
                          help="the page to write (default FOLDER/report.html)")
    subs = [p_train, p_cmp, p_demo, p_report]
    for module in MODULE_COMMANDS:
        subs.append(sub.add_parser(module.COMMAND, help=module.HELP, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter))
        module.add_arguments(subs[-1])
    for p in subs:
        _add_debug_flag(p, argparse.SUPPRESS)
    return parser


def _train(args: argparse.Namespace) -> int:
    with user_input("init"):
        init, options = parse_init_spec(args.init)
    out = args.out or f"runs/{run_name(args)}-{spec_label(args.init)}-seed{args.seed}"
    cfg = config_from_args(args, OWNED["train"], init=init, init_options=options, seed=args.seed, out_dir=out)
    result = train(cfg, resume=args.resume, progress=not args.no_progress, wait=args.wait)
    if os.environ.get("RANK", "0") == "0":
        print({k: round(v, 4) for k, v in result["final"].items()}, f"→ {out}/result.json")
    return 0


def _compare(args: argparse.Namespace) -> int:
    with user_input("init"):
        inits = split_init_specs(args.inits) + args.init
    seeds = parse_seeds(args.seeds)
    cfg = config_from_args(args, OWNED["compare"])
    out = args.out or f"runs/compare-{run_name(args)}"
    summary = compare(cfg, inits, seeds, out, progress=not args.no_progress, wait=args.wait)
    print(format_summary(summary) + f"\n→ {out}/summary.md, summary.json, accuracy.png, report.html")
    return 0


def _demo(args: argparse.Namespace) -> int:
    print(format_fidelity_table(fidelity_rows(args.model, DEMO_INITS, seed=args.seed),
                                f"{args.model}: attention at init, position-only pseudo input"))
    return 0


def _report(args: argparse.Namespace) -> int:
    print(f"→ {write_report(args.folder, args.out)}")
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopping a command as Ctrl-C does: checkpoints are written atomically, so the last
    finished one is whole either way."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns the exit status (errors in the input: 2, see the module docstring)."""
    args = _parser().parse_args(argv)
    commands = {"train": _train, "compare": _compare, "demo": _demo, "report": _report,
                **{m.COMMAND: m.run for m in MODULE_COMMANDS}}
    in_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    formatted = warnings.formatwarning
    if not args.debug:  # a warning is one line, as an error is (not the source line that raised it)
        warnings.formatwarning = lambda message, *where, **kw: (
            f"structinit {args.command}: warning: {' '.join(str(message).split())}\n")
    try:
        if args.command != "demo":  # every other command trains, reads runs or draws: the harness extra
            require_harness(f"structinit {args.command}")
        return commands[args.command](args)
    except KeyboardInterrupt as stop:
        if args.debug:
            raise
        keep = {"train": "; the last finished epoch is kept: run it again with --resume to continue",
                "compare": "; finished runs and epochs are kept: run it again to continue"}.get(args.command, "")
        how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        print(f"structinit {args.command}: {how}{keep}", file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130
    except Exception as err:
        code = exit_code(err)
        if args.debug or code is None:  # a bug, or asked for: the whole traceback
            raise
        print(format_error(err, args.command), file=sys.stderr)
        return code
    finally:
        warnings.formatwarning = formatted
        if in_main_thread:
            signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(main())
