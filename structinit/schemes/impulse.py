"""Impulse (structured) attention initialisation: every head starts as a one-hot k×k
convolution on the token grid. The maths and the solvers live in
:mod:`structinit.functional`; this module checks the request and the layers, then hands them
to the planner of the way the layers carry position (:data:`IMPULSE_CARRIERS`: an absolute
embedding, a relative bias, a rotation), and finishes every plan alike (the value path, the
reservation, the check after the write).

Solver options (passed to :func:`plan_impulse` by keyword, beside its own):
    analytic: ``target_mass=0.5`` the mean attention on the target with the position-only
        pseudo input (the sharpness); ``signed=True`` a kernel whose target logit is > 0
        and every other < 0, so that with the reservation the argmax is exact on any
        content (``False``: the cosine kernel alone); ``pe_scale=1.0`` writes pe_scale × the
        2-D sin-cos table into the grid rows of the model's position embedding (learned or fixed; ``None``
        keeps the model's PE and reads the structure out of it); ``ridge=2e-3``.
        ``pe_scale=4`` keeps the maps sharper on real images but drowns the content.
    closed_form: ``pe_scale=18`` (applied to a learned PE only), ``qk_norm=7``,
        ``logit_scale=1000``, ``noise=3``, ``pinv_rank=head_dim``.
    gd: ``steps=10000``, ``lr=1e-4``, ``renorm_every=100``, ``pseudo='pe'`` (or
        'uniform', 'gaussian', 'pe+uniform', 'pe+gaussian'), ``share_solution=True`` (one
        fit copied to every layer), ``callback(step, loss)``.

Attention with a relative position bias (Swin's window attention, BEiT) carries position
in its table, not in the tokens: there each head's impulse is the table entry of its offset,
solved for ``target_mass`` with content logits at zero, every other entry 0; q/k keep their
weights, no solver runs, and options about a position embedding are refused (see
:mod:`structinit.schemes.relative_impulse`). The grid is each layer's window.

Prefix (class/register) tokens are not on the grid: their rows and columns get whatever
the written q/k weights give their inputs (a zero class token gives logit 0, a uniform
row and an ordinary column); no head targets them and fidelity ignores their rows. Their
columns count: a grid row whose argmax is a prefix token misses its target, in the check after
the write as in :func:`structinit.impulse_fidelity` (the reservation projects the prefix tokens
off the position subspace, which keeps their logits below the targets').
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Sequence

import torch

from structinit.adapters.logit_transforms import NO_PROJECTION
from structinit.adapters.survey import ModelSurvey
from structinit.functional.impulse_solvers import IMPULSE_SOLVERS, make_impulse_solver
from structinit.functional.mimetic import mimetic_vo
from structinit.functional.targets import Offset, check_kernel_size, check_offsets
from structinit.schemes.checks import check_settable, finish_plan, impulse_check, layers_to_write
from structinit.schemes.embedding_impulse import plan_on_embedding
from structinit.schemes.impulse_request import ImpulseRequest, Placed, resolve_offsets
from structinit.schemes.plan import Plan
from structinit.schemes.registry import register_planner
from structinit.schemes.relative_impulse import plan_on_relative
from structinit.schemes.reservation import RESERVE_MODES
from structinit.schemes.rope_impulse import plan_on_rotary
from structinit.utils import check_choice, check_options

VALUE_INITS = ("keep", "mimetic")


def plan_impulse(
    survey: ModelSurvey,
    solver: str = "analytic",
    *,
    kernel_size: int = 3,
    offsets: str | Sequence[Offset] | None = None,
    layers: Iterable[int] | int | None = None,
    per_layer_offsets: bool = False,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int | None = None,
    pos_embed: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    value_init: str | None = None,
    vo_gamma: float = 0.4,
    vo_delta: float = 0.4,
    reserve: str | None = None,
    **solver_options,
) -> Plan:
    r"""Make every head of the chosen attention layers start as a one-hot k×k convolution.

    Head h of a layer gets an offset (dy, dx) in the k×k kernel; its attention map at init
    approximates the shift matrix H (:func:`structinit.impulse_matrix`): token (y, x) attends
    to (y+dy, x+dx). Written: the q/k weights (biases set to 0), optionally v/proj, (for
    some solvers) the grid rows of the model's position embedding, and with a reservation the residual writes
    projected out of the position subspace (see ``reserve``); everything else is untouched.

    Args:
        model: any model whose attention layers an adapter understands (timm / structinit
            ViT, separate q/k/v projections, ``nn.MultiheadAttention``).
        solver: ``'analytic'`` (default; exact, instant — see
            :mod:`structinit.functional.impulse_analytic`), ``'closed_form'`` (2025 paper),
            ``'gd'`` (2024 paper), or any solver registered in ``structinit.IMPULSE_SOLVERS``.
        kernel_size: odd k ∈ {3, 5, 7, …}, at most the grid side.
        offsets: ``'random'`` (uniform with replacement, per head), ``'enumerated'`` (centre, up,
            right, left, down, diagonals, cycling), or an explicit list of (dy, dx), one per
            head. Default: enumerated for closed_form, random otherwise.
        layers: indices of the attention layers to initialise (default all).
        per_layer_offsets: draw new random offsets for each layer (default: one draw shared
            by all layers, as both papers do).
        grid, num_prefix_tokens: token layout, inferred from the model when omitted.
        pos_embed: the (N, D) position embedding of a model whose own structinit cannot find
            (found: timm's ``pos_embed``, Hugging Face's ``embeddings.position_embeddings``, a
            parameter named like ``pos_embedding``; see :func:`structinit.register_position_finder`).
        generator, seed: source of every random draw (offsets, noise, v/proj).
        value_init: ``'keep'`` leaves v/proj as they are; ``'mimetic'`` sets W_v W_o =
            ``vo_gamma``·Z − ``vo_delta``·I as :func:`structinit.mimetic_init_` does. Default: the
            solver's (``'mimetic'`` for closed_form, as in the 2025 code; ``'keep'`` otherwise).
        reserve: ``'patch'`` makes the patch embedding's output orthogonal to the subspace the
            q/k read position from (the row space of LayerNorm(PE)), and ``'residual'`` also
            every attention output projection and MLP output, so that position stays exactly
            readable in every layer (:mod:`structinit.functional.reservation`; checked on a
            probe image after the write: ``'auto'`` warns where it is not, ``'residual'`` refuses);
            ``'auto'`` is ``'residual'`` where the model allows it and otherwise warns and
            reserves nothing; ``'none'`` reserves nothing. Default: the solver's (``'auto'``
            for analytic, ``'none'`` for the published closed_form and gd).

    Solver options, and how relative-bias layers and prefix tokens are treated: see the module docstring.

    The offsets are remembered on each attention module (``module.structinit_impulse``) for
    :func:`structinit.impulse_fidelity` (see :func:`structinit.get_record`). Returns the
    :class:`structinit.Plan`; ``impulse_init_`` commits it and returns ``model``.

    Examples:
        >>> model = structinit.create_model("vit_tiny_patch2_32")
        >>> _ = structinit.impulse_init_(model, kernel_size=3, target_mass=0.5, seed=0)
        >>> bool((structinit.impulse_fidelity(model)["hit"] == 1).all())
        True
    """
    solver_obj, value_init, reserve_mode = _check_options(survey, solver, solver_options, kernel_size, offsets, grid,
                                                          value_init, reserve)
    chosen, skipped, biases = _check_layers(survey, layers, offsets, kernel_size, per_layer_offsets, value_init)
    request = ImpulseRequest(survey, chosen, biases, solver, solver_obj, solver_options, kernel_size, offsets,
                             per_layer_offsets, grid, num_prefix_tokens, pos_embed, generator, seed, reserve_mode,
                             reserve)
    plan = Plan()
    placed = IMPULSE_CARRIERS[position_carrier(chosen, biases)](request, plan)
    _check_causal_targets(placed)
    _finish_impulse(plan, survey, placed, skipped, value_init, vo_gamma, vo_delta, pos_embed, solver_obj, reserve_mode)
    return plan


def _check_options(survey: ModelSurvey, solver: str, solver_options: dict, kernel_size: int, offsets,
                   grid: tuple[int, int] | None, value_init: str | None, reserve: str | None):
    """The checks of :func:`plan_impulse`'s options, which read no layer: (the solver, the
    value init, the reserve mode), the last two with the solver's defaults filled in."""
    # Options are checked before anything else; an unknown one lists the solver's options and ours.
    own = [p.name for p in inspect.signature(plan_impulse).parameters.values()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "survey"]
    check_options(IMPULSE_SOLVERS.get(solver), solver_options, f"impulse solver {solver!r}",
                  hint=f"; every impulse init also takes {', '.join(own)}")
    solver_obj = make_impulse_solver(solver, **solver_options)
    value_init = check_choice("value_init", solver_obj.default_value_init if value_init is None else value_init,
                              VALUE_INITS)
    reserve = check_choice("reserve", solver_obj.default_reserve if reserve is None else reserve, RESERVE_MODES)
    check_kernel_size(kernel_size)
    if offsets is not None and not isinstance(offsets, str):  # the pairs against the kernel: no layer read yet
        check_offsets(list(offsets), kernel_size)
    if grid is None and survey.takes_token_ids:  # before anything is read: a sequence has no grid to shape
        raise ValueError(f"impulse cannot set {type(survey.model).__name__}: it reads token ids, a 1-D sequence with "
                         "no grid of image tokens, and impulse shapes attention as convolutions on a 2-D grid; "
                         "nothing was written. Use 'mimetic' (it needs no grid), or pass grid=(h, w) if the ids are "
                         "an image's tokens in row-major order")
    return solver_obj, value_init, reserve


