"""Mimetic attention initialisation (Trockman & Kolter, 2023) applied to a model; the maths
is in :mod:`structinit.functional.mimetic`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from structinit.adapters import grid_pos_embed, infer_layout
from structinit.adapters.attention import out_matrix
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.verify import no_value_path
from structinit.functional.mimetic import NOISE, mimetic_qk, mimetic_qk_grouped, mimetic_vo
from structinit.schemes.checks import (
    GROUPED,
    TRANSFORMS,
    check_settable,
    finish_plan,
    layers_to_write,
    mimetic_check,
    require_judged,
    require_probe,
)
from structinit.schemes.plan import Plan
from structinit.schemes.registry import register_planner
from structinit.schemes.reservation import RESERVE_MODES, resolve_reservation
from structinit.utils import check_choice, check_finite, check_number, make_generator


def plan_mimetic(
    survey: ModelSurvey,
    *,
    alpha: float = 0.7,
    beta: float = 0.7,
    gamma: float = 0.4,
    delta: float = 0.4,
    noise: str = "circular",
    layers: Iterable[int] | None = None,
    reference_layout: bool = False,
    reserve: str | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> Plan:
    r"""Mimetic initialisation of every chosen attention layer, in place.

    Per head h (a fresh draw each): W_q^h W_k^hᵀ = best rank-r approximation of
    α Z_h + β I (D×D). Per layer: W_v W_o = γ Z − δ I exactly, so ``proj(v(x)) = x (γZ − δI)``
    with zero biases. q/k/v/proj biases are set to 0; nothing else is touched.

    Z is noise of entry variance 1/D. ``noise='circular'`` (the default) draws it as a random
    normal matrix (Haar eigenvectors, eigenvalues uniform on the disk of radius √2), whose
    truncation is known in closed form: O(D r²) per head, no D×D SVD, so a ViT-B/16 takes a
    fraction of a second. ``noise='uniform'`` (±√(3/D)) or ``'normal'`` draw i.i.d. entries, the
    published recipe, at the cost of one float64 D×D SVD per head (tens of seconds on a
    ViT-B/16 on a CPU). Both give the same mean, entry variance and diagonal-dominant products;
    see :mod:`structinit.functional.mimetic`.

    ``reserve='patch'|'residual'|'auto'`` reserves the position embedding's subspace as
    :func:`structinit.impulse_init_` does, so the locality the PPᵀ term gives survives content.
    Default ``None`` = ``'none'``: the published init.

    ``reference_layout=True`` stores the v/proj factors untransposed, as the public ports do
    (composite x (R L)ᵀ instead of x M) — only for comparison with them.

    Examples:
        >>> model = structinit.create_model("vit_tiny_patch4_32")
        >>> _ = structinit.mimetic_init_(model, alpha=0.7, beta=0.7, seed=0)
    """
    check_choice("noise", noise, NOISE)
    for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma), ("delta", delta)):
        check_number(name, value, low=0)  # a negative scale flips the noise's sign or the identity's: not the init
    reserve = check_choice("reserve", "none" if reserve is None else reserve, RESERVE_MODES)
    chosen, skipped = layers_to_write(survey, layers)
    # Mimetic sets the projections alone: a rotation, a q/k norm or a bias the model adds on top is the
    # model's own; a layer whose projections structinit cannot read, or that forms no map, is refused.
    check_settable(survey, chosen, "mimetic", accept=TRANSFORMS | {GROUPED})
    _check_width_kept(chosen)
    require_probe(survey, "mimetic")  # before the maths: a write that cannot be checked is not made
    require_judged(survey, chosen, "mimetic")
    if reference_layout:
        for name, ad in chosen:
            if ad.num_heads * ad.value_dim != ad.dim:
                raise ValueError(f"reference_layout=True needs square v/proj, layer {name!r} is not")
    reservation = None if reserve == "none" else _reservation(survey, chosen, reserve)
    gen = make_generator(generator, seed)
    plan = Plan()
    for _, ad in chosen:
        if getattr(ad, "grouped", False):  # key/value heads shared by several query heads
            _plan_grouped(plan, ad, alpha, beta, gamma, delta, noise, gen)
            continue
        wq, wk, _ = mimetic_qk(ad.dim, ad.num_heads, ad.head_dim, alpha=alpha, beta=beta, noise=noise, generator=gen,
                               with_target=False)
        plan.add_qk(ad, wq, wk)  # record=None clears a stale impulse record
        wv, wo, _ = mimetic_vo(ad.dim, ad.num_heads * ad.value_dim, gamma=gamma, delta=delta, noise=noise,
                               generator=gen, reference_layout=reference_layout, with_target=False)
        plan.add(ad.vo_writes(wv, wo))
    if reservation is not None:
        reservation.plan(plan)
    plan.checks.append(mimetic_check(survey, chosen))
    finish_plan(plan, survey, "mimetic", chosen, skipped)
    return plan


def _check_width_kept(chosen) -> None:
    """Refuse a chosen layer whose value path is not linear token by token, or whose output
    projection changes the token width: the value path mimetic writes, x ↦ x (γZ − δI), is
    linear and keeps it."""
    for name, ad in chosen:
        if getattr(ad, "output_unread", None):  # whatever else the probe found there (a q/k norm): no V O to set
            raise ValueError(f"mimetic cannot set the attention of layer {name!r} ({type(ad.module).__name__}): "
                             f"{no_value_path(ad.output_unread)}; nothing was written. Use impulse with "
                             "value_init='keep', which sets q and k alone")
        out = tuple(out_matrix(ad.linear_views()["o"][0]).shape)
        if out != (ad.dim, ad.num_heads * ad.value_dim):
            raise ValueError(f"mimetic cannot set layer {name!r} ({type(ad.module).__name__}): its output projection "
                             f"is {out[1]} → {out[0]} for input tokens of width {ad.dim}, and the value path mimetic "
                             "writes, x ↦ x (γZ − δI), keeps the width; nothing was written. Pass layers= to choose "
                             "the layers that keep it")


def _reservation(survey: ModelSurvey, chosen, reserve: str):
    """The reservation of the position embedding's subspace that ``reserve`` (not 'none') asks
    for, read from the grid rows of the model's position embedding."""
    layout = infer_layout(survey)
    pe = grid_pos_embed(survey, layout)
    if pe is not None:
        check_finite("pos_embed", pe)
        pe = pe.detach().reshape(pe.shape[-2], -1).double().cpu()
    return resolve_reservation(survey, chosen, pe, reserve, "mimetic", layout)


