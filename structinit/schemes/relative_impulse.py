"""``impulse`` for attention with a relative position bias (Swin's window attention, BEiT).

Such a layer carries position in a learned table indexed by the query–key offset, not in
the tokens, so a head's impulse is one table entry: the row of its offset (dy, dx) holds
β = log(m (n − 1) / (1 − m)) and every other row 0 (:func:`structinit.functional.impulse_logit`).
With content logits q·k near zero, each query whose target key is in its window puts mass m
on it; a query whose target lies outside the window (or across a shifted-window seam, where
Swin's mask removes it) has no entry to raise, as a zero-padded convolution reads zeros
there. q and k keep their weights: their logits are the content part, small at init next to
β. Prefix (class) token pairs use rows of their own and get 0.

Swin's stages see windows of their own size; offsets are drawn once for the widest layer and
shared by all layers, as for a ViT, unless ``per_layer_offsets``.
"""

from __future__ import annotations

import torch

from structinit.adapters import TokenLayout
from structinit.adapters.position_mlp import PositionMlpBias
from structinit.adapters.relative import RelativeBias
from structinit.functional.relative import impulse_logit
from structinit.functional.targets import Offset
from structinit.schemes.impulse_request import ImpulseRequest, Placed, check_shared_offsets
from structinit.schemes.plan import Plan
from structinit.schemes.position_mlp_impulse import POSITION_MLP_TARGET_MASS, offset_rows, plan_position_mlp_impulse
from structinit.utils import make_generator
from structinit.utils.checks import show

__all__ = ["RELATIVE_SOLVER", "plan_relative_impulse"]

RELATIVE_SOLVER = "relative"
# What the relative route reads of the options plan_impulse takes; the rest are about a
# position embedding or a q/k solve and are refused (see check_relative_options).
_READS_SOLVER_OPTIONS = ("target_mass",)


def check_relative_options(chosen, solver: str, solver_options: dict, given: dict,
                           carrier: str = "a relative position bias table, which impulse writes directly (one entry "
                                          "per head)") -> None:
    """Refuse, naming them, the options that only mean something for a position embedding:
    the layers' position lives in ``carrier`` (their relative bias table, or their rotation)."""
    names = ", ".join(repr(n) for n, _ in chosen[:3]) + (" …" if len(chosen) > 3 else "")
    why = f"the chosen layers ({names}) carry position in {carrier}"
    if solver != "analytic":
        raise ValueError(f"solver={solver!r}: {why}; no q/k solver runs. Leave solver at its default")
    extra = sorted(set(solver_options) - set(_READS_SOLVER_OPTIONS))
    if extra:
        raise ValueError(f"{', '.join(extra)}: {why}; the only solver option read is target_mass")
    for name, value in given.items():
        if value is not None and not (name == "reserve" and value in ("none", "auto")):
            raise ValueError(f"{name}={show(value)}: {why}; {name} is about a position embedding, omit it")


def plan_relative_impulse(plan: Plan, chosen, biases: list[RelativeBias], per_layer: list[list[Offset]],
                          target_mass: float) -> None:
    """Add to ``plan`` the table of every chosen layer (``biases[i]`` the one layer i uses): head h
    of layer i at offset ``per_layer[i][h]``, with its record (``solver='relative'``). A table
    shared by several layers must get the same offsets from each."""
    written: dict[int, tuple[str, list[Offset]]] = {}
    for (name, ad), rb, offsets in zip(chosen, biases, per_layer):
        if rb.num_heads != ad.num_heads:
            raise ValueError(f"layer {name!r}: its relative position bias table has {rb.num_heads} columns but the "
                             f"layer {ad.num_heads} heads; structinit writes one column per head")
        check_shared_offsets(written, rb.table, name, offsets, "relative position bias table")
        keys = rb.num_prefix_tokens + rb.grid[0] * rb.grid[1]
        if keys == 1 and any(tuple(o) != (0, 0) for o in offsets):  # a stage merged down to one token
            raise ValueError(f"layer {name!r} attends within a 1×1 window: each query has one key, so its map is "
                             f"the identity whatever is written, and only offset (0, 0) fits, not "
                             f"{sorted({tuple(o) for o in offsets} - {(0, 0)})}; leave the layer out with layers= "
                             "(the other layers' indices), as on images too small for the model's stages")
        rows = offset_rows(name, ad, rb, offsets)
        beta = 0.0 if keys == 1 else impulse_logit(target_mass, keys)  # one key: softmax is 1 on it already
        table = torch.zeros(tuple(rb.table.shape), dtype=torch.float64)
        table[rows, torch.arange(len(rows))] = beta
        plan.add([(rb.table, table)])
        plan.records.append((ad.module, "impulse", {
            "offsets": list(offsets), "grid": rb.grid, "num_prefix_tokens": rb.num_prefix_tokens,
            "solver": RELATIVE_SOLVER, "logit": beta}))


def plan_on_relative(request: ImpulseRequest, plan: Plan) -> Placed:
    """The relative-bias carrier (module doc): each head's offset written into its layer's bias
    table, or fitted into the MLP that generates it (Swin-V2, relpos-MLP ViTs:
    :mod:`structinit.schemes.position_mlp_impulse`). The grid is each layer's window."""
    chosen, biases = request.chosen, request.biases
    mlp = [isinstance(b, PositionMlpBias) for b in biases]
    if any(mlp) and not all(mlp):
        raise ValueError("some chosen attention layers store their relative position bias table and others "
                         "generate it with an MLP; initialise them separately (layers=)")
    check_relative_options(chosen, request.solver, request.solver_options, {
        "grid": request.grid, "num_prefix_tokens": request.num_prefix_tokens, "pos_embed": request.pos_embed,
        "reserve": request.reserve_given},
        **({"carrier": "a relative position bias an MLP generates, whose layers impulse fits"} if any(mlp) else {}))
    layouts = [TokenLayout(b.grid, b.num_prefix_tokens) for b in biases]
    gen = make_generator(request.generator, request.seed)
    per_layer = request.resolve_offsets("random", gen)
    if any(mlp):
        target_mass = request.solver_options.get("target_mass", POSITION_MLP_TARGET_MASS)
        plan_position_mlp_impulse(plan, chosen, biases, per_layer, target_mass, gen)
    else:
        plan_relative_impulse(plan, chosen, biases, per_layer, request.solver_obj.target_mass)
    return Placed(chosen, layouts, per_layer, gen)
