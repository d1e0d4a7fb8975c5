"""Planning a position reservation (see :mod:`structinit.functional.reservation`): the patch
embedding's output, and with ``'residual'`` every attention output projection and MLP
output too, made orthogonal to the subspace the attention reads position from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from structinit.adapters import AttentionAdapter
from structinit.adapters.residual import Write, patch_embedding, residual_writes
from structinit.functional.reservation import free_width, position_basis, project_out
from structinit.schemes.plan import Plan
from structinit.utils import check_choice

RESERVE_MODES = ("patch", "residual")


@dataclass(frozen=True)
class Reservation:
    """What a reservation will rewrite: the position basis U (D×r) and the writes (name,
    weight, bias) whose output rows must leave span(U)."""

    basis: torch.Tensor
    writes: list[Write]

    def plan(self, plan: Plan) -> None:
        """Add the projected writes to ``plan``. Weights the plan already writes (e.g. a
        mimetic value/output init) are projected as planned, the others as the model holds them."""
        for _, weight, bias in self.writes:
            for t in (weight, bias):
                if t is not None:
                    current = plan.pending(t)
                    plan.add([(t, project_out(t if current is None else current, self.basis))])


def prepare_reservation(model: nn.Module, layers: list[tuple[str, AttentionAdapter]], pe: torch.Tensor | None,
                        mode: str) -> Reservation:
    """Check a reservation of the row space of LayerNorm(``pe``) (the (N, D) grid rows of the
    position embedding the init leaves in the model) and find what it rewrites, before any
    init maths runs."""
    check_choice("reserve", mode, RESERVE_MODES)
    if pe is None:
        raise ValueError(f"reserve={mode!r} reserves the position embedding's subspace, but the model has no "
                         "`pos_embed`; pass pos_embed=<(N, D) tensor> or reserve=None")
    basis = position_basis(pe)
    d, r = basis.shape
    if free_width(basis) < 1:
        raise ValueError(
            f"reserve={mode!r}: the position embedding spans {r} of the {d - 1} directions LayerNorm leaves "
            f"at width {d}, so nothing would be left for content; use reserve=None, a wider model or a smaller grid"
        )
    writes = [patch_embedding(model)]
    if mode == "residual":
        writes += residual_writes(model, layers)
    for name, weight, bias in writes:
        for t in (weight, bias):
            if t is not None and t.shape[0] != d:
                raise ValueError(f"{name} writes {t.shape[0]} channels, but the position embedding has width {d}")
    return Reservation(basis, writes)
