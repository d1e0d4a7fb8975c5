"""``impulse`` for attention whose relative position bias an MLP generates (continuous position
bias: Swin-V2 in timm, Hugging Face and torchvision; timm's relpos-MLP ViTs).

Head h's impulse is the bias table's column h, high at the row of its offset and low elsewhere,
as for a stored table (:mod:`.relative_impulse`); here the table is g·act(MLP(coords)), so the
MLP's last Linear is fitted to it by least squares (``structinit.functional.position_mlp.fit_last_layer``).
A two-layer MLP whose first Linear reads the 2 coordinates through a ReLU also gets a new first
layer (``structinit.functional.position_mlp.position_mlp_features``): the package inits make its features
homogeneous in the coordinates, and no last layer can then single out an offset. Every other row
is at most the bound ``lo``, so the margin Δ_h between the offset's entry and every other entry
is read off the table the planned weights give, in the model's dtype, before anything is written.

The content term must not take the map off its target:

- **dot-product attention**: W_q = 0 and b_q = 0, so q = 0 and every logit is the bias exactly;
  W_k keeps its weights so that W_q's gradient, Σ_j ∂L/∂logit_ij · k_j, is not 0 (with W_k = 0 too,
  q = k = 0 would be a stationary point that training never leaves). The table is fitted with
  Δ = β + HEADROOM, β = log(m (n − 1) / (1 − m)), so a query whose target is in its window puts at least
  ``target_mass`` m on it (n keys), on any image.
- **cosine attention** (Swin-V2: s_h·cos(q_i, k_j) + bias): q and k are normalised, so W_q = 0 would
  make q the constant b_q and k = W_k x + 0, and zeroing both leaves cos(0, ·), which F.normalize
  makes 0 with a gradient of 1/ε (10¹²): training would blow up. Instead the table is made as sharp
  as the 16·sigmoid cap allows (pre-activation ±SIGMOID_EDGE) and each head's logit scale is set to
  s_h = (Δ_h − β)/2 (``structinit.functional.position_mlp.cosine_logit_scale``): |s_h cos| ≤ s_h, so the
  target keeps mass ≥ m whatever q and k are, and q, k keep their weights and learn as before.
  s_h then grows by training (``logit_scale`` is a Parameter).

A fit that leaves the offset's entry no higher than another entry is refused, naming the layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from structinit.adapters.position_mlp import PositionMlpBias
from structinit.functional.position_mlp import (
    cosine_logit_scale,
    fit_last_layer,
    impulse_targets,
    position_mlp_features,
    table_margin,
)
from structinit.functional.relative import impulse_logit
from structinit.functional.targets import Offset
from structinit.schemes.impulse_request import check_shared_offsets
from structinit.schemes.plan import Plan

__all__ = ["POSITION_MLP_SOLVER", "POSITION_MLP_TARGET_MASS", "plan_position_mlp_impulse"]

POSITION_MLP_SOLVER = "position-mlp"
# The bias is the whole logit at init (dot-product), or bounds the content term (cosine): the
# map can be as sharp as asked, and the default makes each head nearly one tap of its kernel.
POSITION_MLP_TARGET_MASS = 0.95
_PASSIVE = (nn.Dropout, nn.Identity)
HEADROOM = 0.01  # logits above β that the fit's rounding and ridge cannot eat: the mass stays ≥ target_mass


def _redrawable(pb: PositionMlpBias) -> bool:
    """Linear(2, d) with bias → ReLU → (dropout, identity)* → Linear(d, heads) → (dropout, identity)*."""
    layers = pb.layers
    linears = [i for i, m in enumerate(layers) if isinstance(m, nn.Linear)]
    return (len(linears) == 2 and linears[0] == 0 and layers[0].bias is not None and isinstance(layers[1], nn.ReLU)
            and all(isinstance(m, _PASSIVE) for i, m in enumerate(layers[2:], 2) if i != linears[1]))


def _refuse(name: str, ad, what: str) -> ValueError:
    return ValueError(f"impulse cannot set the attention of layer {name!r} ({type(ad.module).__name__}): {what}; "
                      "nothing was written. Use 'mimetic', which sets only the projections")


def offset_rows(name: str, ad, bias, offsets: list[Offset]) -> list[int]:
    """The row of a relative bias table (stored, or made by an MLP) that holds each offset, each
    within the window; a ValueError naming the layer where one has no row of its own."""
    try:
        return [bias.row_of(tuple(o)) for o in offsets]
    except ValueError as err:
        raise ValueError(f"impulse cannot set the attention of layer {name!r} ({type(ad.module).__name__}): {err}; "
                         "nothing was written. Pass offsets= whose pairs have a table row of their own, or use "
                         "'mimetic', which sets only the projections") from None


def plan_position_mlp_impulse(plan: Plan, chosen, biases: list[PositionMlpBias], per_layer: list[list[Offset]],
                              target_mass: float, generator: torch.Generator | None) -> None:
    """Add to ``plan`` the position MLP, and W_q or the logit scale, of every chosen layer (module
    doc): head h of layer i at offset ``per_layer[i][h]``, with its record
    (``solver='position-mlp'``, the fit's ``residual`` and the ``mass`` it guarantees)."""
    written: dict[int, tuple[str, list[Offset]]] = {}
    fitted: dict[int, dict] = {}  # one fit per MLP: timm's shared_rel_pos hands one to every layer
    for (name, ad), pb, offsets in zip(chosen, biases, per_layer):
        if pb.num_heads != ad.num_heads:
            raise _refuse(name, ad, f"its position MLP gives {pb.num_heads} logits per offset but the layer has "
                                    f"{ad.num_heads} heads")
        check_shared_offsets(written, pb.mlp, name, offsets, "position MLP")
        keys = pb.num_prefix_tokens + pb.grid[0] * pb.grid[1]
        record = {"offsets": [tuple(o) for o in offsets], "grid": pb.grid, "num_prefix_tokens": pb.num_prefix_tokens,
                  "solver": POSITION_MLP_SOLVER}
        if keys == 1:  # a stage merged down to one token: its map is the identity whatever is written
            if any(tuple(o) != (0, 0) for o in offsets):
                raise ValueError(f"layer {name!r} attends within a 1×1 window: only offset (0, 0) fits there; leave "
                                 "the layer out with layers=")
            plan.records.append((ad.module, "impulse", record))
            continue
        if id(pb.mlp) in fitted and ad.cosine is not None:
            raise _refuse(name, ad, "it shares its position MLP with another layer, and its cosine attention needs a "
                                    "logit scale fitted to the table of its own")
        if id(pb.mlp) not in fitted:
            rows = offset_rows(name, ad, pb, offsets)
            writes, fitted[id(pb.mlp)] = _fit(name, ad, pb, rows, keys, target_mass, generator)
            plan.add(writes)
        record_fit = fitted[id(pb.mlp)]
        if ad.cosine is None:
            wq, _, wk, bk = ad.read_qk()
            if ad.qk_normalised:
                raise _refuse(name, ad, "it normalises q and k (q_norm/k_norm), so W_q = 0 does not make its content "
                                        "logits 0")
            plan.add_qk(ad, torch.zeros_like(wq), wk, None, bk, record=record | record_fit)
        else:
            plan.records.append((ad.module, "impulse", record | record_fit))


def _fit(name: str, ad, pb: PositionMlpBias, rows: list[int], keys: int, target_mass: float, generator):
    """The writes of one layer's position MLP (and logit scale), and what its record says of the fit."""
    beta = impulse_logit(target_mass, keys)
    cosine = ad.cosine is not None
    s_now = None if not cosine else ad.cosine.scales().double()
    margin = None if cosine and pb.activation == "sigmoid" else beta + HEADROOM + (
        0.0 if not cosine else 2 * float(s_now.max()))
    try:
        hi, lo = impulse_targets(margin, pb.activation, pb.gain)
    except ValueError as err:
        raise _refuse(name, ad, f"its bias table is {pb.gain:g}·sigmoid(MLP): {err}") from None
    writes, replace = [], {}
    first, last = pb.first, pb.last
    redraw = _redrawable(pb)
    if redraw:
        w1, b1 = position_mlp_features(pb.coords.reshape(-1, 2), first.out_features, generator=generator)
        replace[first] = (w1.to(first.weight), b1.to(first.weight))
        writes += [(first.weight, w1), (first.bias, b1)]
    with torch.no_grad():
        hidden = pb.run(replace, upto_last=True)
    fit = fit_last_layer(hidden.double(), rows, hi, lo, bias=last.bias is not None)
    replace[last] = (fit.weight.to(last.weight), None if fit.bias is None else fit.bias.to(last.weight))
    writes.append((last.weight, fit.weight))
    if last.bias is not None:
        writes.append((last.bias, fit.bias))
    with torch.no_grad():
        table = pb.activate(pb.run(replace)).double()  # what the model will compute, in its dtype
    delta = table_margin(table, rows, floor=0.0 if pb.num_prefix_tokens else None)
    if bool((delta <= 0).any()):
        h = int(delta.argmin())
        raise _refuse(name, ad, f"its position MLP cannot make head {h}'s bias peak at its offset (least-squares "
                                f"residual {float(fit.residual[h]):.3g} of the {pb.num_rows}-row table with "
                                f"{last.in_features} hidden features)")
    record = {"residual": float(fit.residual.max()), "features": "drawn" if redraw else "kept"}
    if cosine:
        try:
            scale = cosine_logit_scale(delta, target_mass, keys) if pb.activation == "sigmoid" else s_now.clone()
        except ValueError as err:
            raise _refuse(name, ad, f"its {pb.gain:g}·sigmoid bias table is capped: {err}") from None
        if pb.activation != "sigmoid" and bool(((delta - 2 * s_now) <= beta).any()):
            raise _refuse(name, ad, "its bias table cannot reach the margin its cosine logit scale needs")
        writes.append((ad.cosine.logit_scale, scale.log().reshape(ad.cosine.logit_scale.shape)))
        delta = delta - 2 * scale
        record["logit_scale"] = [float(s) for s in scale]
    mass = 1 / (1 + (keys - 1) * torch.exp(-delta))
    record["mass"] = float(mass.min())
    if not math.isfinite(record["mass"]):
        raise _refuse(name, ad, "its fitted bias table is not finite")
    return writes, record