def _check_layers(survey: ModelSurvey, layers, offsets, kernel_size: int, per_layer_offsets: bool, value_init: str):
    """The chosen attention layers (name, adapter), those skipped, and each one's relative bias
    (or None), once every chosen layer is known to take an impulse (one whose output is no
    projection of its context only with ``value_init='keep'``: impulse then sets its q and k alone)."""
    chosen, skipped = layers_to_write(survey, layers)
    if offsets is not None:  # one per head of each chosen layer (a throwaway generator: none drawn from the caller's)
        resolve_offsets(chosen, offsets, kernel_size, per_layer_offsets, torch.Generator().manual_seed(0))
    # What the model computes decides next (a layout error would hide it): every chosen layer must compute plain
    # softmax(q kᵀ·scale + bias) from the q/k writes, normalising neither q nor k (the solvers design q kᵀ itself).
    # A layer whose output is no projection of its context (LeViT's): impulse sets its q and k alone, unless
    # asked for the value path too
    check_settable(survey, chosen, "impulse", accept=frozenset({NO_PROJECTION} if value_init == "keep" else ()),
                   writes="qk" if value_init == "keep" else "qkvo")
    for name, ad in chosen:
        if ad.qk_normalised and survey.relative_bias(name, ad) is None:
            raise ValueError(
                f"impulse cannot set the attention of layer {name!r} ({type(ad.module).__name__}): q and k are "
                "normalised after their projections (q_norm/k_norm), and the impulse solvers design q kᵀ before "
                "any norm, so the maps would miss their targets; nothing was written. Use 'mimetic', or build "
                "the model without the q/k norm for the init")
    return chosen, skipped, [survey.relative_bias(name, ad) for name, ad in chosen]


