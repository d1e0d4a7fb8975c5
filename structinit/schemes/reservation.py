"""Planning a position reservation (see :mod:`structinit.functional.reservation`): the patch
embedding's output, and with ``'residual'`` every attention output projection and MLP
output too, made orthogonal to the subspace the attention reads position from; and what the
check after an impulse write finds about where position gets to (:func:`reached_maps`,
:func:`position_unkept`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from structinit.adapters import AttentionAdapter, TokenLayout
from structinit.adapters.layout import layout_position
from structinit.adapters.position import NOT_FOUND
from structinit.adapters.position_input import design_probe, position_only_maps
from structinit.adapters.residual import Token, Write, patch_writes, prefix_tokens, residual_writes, stream_writers
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.token_order import PositionReach, unreached
from structinit.functional.reservation import free_width, position_basis, project_out, project_out_tokens
from structinit.schemes.plan import Plan
from structinit.utils import check_choice, warn_caller

RESERVE_MODES = ("none", "patch", "residual", "auto")


@dataclass(frozen=True)
class Reservation:
    """What a reservation will rewrite: the position basis U (D×r) and the writes (name,
    weight, bias) whose output rows must leave span(U), its mode ('patch' or 'residual') and
    the attention layers whose position it reserves."""

    basis: torch.Tensor
    writes: list[Write]
    tokens: list[Token] = field(default_factory=list)
    mode: str = "residual"
    layers: tuple[str, ...] = ()

    def plan(self, plan: Plan) -> None:
        """Add the projected writes to ``plan``. Weights the plan already writes (e.g. a
        mimetic value/output init) are projected as planned, the others as the model holds them.
        Prefix tokens leave span(U) too: their keys are then 0 in every layer, so a target
        logit > 0 (the signed kernel) still beats them whatever the scales."""
        for _, weight, bias in self.writes:
            for t in (weight, bias):
                if t is not None:
                    plan.revise(t, lambda value: project_out(value, self.basis))
        for _, t in self.tokens:
            plan.revise(t, lambda value: project_out_tokens(value, self.basis))


def resolve_reservation(survey: ModelSurvey, layers: list[tuple[str, AttentionAdapter]], pe: torch.Tensor | None,
                        mode: str, scheme: str, layout: TokenLayout) -> Reservation | None:
    """The reservation ``mode`` asks for, or None. ``'auto'`` is ``'residual'`` where the model
    allows it; where it does not (no position embedding, no patch embedding or MLP output
    structinit knows, no free width) it warns with the reason and reserves nothing: the init
    still works, but its structure is then only approximate on real images. A layout with its own
    position embedding (``layout.position``: a later stage's, or another branch's) reserves what
    feeds its tokens (a merge, the branch's patch embedding) in place of the patch embedding."""
    check_choice("reserve", mode, RESERVE_MODES)
    if mode == "none":
        return None
    if mode != "auto":
        return prepare_reservation(survey, layers, pe, mode, layout)
    try:
        return prepare_reservation(survey, layers, pe, "residual", layout)
    except ValueError as err:
        warn_caller(f"{scheme} with reserve='auto' reserves nothing here: {err}. The init is applied without "
                    "the reservation, so image content can move the attention off its structure; pass "
                    "reserve='none' to silence this")
        return None


def prepare_reservation(survey: ModelSurvey, layers: list[tuple[str, AttentionAdapter]], pe: torch.Tensor | None,
                        mode: str, layout: TokenLayout) -> Reservation:
    """Check a reservation of the row space of LayerNorm(``pe``) (the (N, D) grid rows of the
    position embedding the init leaves in the model) and find what it rewrites, before any
    init maths runs."""
    check_choice("reserve", mode, ("patch", "residual"))
    if pe is None:
        raise ValueError(f"reserve={mode!r} reserves the position embedding's subspace, but {NOT_FOUND}; "
                         "pass pos_embed=<(N, D) tensor> or reserve='none'")
    basis = position_basis(pe)
    d, r = basis.shape
    if free_width(basis) < 1:
        raise ValueError(
            f"reserve={mode!r}: the position embedding spans {r} of the {d - 1} directions LayerNorm leaves "
            f"at width {d}, so nothing would be left for content; use reserve='none', a wider model or a smaller grid"
        )
    writes = patch_writes(survey, layers[0], layout.position)
    if mode == "residual":
        writes += residual_writes(survey.model, layers)
        writes += _unnamed_writes(survey, layers, writes, d)
    for name, weight, bias in writes:
        for t in (weight, bias):
            if t is not None and t.shape[0] != d:
                raise ValueError(f"{name} writes {t.shape[0]} channels, but the position embedding has width {d}")
    tokens = prefix_tokens(survey, layout)
    for name, t in tokens:
        if t.shape[-1] != d:
            raise ValueError(f"{name} has {t.shape[-1]} channels, but the position embedding has width {d}")
    return Reservation(basis, writes, tokens, mode, tuple(name for name, _ in layers))


def _unnamed_writes(survey: ModelSurvey, layers, writes: list[Write], d: int) -> list[Write]:
    """The writes into the stream no block layout names, found by dataflow
    (:func:`~structinit.adapters.residual.stream_writers`), among the Linear and Conv2d layers to
    width ``d`` outside the attention modules that ``writes`` does not hold already (a view of a
    known weight is that weight). Without such a layer there is nothing to find, and no forward
    runs for it."""
    known = {_where(weight) for _, weight, _ in writes}
    inside = {id(m) for v in survey.attention.verdicts for m in v.adapter.module.modules()}
    unnamed = [m for m in survey.model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) and id(m) not in inside
               and m.weight.shape[0] == d and _where(m.weight) not in known]
    if not unnamed:
        return []
    return [w for w in stream_writers(survey, layers) if _where(w[1]) not in known and w[1].shape[0] == d]


