"""The ablations ``structinit ablate NAME`` runs: one reviewer question each, as a list of
variants. A variant is an init spec (the text :func:`~structinit.harness.compare.compare`
understands, e.g. ``impulse:kernel_size=5``) and, where the question is about the
architecture, keyword arguments of the model (``num_heads``).

Only data lives here (no torch), so that the command line can list the names cheaply. The
``gd`` variants take their step count from ``--steps``: the published 10,000 steps take
minutes a variant on 2 CPU cores, so an ablation runs a reduced fit and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ABLATIONS", "PUBLISHED_GD_STEPS", "Ablation", "Variant", "variants"]

PUBLISHED_GD_STEPS = 10_000  # the 2024 paper's fit length


@dataclass(frozen=True)
class Variant:
    """One row of an ablation: a short label, the init spec, and model keyword arguments."""

    label: str
    spec: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """A folder name for the variant's runs (unique within its ablation)."""
        text = self.label.replace("=", "-").replace(" ", "_")
        return "".join(ch if ch.isalnum() or ch in "._-+" else "_" for ch in text)


@dataclass(frozen=True)
class Ablation:
    """A question, and how to build its variants from the gd step count."""

    title: str
    question: str
    build: Callable[[int], list[Variant]]


def _gd(steps: int, extra: str = "") -> str:
    return f"impulse:solver=gd,steps={steps}{',' + extra if extra else ''}"


def _pseudo(steps: int) -> list[Variant]:
    kinds = ("pe", "uniform", "gaussian", "pe+uniform", "pe+gaussian")  # structinit.functional.PSEUDO_INPUTS
    return [Variant(f"pseudo={kind}", _gd(steps, f"pseudo={kind}")) for kind in kinds]


def _kernel(steps: int) -> list[Variant]:
    return [Variant(f"kernel_size={k}", f"impulse:kernel_size={k}") for k in (3, 5, 7)]


def _heads(steps: int) -> list[Variant]:
    return [Variant(f"num_heads={h}", "impulse", {"num_heads": h}) for h in (2, 4, 8)]


def _offsets(steps: int) -> list[Variant]:
    return [Variant(f"offsets={kind}", f"impulse:offsets={kind}") for kind in ("random", "enumerated")]


def _sharing(steps: int) -> list[Variant]:
    return [
        Variant("analytic, shared offsets", "impulse:per_layer_offsets=False"),
        Variant("analytic, per-layer offsets", "impulse:per_layer_offsets=True"),
        Variant("gd, shared solution", _gd(steps, "share_solution=True")),
        Variant("gd, per-layer solution", _gd(steps, "share_solution=False")),
        Variant("gd, per-layer solution and offsets", _gd(steps, "share_solution=False,per_layer_offsets=True")),
    ]


def _sharpness(steps: int) -> list[Variant]:
    return [Variant(f"target_mass={m}", f"impulse:target_mass={m}") for m in (0.3, 0.5, 0.7, 0.9)]


def _pe_scale(steps: int) -> list[Variant]:
    return [Variant(f"pe_scale={s:g}", f"impulse:pe_scale={s!r}") for s in (0.5, 1.0, 2.0, 4.0)]


def _solvers(steps: int) -> list[Variant]:
    return [Variant("analytic", "impulse:solver=analytic"), Variant("closed_form", "impulse:solver=closed_form"),
            Variant(f"gd ({steps} steps)", _gd(steps))]


ABLATIONS: dict[str, Ablation] = {
    "pseudo": Ablation("pseudo input of the gd fit", "Does the fit need the position embedding, or does noise do "
                       "(the 2024 paper's Table 6)?", _pseudo),
    "kernel": Ablation("kernel size", "How does the impulse's kernel size (3, 5, 7) change fidelity and "
                       "accuracy?", _kernel),
    "heads": Ablation("heads at fixed width", "How many heads (narrower heads) can carry the impulse?", _heads),
    "offsets": Ablation("offset choice", "Random offsets per head, or the enumerated ones (centre, up, right, "
                        "left, …)?", _offsets),
    "sharing": Ablation("shared vs per-layer", "One offset draw and one solution for every layer, or new ones per "
                        "layer?", _sharing),
    "sharpness": Ablation("sharpness (target_mass)", "How sharp should the maps be at init?", _sharpness),
    "pe-scale": Ablation("position-embedding scale", "How large should the written sin-cos PE be?", _pe_scale),
    "solvers": Ablation("solvers and their cost", "What do the analytic, closed-form (2025) and gd (2024) "
                        "solvers cost, and how faithful are they?", _solvers),
}


def variants(name: str, steps: int = 1000) -> list[Variant]:
    """The variants of the ablation ``name``, its gd variants fitted for ``steps`` steps."""
    if name not in ABLATIONS:
        raise ValueError(f"ablation {name!r}: unknown; valid: {', '.join(ABLATIONS)}")
    return ABLATIONS[name].build(steps)