def _finish_impulse(plan: Plan, survey: ModelSurvey, placed: Placed, skipped, value_init: str, vo_gamma: float,
                    vo_delta: float, pos_embed: torch.Tensor | None, solver, reserve: str) -> None:
    """What every carrier's plan gets alike: the value path, the reservation and the check
    after the write (which also holds the layers a residual reservation keeps position exactly
    readable in to that on a probe image, where the solver promises it)."""
    exact = solver.exact
    held = {n for r in placed.reservations if r.mode == "residual" for n in r.layers} \
        if exact and solver.argmax_on_images() else set()
    if value_init == "mimetic":  # W_v W_o = γZ − δI on every chosen layer
        for _, ad in placed.chosen:
            wv, wo, _ = mimetic_vo(ad.dim, ad.num_heads * ad.value_dim, gamma=vo_gamma, delta=vo_delta,
                                   generator=placed.gen)
            plan.add(ad.vo_writes(wv, wo))
    for reservation in placed.reservations:
        reservation.plan(plan)
    plan.checks.append(impulse_check(survey, placed.chosen, placed.offsets, placed.layouts, pos_embed, exact=exact,
                                     reserved=bool(placed.reservations),
                                     held=(held, reserve == "residual")))
    finish_plan(plan, survey, "impulse", placed.chosen, skipped)


