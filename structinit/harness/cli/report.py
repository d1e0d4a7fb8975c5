"""``structinit report``: one self-contained HTML page for a comparison or an ablation.

    structinit report runs/compare-digits                 # writes runs/compare-digits/report.html
    structinit report runs/compare-digits --out page.html

What the page shows: :mod:`structinit.harness.report.page`.
"""

from __future__ import annotations

import argparse

COMMAND = "report"
HELP = "write one self-contained HTML page (report.html) for a compare or ablate folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="a folder written by structinit compare (or structinit ablate)")
    p.add_argument("--out", default=None, metavar="FILE", help="the page to write (default FOLDER/report.html)")


def run(args: argparse.Namespace) -> int:
    from structinit.harness.report.page import write_report

    print(f"→ {write_report(args.folder, args.out)}")
    return 0
