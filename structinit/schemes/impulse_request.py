"""What every impulse carrier planner reads: the request, checked once by
:func:`structinit.schemes.impulse.plan_impulse`, and what a carrier hands back.

Impulse puts each head's target where the layer carries position: in the tokens (an absolute
position embedding, :mod:`structinit.schemes.embedding_impulse`), in a relative bias table or
the MLP that generates it (:mod:`structinit.schemes.relative_impulse`), or in the rotation of q
and k (:mod:`structinit.schemes.rope_impulse`). A new carrier is one planner
``plan(request, plan) -> Placed`` in :data:`structinit.schemes.impulse.IMPULSE_CARRIERS`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from structinit.adapters import TokenLayout
from structinit.adapters.survey import ModelSurvey
from structinit.functional.targets import Offset, check_offsets, enumerated_offsets, random_offsets


@dataclass
class ImpulseRequest:
    """An impulse init's options, checked, with the layers it writes (``chosen``, (name,
    adapter)) and each one's relative position bias (``biases``, None where it has none)."""

    survey: ModelSurvey
    chosen: list
    biases: list
    solver: str
    solver_obj: object
    solver_options: dict
    kernel_size: int
    offsets: str | Sequence[Offset] | None
    per_layer_offsets: bool
    grid: tuple[int, int] | None
    num_prefix_tokens: int | None
    pos_embed: torch.Tensor | None
    generator: torch.Generator | None
    seed: int | None
    reserve: str
    reserve_given: str | None

    def resolve_offsets(self, default: str | Sequence[Offset], gen: torch.Generator) -> list[list[Offset]]:
        """Each chosen layer's offsets, one per head: ``self.offsets``, else ``default``."""
        return resolve_offsets(self.chosen, default if self.offsets is None else self.offsets, self.kernel_size,
                               self.per_layer_offsets, gen)


@dataclass
class Placed:
    """What a carrier planned: the layers written (a carrier may read them again), each
    one's token layout and offsets, the generator drawn from, and the position reservations
    to plan last (one per stage that has one)."""

    chosen: list
    layouts: list[TokenLayout]
    offsets: list[list[Offset]]
    gen: torch.Generator
    reservations: list = field(default_factory=list)


def resolve_offsets(chosen, offsets, kernel_size, per_layer_offsets, gen) -> list[list[Offset]]:
    """Per chosen (name, adapter), one (dy, dx) per head: 'random' (one draw shared by every
    layer unless ``per_layer_offsets``), 'enumerated', or a list given for every layer."""
    heads = [ad.num_heads for _, ad in chosen]
    if isinstance(offsets, str):
        if offsets == "enumerated":
            return [enumerated_offsets(h, kernel_size) for h in heads]
        if offsets == "random":
            if per_layer_offsets:
                return [random_offsets(h, kernel_size, gen) for h in heads]
            first = random_offsets(max(heads), kernel_size, gen)
            return [first[:h] for h in heads]
        raise ValueError(f"offsets={offsets!r}: use 'random', 'enumerated' or a list of (dy, dx)")
    offs = check_offsets(list(offsets), kernel_size)
    for (name, ad) in chosen:
        if len(offs) != ad.num_heads:
            counts = sorted({a.num_heads for _, a in chosen})
            hint = "give one (dy, dx) per head"
            if len(counts) > 1:  # Swin: the head count grows per stage; one list cannot fit all of them
                hint += (f"; the chosen layers have {', '.join(map(str, counts))} heads: init each group in its own "
                         "call, layers=[...] with a list of that many offsets, or use offsets='random'")
            raise ValueError(f"offsets has {len(offs)} entries but layer {name!r} has {ad.num_heads} heads; {hint}")
    return [offs for _ in chosen]


def check_shared_offsets(written: dict, shared, name: str, offsets, what: str) -> None:
    """Record layer ``name``'s ``offsets`` for the ``shared`` module or tensor it writes, in
    ``written``; a ValueError when another layer that writes the same one chose other offsets."""
    first = written.setdefault(id(shared), (name, list(offsets)))
    if first[1] != list(offsets):
        raise ValueError(f"layers {first[0]!r} and {name!r} share one {what}, so they must start with the same "
                         "offsets; leave per_layer_offsets=False (one draw for every layer)")