def _check_causal_targets(placed) -> None:
    """A causal layer (each token attends to itself and the tokens before it) masks a target
    after its query: refused, naming the layer and the offset, before anything is written."""
    for (name, ad), offsets, layout in zip(placed.chosen, placed.offsets, placed.layouts):
        ahead = [tuple(o) for o in offsets if ad.causal and o[0] * layout.grid[1] + o[1] > 0]
        if ahead:
            raise ValueError(
                f"impulse cannot point the heads of layer {name!r} ({type(ad.module).__name__}) at offset {ahead[0]}: "
                "the layer is causal (each token attends only to itself and the tokens before it), so a target "
                "after its query is masked; nothing was written. Pass offsets= targets at or before each query "
                "(dy < 0, or dy = 0 and dx ≤ 0), or use 'mimetic'")


# Where a layer carries position → the planner that puts each head's impulse there.
IMPULSE_CARRIERS: dict[str, Callable[[ImpulseRequest, Plan], Placed]] = {
    "relative": plan_on_relative,    # a relative bias table, or the MLP that makes it (Swin, BEiT, Swin-V2)
    "rotary": plan_on_rotary,        # the rotation of q and k (RoPE ViTs)
    "embedding": plan_on_embedding,  # an absolute embedding added to the tokens (ViT, DeiT, ConViT)
}


def position_carrier(chosen, biases) -> str:
    """The :data:`IMPULSE_CARRIERS` key of the chosen layers (name, adapter), given each one's
    relative bias (or None); a ValueError when they carry position in different ways."""
    if any(b is not None for b in biases):
        if not all(b is not None for b in biases):
            raise ValueError("some chosen attention layers have a relative position bias and others do not; "
                             "initialise them separately (layers=)")
        return "relative"
    if any(ad.rotary is not None for _, ad in chosen):
        if not all(ad.rotary is not None for _, ad in chosen):
            raise ValueError("some chosen attention layers rotate q and k by position (RoPE) and others do not; "
                             "initialise them separately (layers=)")
        return "rotary"
    return "embedding"


def _solver_defaults(options: dict) -> dict[str, object]:
    """The defaults of the options the solver ``options`` name (the default solver's) takes."""
    solver = options.get("solver", inspect.signature(plan_impulse).parameters["solver"].default)
    try:
        fields = dataclasses.fields(IMPULSE_SOLVERS.get(solver))
    except (ValueError, TypeError):  # an unknown solver: refused where the init runs
        return {}
    return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


plan_impulse.option_defaults = _solver_defaults  # read by registry.option_defaults
impulse_init_ = register_planner("impulse", plan_impulse, target="attention")
