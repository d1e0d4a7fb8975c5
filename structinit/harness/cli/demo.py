"""``structinit demo``: initialise one ViT with every scheme and measure impulse fidelity."""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch

from structinit.analysis import fidelity_summary, impulse_fidelity
from structinit.functional.targets import enumerated_offsets
from structinit.models import create_model
from structinit.schemes.registry import init_, schemes

COMMAND = "demo"
HELP = "initialise a ViT with every scheme and print impulse fidelity"

# (label, scheme, options); gd is shortened so the demo stays under a minute on 2 cores.
DEMO_INITS: list[tuple[str, str, dict]] = [
    ("impulse analytic", "impulse", {"solver": "analytic"}),
    ("impulse analytic sharp", "impulse", {"solver": "analytic", "target_mass": 0.98}),
    ("impulse closed_form", "impulse", {"solver": "closed_form"}),
    ("impulse gd (1000 steps)", "impulse", {"solver": "gd", "steps": 1000}),
    ("mimetic", "mimetic", {}),
    *[(name, name, {}) for name in ("pytorch", "timm", "jax", "xavier", "xavier_fused")],
]


@dataclass
class FidelityRow:
    """One init's row: its time and :class:`~structinit.analysis.FidelitySummary`'s four numbers."""

    label: str
    seconds: float
    mass_first: float
    hit_first: float
    mass_mean: float
    hit_mean: float


def fidelity_rows(model_name: str = "vit_tiny_patch4_32", images: torch.Tensor | None = None,
                  seed: int = 0, inits=DEMO_INITS) -> list[FidelityRow]:
    """One row per init: init time and fidelity (layer 1 and mean over layers). Schemes that
    place no impulse are scored against enumerated offsets, the chance level to beat."""
    rows = []
    for label, scheme, opts in inits:
        if scheme not in schemes():
            continue
        model = create_model(model_name)
        start = time.perf_counter()
        init_(model, scheme, seed=seed, **opts)
        seconds = time.perf_counter() - start
        offsets = None if scheme == "impulse" else enumerated_offsets(model.blocks[0].attn.num_heads)
        summary = fidelity_summary(impulse_fidelity(model, images, offsets=offsets))
        rows.append(FidelityRow(label, seconds, **dataclasses.asdict(summary)))
    return rows


def format_table(rows: list[FidelityRow], title: str) -> str:
    lines = [f"### {title}", "", "| init | time (s) | mass L1 | hit L1 | mass mean | hit mean |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.seconds:.3f} | {r.mass_first:.3f} | {r.hit_first:.3f} | "
                     f"{r.mass_mean:.3f} | {r.hit_mean:.3f} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from structinit.models import list_models

    p.add_argument("--model", default="vit_tiny_patch4_32", choices=list_models(),
                   help="the registered model to initialise (default vit_tiny_patch4_32)")
    p.add_argument("--seed", type=int, default=0, help="the seed of every init (default 0)")


def run(args: argparse.Namespace) -> int:
    print(format_table(fidelity_rows(args.model, seed=args.seed),
                       f"{args.model}: attention at init, position-only pseudo input"))
    return 0