def _plan_grouped(plan: Plan, ad, alpha, beta, gamma, delta, noise, gen) -> None:
    """Mimetic on grouped-query attention: q/k by :func:`mimetic_qk_grouped`; v/o so that the
    value path, every query head reading its group's values, is x ↦ x (γZ − δI): the factors of
    width kv_heads·r, and each head of a group an equal share of its group's output rows."""
    wq, wk = mimetic_qk_grouped(ad.dim, ad.kv_of, ad.head_dim, alpha=alpha, beta=beta, noise=noise, generator=gen)
    plan.add_qk(ad, wq, wk)
    wv, wo_kv, _ = mimetic_vo(ad.dim, ad.kv_heads * ad.value_dim, gamma=gamma, delta=delta, noise=noise,
                              generator=gen, with_target=False)
    share = torch.tensor([ad.kv_of.count(g) for g in ad.kv_of], dtype=wo_kv.dtype)
    wo = wo_kv.reshape(ad.kv_heads, ad.value_dim, ad.dim)[torch.tensor(ad.kv_of)] / share[:, None, None]
    plan.add(ad.vo_writes(wv, wo.reshape(ad.num_heads * ad.value_dim, ad.dim)))


mimetic_init_ = register_planner("mimetic", plan_mimetic, target="attention")
