"""Whole-model init time of every scheme on three ViTs, optionally side by side with another
checkout of structinit (to check that a change did not slow the inits down).

Each (model, scheme) is the median over ``--repeats`` fresh models. With ``--against DIR`` the
same measurement also runs with ``DIR`` (a checkout of structinit, e.g. a git worktree of an
older commit) first on the import path; the two alternate ``--rounds`` times and each cell
keeps its best round, so that machine noise hits both alike.

    .venv/bin/python bench/init_speed.py
    git worktree add /tmp/old <commit> && .venv/bin/python bench/init_speed.py --against /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = "vit_cpu_patch4_32,vit_tiny_patch2_32,vit_base_patch16_224"
SCHEMES = "impulse,mimetic,timm,pytorch"


def measure(models: list[str], schemes: list[str], repeats: int) -> dict[str, float]:
    """Median init seconds per 'model/scheme'."""
    import torch

    import structinit as si

    torch.set_num_threads(2)
    out = {}
    for name in models:
        for scheme in schemes:
            times = []
            for _ in range(repeats):
                model = si.create_model(name)
                start = time.perf_counter()
                si.init_(model, scheme, seed=0)
                times.append(time.perf_counter() - start)
            out[f"{name}/{scheme}"] = statistics.median(times)
    return out


def run_in(tree: str | None, args) -> dict[str, float]:
    """``measure`` in a fresh interpreter, with ``tree`` first on the import path."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--worker", "--models", args.models, "--schemes", args.schemes,
           "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--schemes", default=SCHEMES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--against", default=None, help="another structinit checkout to time side by side")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.models.split(","), args.schemes.split(","), args.repeats)))
        return
    trees = {"this": None} | ({"against": args.against} if args.against else {})
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            for key, seconds in run_in(tree, args).items():
                best.setdefault(label, {})[key] = min(seconds, best.get(label, {}).get(key, float("inf")))
    keys = list(best["this"])
    if args.against:
        print(f"| model | scheme | {args.against} (s) | this checkout (s) | this / against |\n|---|---|---:|---:|---:|")
        for key in keys:
            a, t = best["against"][key], best["this"][key]
            print(f"| {key.replace('/', ' | ')} | {a:.4f} | {t:.4f} | {t / a:.2f} |")
    else:
        print("| model | scheme | init (s) |\n|---|---|---:|")
        for key in keys:
            print(f"| {key.replace('/', ' | ')} | {best['this'][key]:.4f} |")


if __name__ == "__main__":
    main()
