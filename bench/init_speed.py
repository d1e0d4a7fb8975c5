"""Whole-model init time of every attention scheme, with the model's own init as the reference
(docs/results/speed.md): on timm's ViT-Ti/16, ViT-B/16 and ViT-L/16 (built from code, no
weights) each scheme is timed beside timm's own ``init_weights()``, each call on a fresh copy of
the model (a user's first init), median of ``--repeats`` calls on 2 threads; models without
the ``timm/`` prefix are structinit's own.
``--floor`` times what no init of this design can skip (two forwards of one image, and mimetic's
factor maths alone) against timm's init. ``--checks`` instead times what checking every write
against the model's forward costs
(docs/results/zoo.md): ``init_`` against its probe before the write, its check after it and
one plain forward. ``--routes`` times the routes to the mimetic init's per-head products (the
best rank-r approximation of αZ + βI) on one ViT-B/16 layer, with each route's error against the
exact float64 truncation (docs/results/speed.md#mimetic-routes).

    .venv-zoo/bin/python bench/init_speed.py          # needs timm: bash scripts/setup_zoo.sh
    .venv-zoo/bin/python bench/init_speed.py --models timm/vit_base_patch16_224 --schemes mimetic,mimetic:noise=uniform
    .venv/bin/python bench/init_speed.py --checks
    .venv-zoo/bin/python bench/init_speed.py --floor --repeats 5
    .venv/bin/python bench/init_speed.py --routes

``--against DIR`` times another checkout of structinit side by side: the two alternate
``--rounds`` times in fresh interpreters and each cell keeps its best round.

    git worktree add /tmp/old <commit> && .venv/bin/python bench/init_speed.py --models vit_base_patch16_224 \\
        --against /tmp/old
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
from common import markdown, median_seconds

MODELS = "timm/vit_tiny_patch16_224,timm/vit_base_patch16_224,timm/vit_large_patch16_224"
SCHEMES = "impulse,mimetic,timm,pytorch,jax,xavier"
REFERENCE = "timm init_weights()"


def build(name: str):
    torch.manual_seed(0)
    if name.startswith("timm/"):
        import timm

        return timm.create_model(name.removeprefix("timm/"), pretrained=False)
    import structinit

    return structinit.create_model(name)


def measure(models: list[str], schemes: list[str], repeats: int) -> dict[str, dict[str, float]]:
    """{model: {column: median seconds}}, the reference column first for timm models."""
    import structinit as si
    from structinit.harness.specs import parse_init_spec

    torch.set_num_threads(2)
    out: dict[str, dict[str, float]] = {}
    for name in models:
        model = build(name)
        row = out.setdefault(name, {})
        if name.startswith("timm/"):
            row[REFERENCE] = fresh_seconds(model, lambda m: m.init_weights(), repeats)
        for spec in schemes:
            scheme, options = parse_init_spec(spec)
            row[spec] = fresh_seconds(model, lambda m, s=scheme, o=options: si.init_(m, s, seed=0, **o), repeats)
        print(f"[{name}] " + ", ".join(f"{k} {v:.3f}s" for k, v in row.items()), file=sys.stderr, flush=True)
    return out


def fresh_seconds(model: torch.nn.Module, init, repeats: int) -> float:
    """Median seconds of ``init(copy)`` on a fresh copy of ``model`` each time (the copy is not
    timed), after one untimed call: the cost of a user's first init of a model, which nothing
    learned from an earlier call on the same model can shorten."""
    init(copy.deepcopy(model))
    times = []
    for _ in range(repeats):
        fresh = copy.deepcopy(model)
        start = time.perf_counter()
        init(fresh)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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

    def cell(row: dict[str, float], column: str) -> str:
        t, ref = row.get(column), row.get(REFERENCE)
        if t is None:
            return ""
        return f"{t:.3f}" if ref is None or column == REFERENCE else f"{t:.3f} (×{t / ref:.2f})"

    rows = [[model, *(cell(row, c) for c in columns)] for model, row in best.items()]
    return markdown(["model", *columns], "l" + "r" * len(columns), rows)


CHECKED = {  # --checks: label → (structinit model, kwargs)
    "ViT-Ti/2 at 32 px (256 tokens)": ("vit_tiny_patch2_32", {}),
    "ViT-Ti/4 at 32 px (64 tokens)": ("vit_tiny_patch4_32", {}),
    "ViT-S/16 at 224 px (196 tokens)": ("vit_tiny_patch4_32", dict(img_size=224, patch_size=16, embed_dim=384,
                                                                    num_heads=6)),
}


def check_cost_row(label: str, name: str, kwargs: dict, scheme: str, repeats: int) -> list[str]:
    """The seconds of ``init_``, of its probe before the write, of its checks after it and of one
    forward of a probe image, each on a fresh copy of the model (a model keeps what its probe
    found, so a second init on the same model would skip the probe); and the checks' share."""
    import structinit
    from structinit.adapters.probe import probe_inputs
    from structinit.adapters.registry import candidate_layers
    from structinit.adapters.survey import attention_survey
    from structinit.schemes.registry import plan_init

    torch.manual_seed(0)
    base = structinit.create_model(name, **kwargs).eval()
    candidates, _ = candidate_layers(base)
    images = probe_inputs(base, candidates)

    def forward():
        with torch.no_grad():
            base(images[:1])

    def checks_after():
        model = copy.deepcopy(base)
        plan = plan_init(model, scheme, seed=0)
        plan.checks, checks = [], plan.checks
        plan.commit()
        start = time.perf_counter()
        for check in checks:
            check()
        return time.perf_counter() - start

    survey = lambda: attention_survey(copy.deepcopy(base))
    init = lambda: structinit.init_(copy.deepcopy(base), scheme, seed=0)
    t_forward, t_survey, t_init = (median_seconds(f, repeats) for f in (forward, survey, init))
    t_after = statistics.median(checks_after() for _ in range(repeats))
    share = (t_survey + t_after) / t_init
    return [label, f"`{scheme}`", *(f"{t:.3f}" for t in (t_init, t_survey, t_after, t_forward)), f"{share:.0%}"]


