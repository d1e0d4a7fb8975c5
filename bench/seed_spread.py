"""How far seeds of one init spread, over every result with per-seed data in
``docs/results/data/``: each cell's max − min accuracy over its seeds (points), the cells
sorted widest first, and how many spread more than a threshold.

    .venv/bin/python bench/seed_spread.py                 # every cell
    .venv/bin/python bench/seed_spread.py --over 2        # and the count over 2 points
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import markdown

DATA = Path(__file__).resolve().parents[1] / "docs" / "results" / "data"


def cells(folder: Path = DATA) -> list[tuple[str, str, float, int]]:
    """(file, cell, spread in points, seeds) of every per-seed result under ``folder`` (not its
    subfolders): compare's summaries ({init: {"accs": [...]}}) and data-size's nested
    {…: {seed: accuracy}} tables."""
    found = []

    def walk(name: str, obj, path: str) -> None:
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("accs"), list) and len(obj["accs"]) >= 2:
            accs = obj["accs"]
        elif obj and all(k.isdigit() and isinstance(v, (int, float)) for k, v in obj.items()) and len(obj) >= 2:
            accs = list(obj.values())
        else:
            for key, value in obj.items():
                if key != "_source" and not (key == "loss" or path.endswith("loss")):
                    walk(name, value, f"{path}/{key}" if path else key)
            return
        found.append((name, path, 100 * (max(accs) - min(accs)), len(accs)))

    for path in sorted(folder.glob("*.json")):
        walk(path.name, json.loads(path.read_text()), "")
    return sorted(found, key=lambda c: -c[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--over", type=float, default=2.0, help="count the cells that spread more than this (points)")
    args = p.parse_args(argv)
    found = cells()
    rows = [[name, cell, f"{spread:.2f}", seeds] for name, cell, spread, seeds in found]
    print(markdown(["data", "cell", "spread (points)", "seeds"], "llrr", rows))
    wider = sum(1 for c in found if c[2] > args.over)
    print(f"\n{wider} of {len(found)} cells spread more than {args.over:g} points; the widest {found[0][2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