def _where(t: torch.Tensor) -> tuple:
    """Where ``t``'s entries are: the same for a parameter and a view of all of it."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()


def position_unkept(unkept: list[tuple[str, float, float]], strict: bool) -> None:
    """What the check after an impulse write does with the layers (name, smallest head's hit rate,
    how far the maps peak × uniform) in which the written q/k missed their targets on the tokens a
    probe image brought them, though a residual reservation was to keep position exactly readable
    there: with ``strict`` (``reserve='residual'`` asked for), a ValueError; otherwise (``'auto'``)
    a warning, the write kept: their structure holds on the position-only input, as in the papers,
    where the model brings it to them. (Impulse's check is its plan's last, so no later one undoes
    a write this warns of.)"""
    if not unkept:
        return
    where = ", ".join(f"{name!r} ({hit:.0%})" for name, hit, _ in unkept)
    what = (f"in the model's own forward on a probe image, the written q/k put a head's argmax on its target in "
            f"too few grid rows of {where}: " + (
                "their maps there are uniform, so the tokens reaching them carry no position (the position embedding "
                "reaches them through a zero factor, or on no path, or a projection that replaces the stream drops "
                "it, as a U-Net's skip join does)" if all(peak < 1.5 for _, _, peak in unkept) else
                "something between the position embedding and those layers rewrites the directions position is read "
                "from (a nonlinear patch embedding, pooling between stages, a projection that replaces the stream, as "
                "a U-Net's skip join does), so image content moves their maps off the targets"))
    if strict:
        raise ValueError(f"impulse: reserve='residual' does not keep position readable in every layer here: {what}; "
                         "the write was undone. Pass reserve='auto' or 'none' (the structure then holds on the "
                         "position-only input, as in the papers), or initialise only the layers before them (layers=)")
    warn_caller(f"impulse: the position reservation does not keep position readable in every layer here: {what}. "
                "Their structure holds on the position-only input (as in the papers) only where the model brings it "
                "to them; pass reserve='none' to silence this, or initialise only the layers before them (layers=)")


def reached_maps(survey: ModelSurvey, chosen, layouts: list[TokenLayout], pos_embed: torch.Tensor | None):
    """:func:`~structinit.adapters.position_input.position_only_maps` for the check after an
    impulse write, which also refuses a layer whose position comes from an embedding that does
    not reach the tokens it receives in that forward (a second branch with no embedding of its
    own, or one behind a gate at 0), confirmed by moving the embedding (a first layer whose token
    order is read is refused there already: :class:`~structinit.adapters.token_order.PositionUnreached`).
    With ``pos_embed`` (the caller's, not the model's) nothing is asked of the model's."""
    carried = [(name, ad, layout_position(survey, lay)) for (name, ad), lay in zip(chosen, layouts)
               if ad.rotary is None and survey.relative_bias(name, ad) is None]
    carried = [(name, ad, found) for name, ad, found in carried if found.pos_embed is not None]
    reach = PositionReach([found.pos_embed for _, _, found in carried]) if carried and pos_embed is None else None
    found = position_only_maps(survey, chosen, layouts, pos_embed, reach)
    if reach is None or found is None:
        return found
    inputs = design_probe(survey, chosen, layouts, tokens=True)
    for name, ad, position in carried:
        source = getattr(found[1].get(ad.module), "source", None)  # the tokens it received, before the swap
        if source is None or reach.reaches(source, position.pos_embed) or not unreached(
                survey.model, ad, position.pos_embed, inputs):
            continue
        raise ValueError(
            f"impulse: attention layer {name!r} ({type(ad.module).__name__}): the position embedding its impulse is "
            f"designed on, {position.pos_embed_name!r}, does not reach the tokens it receives (it sits on a path that "
            "embedding does not feed: a second branch, with no embedding of its own or one structinit does not take "
            "for this layer's, or behind a gate at 0), so impulse cannot shape its maps from it; the write was "
            "undone. Initialise only the layers that embedding reaches (layers=), or use 'mimetic', which needs no "
            "position")
    return found
