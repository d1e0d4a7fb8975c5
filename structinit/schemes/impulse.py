"""Impulse (structured) attention initialisation: every head starts as a one-hot k×k
convolution on the token grid. The maths lives in :mod:`structinit.solvers`; this module
finds the layers, resolves offsets and the position embedding, and writes the weights."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from structinit.adapters import AttentionAdapter, find_attention_layers
from structinit.layout import TokenLayout, grid_pos_embed, infer_layout
from structinit.mimetic_math import mimetic_vo
from structinit.posembed import sincos_2d
from structinit.schemes.base import Plan, check_finite, check_options, make_generator, select_layers
from structinit.schemes.registry import register_scheme
from structinit.solvers.analytic import impulse_qk
from structinit.solvers.closed_form import closed_form_qk, pinv_projector
from structinit.solvers.gd import gd_qk
from structinit.solvers.pseudo import pseudo_input
from structinit.targets import (
    Offset,
    check_kernel_size,
    check_offsets,
    enumerated_offsets,
    random_offsets,
)

VALUE_INITS = ("keep", "mimetic")


@dataclass
class _Context:
    layout: TokenLayout
    layers: list[tuple[str, AttentionAdapter]]
    offsets: list[list[Offset]]          # per selected layer
    pe: torch.Tensor | None              # (N, D) current grid rows of the PE, detached copy
    pe_dst: torch.Tensor | None          # writable view of those rows in the model, or None
    generator: torch.Generator

    @property
    def dim(self) -> int:
        return self.layers[0][1].dim


def _ln(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.double(), (x.shape[-1],), eps=1e-6)


def _need_pe(ctx: _Context, solver: str) -> torch.Tensor:
    """The position embedding, for solvers that read it (checked finite here, not earlier:
    a solver that overwrites the PE must not be blocked by NaNs it never reads)."""
    if ctx.pe is None:
        raise ValueError(
            f"solver={solver!r} builds attention from the position embedding, but the model has "
            "no `pos_embed`; pass pos_embed=<(N, D) tensor that the model adds to its tokens>"
        )
    check_finite("pos_embed", ctx.pe)
    return ctx.pe


def _set_pe(ctx: _Context, plan: Plan, new_pe: torch.Tensor, solver: str) -> torch.Tensor:
    if ctx.pe_dst is None and ctx.pe is None:
        raise ValueError(
            f"solver={solver!r} with a pe_scale writes the model's `pos_embed`, but the model has "
            "none; pass pos_embed=<(N, D) tensor the model adds to its tokens> and pe_scale=None"
        )
    if ctx.pe_dst is None:
        raise ValueError(
            f"solver={solver!r} with a pe_scale rewrites the model's position embedding, but it "
            "was passed in as pos_embed=; pass pe_scale=None to use it unchanged"
        )
    plan.add([(ctx.pe_dst, new_pe)])
    return new_pe


def _add_value_init(ctx: _Context, plan: Plan, value_init: str, gamma: float, delta: float) -> None:
    if value_init not in VALUE_INITS:
        raise ValueError(f"value_init={value_init!r}: valid names are {', '.join(VALUE_INITS)}")
    if value_init == "keep":
        return
    for _, ad in ctx.layers:
        wv, wo, _ = mimetic_vo(ad.dim, ad.num_heads * ad.head_dim, gamma, delta, generator=ctx.generator)
        plan.add(ad.vo_writes(wv, wo))


def _record(ctx: _Context, offsets: list[Offset], solver: str) -> dict:
    return {"offsets": list(offsets), "grid": ctx.layout.grid,
            "num_prefix_tokens": ctx.layout.num_prefix_tokens, "solver": solver}


# Defaults chosen by accuracy (bench/data_efficiency.py, CIFAR-10 5k images, README): PE ×1
# trains best (×2 −2.0 points, ×4 −4.0); sharpness 0.3–0.5 is flat, 0.8 −0.9; mimetic V/O −1.1.
# pe_scale=4 keeps the structure on real content in every layer (fidelity), but the PE then
# drowns the patch content in the residual stream and training suffers.
def _analytic(ctx: _Context, plan: Plan, *, target_mass: float = 0.5, pe_scale: float | None = 1.0,
              ridge: float = 2e-3, value_init: str = "keep", vo_gamma: float = 0.4, vo_delta: float = 0.4):
    """See :func:`impulse_init_`."""
    d = ctx.dim
    if pe_scale is not None:
        if not pe_scale > 0:
            raise ValueError(f"pe_scale={pe_scale}: must be > 0 (or None to keep the model's PE)")
        pe = _set_pe(ctx, plan, pe_scale * sincos_2d(ctx.layout.grid, d, dtype=torch.float64), "analytic")
    else:
        pe = _need_pe(ctx, "analytic")
    if not ridge > 0:
        raise ValueError(f"ridge={ridge}: must be > 0")
    z = _ln(pe)
    cache: dict = {}  # layers sharing offsets and head shape share the solution
    for (_, ad), offs in zip(ctx.layers, ctx.offsets):
        key = (tuple(offs), ad.head_dim, ad.scale)
        if key not in cache:
            wq, wk = impulse_qk(z, ctx.layout.grid, offs, ad.head_dim, target_mass, ad.scale, ridge)
            # Keep them in nn.Linear memory order (heads, r, D), viewed as (heads, D, r): every
            # layer's write is then a view, not another transposed copy.
            cache[key] = tuple(w.transpose(1, 2).contiguous().transpose(1, 2) for w in (wq, wk))
        plan.add_qk(ad, *cache[key], record=_record(ctx, offs, "analytic"))
    _add_value_init(ctx, plan, value_init, vo_gamma, vo_delta)


def _closed_form(ctx: _Context, plan: Plan, *, pe_scale: float | None = 18.0, qk_norm: float = 7.0,
                 logit_scale: float = 1000.0, noise: float = 3.0, pinv_rank: int | None = None,
                 value_init: str = "mimetic", vo_gamma: float = 0.4, vo_delta: float = 0.4):
    """See :func:`impulse_init_`."""
    pe = _need_pe(ctx, "closed_form")
    learned = ctx.pe_dst is not None and ctx.pe_dst.requires_grad
    if pe_scale is not None and learned:  # the 2025 code scales a *learned* PE only
        pe = _set_pe(ctx, plan, pe * pe_scale, "closed_form")
    p = _ln(pe)
    projectors: dict = {}
    for (_, ad), offs in zip(ctx.layers, ctx.offsets):
        rank = pinv_rank or ad.head_dim
        if rank not in projectors:
            projectors[rank] = pinv_projector(p, rank)
        wq, wk = closed_form_qk(p, ctx.layout.grid, offs, ad.head_dim, ctx.generator, logit_scale,
                                noise, qk_norm, projector=projectors[rank])
        plan.add_qk(ad, wq, wk, record=_record(ctx, offs, "closed_form"))
    _add_value_init(ctx, plan, value_init, vo_gamma, vo_delta)


def _gd(ctx: _Context, plan: Plan, *, steps: int = 10_000, lr: float = 1e-4, renorm_every: int = 100,
        pseudo: str = "pe", share_solution: bool = True, value_init: str = "keep",
        vo_gamma: float = 0.4, vo_delta: float = 0.4, callback=None):
    """See :func:`impulse_init_`."""
    n, d = ctx.layout.num_patches, ctx.dim
    pe = _need_pe(ctx, "gd") if "pe" in pseudo else None
    x = pseudo_input(pseudo, pe, (n, d), ctx.generator)
    solved = None
    for (_, ad), offs in zip(ctx.layers, ctx.offsets):
        if solved is None or not share_solution:
            solved = gd_qk(x, ctx.layout.grid, offs, ad.head_dim, ctx.generator, steps, lr,
                           renorm_every, ad.scale, callback)
            solved_offs = offs
        plan.add_qk(ad, *solved, record=_record(ctx, solved_offs, "gd"))
    _add_value_init(ctx, plan, value_init, vo_gamma, vo_delta)


SOLVERS = {"analytic": _analytic, "closed_form": _closed_form, "gd": _gd}
_DEFAULT_OFFSETS = {"analytic": "random", "closed_form": "enumerated", "gd": "random"}


@register_scheme("impulse")
def impulse_init_(
    model: nn.Module,
    solver: str = "analytic",
    *,
    kernel_size: int = 3,
    offsets: str | Sequence[Offset] | None = None,
    layers: Iterable[int] | None = None,
    per_layer_offsets: bool = False,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int | None = None,
    pos_embed: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    **solver_options,
) -> nn.Module:
    r"""Make every head of the chosen attention layers start as a one-hot k×k convolution.

    Head h of a layer gets an offset (dy, dx) in the k×k kernel; its attention map at init
    approximates the shift matrix H (:func:`structinit.impulse_matrix`): token (y, x) attends
    to (y+dy, x+dx). Only the q/k weights (biases set to 0), optionally v/proj, and (for
    some solvers) the grid rows of ``pos_embed`` are written; everything else is untouched.

    Args:
        model: any model whose attention layers an adapter understands (timm / structinit
            ViT, separate q/k/v projections, ``nn.MultiheadAttention``).
        solver: ``'analytic'`` (default; exact, instant — see :mod:`structinit.solvers.analytic`),
            ``'closed_form'`` (2025 paper) or ``'gd'`` (2024 paper).
        kernel_size: odd k ∈ {3, 5, 7, …}, at most the grid side.
        offsets: ``'random'`` (uniform with replacement, per head), ``'enumerated'`` (centre, up,
            right, left, down, diagonals, cycling), or an explicit list of (dy, dx), one per
            head. Default: enumerated for closed_form, random otherwise.
        layers: indices of the attention layers to initialise (default all).
        per_layer_offsets: draw new random offsets for each layer (default: one draw shared
            by all layers, as both papers do).
        grid, num_prefix_tokens: token layout, inferred from the model when omitted.
        pos_embed: the (N, D) position embedding of a model that has no ``pos_embed``.
        generator, seed: source of every random draw (offsets, noise, v/proj).

    Solver options:
        analytic: ``target_mass=0.5`` the mean attention on the target with the position-only
            pseudo input (the sharpness); ``pe_scale=1.0`` writes pe_scale × the 2-D sin-cos
            table into the grid rows of ``pos_embed`` (learned or fixed; ``None`` keeps the
            model's PE and reads the structure out of it); ``ridge=2e-3``;
            ``value_init='keep'|'mimetic'`` with ``vo_gamma=vo_delta=0.4``. The defaults train
            best; ``pe_scale=4`` keeps the maps on their targets with real images in every
            layer (for analysis and figures) but trains worse.
        closed_form: ``pe_scale=18`` (applied to a learned PE only), ``qk_norm=7``,
            ``logit_scale=1000``, ``noise=3``, ``pinv_rank=head_dim``, ``value_init='mimetic'``.
        gd: ``steps=10000``, ``lr=1e-4``, ``renorm_every=100``, ``pseudo='pe'`` (or
            'uniform', 'gaussian', 'pe+uniform', 'pe+gaussian'), ``share_solution=True`` (one
            fit copied to every layer), ``value_init='keep'``, ``callback(step, loss)``.

    Prefix (class/register) tokens are not on the grid: their rows and columns get whatever
    the written q/k weights give their inputs (a zero class token gives logit 0, a uniform
    row and an ordinary column); no head targets them and fidelity ignores their rows.

    The offsets are remembered on each attention module (``module.structinit_impulse``) for
    :func:`structinit.impulse_fidelity`. Returns ``model``.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; valid names: {', '.join(SOLVERS)}")
    check_options(SOLVERS[solver], solver_options, f"impulse solver {solver!r}")
    check_kernel_size(kernel_size)
    chosen = select_layers(find_attention_layers(model), layers)
    layout = infer_layout(model, grid, num_prefix_tokens)
    check_kernel_size(kernel_size, layout.grid)
    dims = sorted({ad.dim for _, ad in chosen})
    if len(dims) > 1:
        raise ValueError(f"the chosen attention layers take different widths {dims}; init them separately (layers=)")
    gen = make_generator(generator, seed)
    offsets = _DEFAULT_OFFSETS[solver] if offsets is None else offsets
    per_layer = _resolve_offsets(chosen, offsets, kernel_size, per_layer_offsets, gen)

    pe_dst = grid_pos_embed(model, layout)
    pe = pos_embed if pos_embed is not None else pe_dst
    if pe is not None:
        if tuple(pe.shape[-2:]) != (layout.num_patches, chosen[0][1].dim):
            raise ValueError(
                f"pos_embed has shape {tuple(pe.shape)}, expected ({layout.num_patches}, {chosen[0][1].dim})"
            )
        pe = pe.detach().reshape(layout.num_patches, -1).double().cpu().clone()
    if pos_embed is not None:
        pe_dst = None
    ctx = _Context(layout, chosen, per_layer, pe, pe_dst, gen)
    plan = Plan()
    SOLVERS[solver](ctx, plan, **solver_options)
    plan.commit()
    return model


def _resolve_offsets(chosen, offsets, kernel_size, per_layer_offsets, gen) -> list[list[Offset]]:
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
            raise ValueError(
                f"offsets has {len(offs)} entries but layer {name!r} has {ad.num_heads} heads; "
                "give one (dy, dx) per head"
            )
    return [offs for _ in chosen]
