"""Command line: ``structinit demo`` (also ``python -m structinit demo``)."""

from __future__ import annotations

import argparse

from structinit.demo import fidelity_rows, format_table
from structinit.models import list_models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structinit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="initialise a ViT with every scheme and print impulse fidelity")
    demo.add_argument("--model", default="vit_tiny_patch4_32", choices=list_models())
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        rows = fidelity_rows(args.model, seed=args.seed)
        print(format_table(rows, f"{args.model}: attention at init, position-only pseudo input"))
    return 0
