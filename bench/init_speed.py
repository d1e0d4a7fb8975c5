"""Whole-model init time of every attention scheme, with the model's own init as the reference.

On timm's ViT-Ti/16, ViT-B/16 and ViT-L/16 (built from code, no weights) each scheme is timed
in place on the same model as timm's own ``init_weights()``, so the ratio column says how many
"timm inits" a scheme costs. Each cell is the median of ``--repeats`` calls on 2 threads.
Needs timm: run it with the third-party venv (``bash scripts/setup_zoo.sh``).

    .venv-zoo/bin/python bench/init_speed.py
    .venv-zoo/bin/python bench/init_speed.py --models timm/vit_base_patch16_224 --schemes mimetic,mimetic:noise=uniform

Models without a timm prefix are structinit's own (``structinit.create_model``), with no
reference column. ``--against DIR`` times another checkout of structinit (e.g. a git worktree
of an older commit) side by side: the two alternate ``--rounds`` times in fresh interpreters
and each cell keeps its best round, so machine noise hits both alike.

    git worktree add /tmp/old <commit> && .venv/bin/python bench/init_speed.py --models vit_base_patch16_224 \\
        --against /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import median_seconds

MODELS = "timm/vit_tiny_patch16_224,timm/vit_base_patch16_224,timm/vit_large_patch16_224"
SCHEMES = "impulse,mimetic,timm,pytorch,jax,xavier"
REFERENCE = "timm init_weights()"


def build(name: str):
    import torch

    torch.manual_seed(0)
    if name.startswith("timm/"):
        import timm

        return timm.create_model(name.removeprefix("timm/"), pretrained=False)
    import structinit

    return structinit.create_model(name)


def measure(models: list[str], schemes: list[str], repeats: int) -> dict[str, dict[str, float]]:
    """{model: {column: median seconds}}, the reference column first for timm models."""
    import torch

    import structinit as si
    from structinit.harness.specs import parse_init_spec

    torch.set_num_threads(2)
    out: dict[str, dict[str, float]] = {}
    for name in models:
        model = build(name)
        row = out.setdefault(name, {})
        if name.startswith("timm/"):
            row[REFERENCE] = median_seconds(model.init_weights, repeats)
        for spec in schemes:
            scheme, options = parse_init_spec(spec)
            row[spec] = median_seconds(lambda m=model, s=scheme, o=options: si.init_(m, s, seed=0, **o), repeats)
        print(f"[{name}] " + ", ".join(f"{k} {v:.3f}s" for k, v in row.items()), file=sys.stderr, flush=True)
    return out


def run_in(tree: str | None, args) -> dict[str, dict[str, float]]:
    """``measure`` in a fresh interpreter, with ``tree`` first on the import path."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--worker", "--models", args.models, "--schemes", args.schemes,
           "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(best: dict[str, dict[str, float]]) -> str:
    """Markdown: one row per model, one column per scheme; ``s (×ratio)`` against the reference."""
    columns = list(dict.fromkeys(c for row in best.values() for c in row))
    lines = ["| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for model, row in best.items():
        ref = row.get(REFERENCE)
        cells = []
        for c in columns:
            t = row.get(c)
            if t is None:
                cells.append("")
            elif ref is None or c == REFERENCE:
                cells.append(f"{t:.3f}")
            else:
                cells.append(f"{t:.3f} (×{t / ref:.2f})")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS, help="comma-separated; timm/<name> or a structinit model name")
    ap.add_argument("--schemes", default=SCHEMES, help="comma-separated init specs, e.g. mimetic:noise=uniform")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="fresh-interpreter rounds per tree; each cell keeps its best")
    ap.add_argument("--against", default=None, help="another structinit checkout to time side by side")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.models.split(","), args.schemes.split(","), args.repeats)))
        return
    trees = {"this checkout": None} | ({args.against: args.against} if args.against else {})
    best: dict[str, dict[str, dict[str, float]]] = {}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            for model, row in run_in(tree, args).items():
                cells = best.setdefault(label, {}).setdefault(model, {})
                for column, seconds in row.items():
                    cells[column] = min(seconds, cells.get(column, float("inf")))
    for label, rows in best.items():
        if len(best) > 1:
            print(f"\n### {label}\n")
        print(table(rows))


if __name__ == "__main__":
    main()