def check_cost_table(repeats: int) -> str:
    torch.set_num_threads(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = [check_cost_row(label, name, kwargs, scheme, repeats)
                for label, (name, kwargs) in CHECKED.items() for scheme in ("impulse", "mimetic")]
    return markdown(["model", "scheme", "init_ s", "probe before s", "check after s", "one forward s",
                     "checks' share of init_"], "llrrrrr", rows)


def floor_row(name: str, repeats: int) -> list[str]:
    """--floor: what no structured init of this design can skip on a timm ViT, against timm's own
    init: the two forwards of one probe image (the probe that reads the attention, the check
    after the write) and, for mimetic, the per-layer factor maths alone (its default circular
    noise: q/k factors per head, the D×D v/o factors)."""
    from structinit.functional.mimetic import mimetic_qk, mimetic_vo

    model = build(name).eval()
    image = torch.randn(1, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(0))
    attn = model.blocks[0].attn
    dim, heads, depth = model.embed_dim, attn.num_heads, len(model.blocks)

    def forwards():
        with torch.no_grad():
            model(image), model(image)

    def factors():
        gen = torch.Generator().manual_seed(0)
        for _ in range(depth):
            mimetic_qk(dim, heads, dim // heads, noise="circular", generator=gen, with_target=False)
            mimetic_vo(dim, dim, noise="circular", generator=gen, with_target=False)

    t_timm = fresh_seconds(model, lambda m: m.init_weights(), repeats)
    t_fwd, t_fac = median_seconds(forwards, repeats), median_seconds(factors, repeats)
    return [name, f"{t_timm:.3f}", f"{t_fwd:.3f} (×{t_fwd / t_timm:.2f})", f"{t_fac:.3f}",
            f"{t_fwd + t_fac:.3f} (×{(t_fwd + t_fac) / t_timm:.2f})"]


def floor_table(models: list[str], repeats: int) -> str:
    torch.set_num_threads(2)
    rows = [floor_row(name, repeats) for name in models if name.startswith("timm/")]
    return markdown(["model", REFERENCE, "two forwards of one image (impulse's floor)", "mimetic factors",
                     "mimetic's floor"], "lrrrr", rows)


def truncation(m, r: int):
    """The best rank-``r`` approximation of each matrix of ``m``, by a full SVD."""
    u, s, vh = torch.linalg.svd(m)
    return (u[..., :r] * s[..., None, :r]) @ vh[..., :r, :]


def routes_table(dim: int = 768, heads: int = 12, repeats: int = 3) -> str:
    """--routes: seconds per layer of each route to the per-head products, and its relative error."""
    from structinit.functional.mimetic import circular_factors, mimetic_noise

    torch.set_num_threads(2)
    d, h, r = dim, heads, dim // heads
    gen = torch.Generator().manual_seed(0)
    ms = torch.stack([0.7 * mimetic_noise(d, generator=gen) + 0.7 * torch.eye(d, dtype=torch.float64)
                      for _ in range(h)])
    exact = truncation(ms, r)

    def rel(p: torch.Tensor) -> float:
        return ((p.double() - exact).norm() / exact.norm()).item()

    rows = [
        ("svd f64, head by head", lambda: [torch.linalg.svd(m) for m in ms], 0.0),
        ("svd f64, batched", lambda: torch.linalg.svd(ms), 0.0),
        ("svd f32, batched", lambda: torch.linalg.svd(ms.float()), rel(truncation(ms.float(), r))),
    ]
    lowrank = lambda: torch.svd_lowrank(ms, q=r + 8, niter=2)
    u, s, v = lowrank()
    approx = (u[..., :r] * s[..., None, :r]) @ v[..., :r].transpose(-1, -2)
    rows.append(("svd_lowrank (randomized)", lowrank, rel(approx)))
    # circular noise is exact for its own M: its error is against the SVD truncation of that M, on one head
    left, right, m = circular_factors(d, r, 0.7, 0.7, with_target=True, generator=torch.Generator().manual_seed(1))
    err = ((left[0] @ right[0] - truncation(m[0], r)).norm() / truncation(m[0], r).norm()).item()
    rows.append(("circular (closed form)", lambda: circular_factors(d, r, 0.7, 0.7, heads=h, generator=gen), err))
    times = {name: median_seconds(fn, repeats) for name, fn, _ in rows}
    base = times["circular (closed form)"]
    cells = [[name, f"{times[name]:.4f}", f"{times[name] / base:.0f}", f"{error:.1e}"] for name, _, error in rows]
    head = [f"route (one layer: D {d}, {h} heads, r {r})", "seconds per layer", "× circular", "relative error"]
    return markdown(head, "lrrr", cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS, help="comma-separated; timm/<name> or a structinit model name")
    ap.add_argument("--schemes", default=SCHEMES, help="comma-separated init specs, e.g. mimetic:noise=uniform")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="fresh-interpreter rounds per tree; each cell keeps its best")
    ap.add_argument("--against", default=None, help="another structinit checkout to time side by side")
    ap.add_argument("--checks", action="store_true", help="the cost of the checks' forwards instead")
    ap.add_argument("--routes", action="store_true", help="the mimetic routes on one ViT-B/16 layer instead")
    ap.add_argument("--floor", action="store_true", help="the forwards and factor maths no init can skip instead")
    ap.add_argument("--dim", type=int, default=768, help="--routes: the layer's width")
    ap.add_argument("--heads", type=int, default=12, help="--routes: the layer's heads")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.checks:
        print(check_cost_table(args.repeats))
        return
    if args.floor:
        print(floor_table(args.models.split(","), args.repeats))
        return
    if args.routes:
        print(routes_table(args.dim, args.heads, args.repeats))
        return
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
