"""Impulse (structured) attention initialisation: every head starts as a one-hot k×k
convolution on the token grid. The maths and the solvers live in
:mod:`structinit.functional`; this module finds the layers, resolves offsets and the
position embedding, and plans the writes."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import torch

from structinit.adapters import TokenLayout, grid_pos_embed, infer_layout, select_layers
from structinit.adapters.position import NOT_FOUND
from structinit.adapters.position_mlp import PositionMlpBias
from structinit.adapters.survey import ModelSurvey
from structinit.functional.impulse_solvers import IMPULSE_SOLVERS, LayerSpec, make_impulse_solver
from structinit.functional.mimetic import mimetic_vo
from structinit.functional.targets import (
    Offset,
    check_kernel_size,
    check_offsets,
    enumerated_offsets,
    random_offsets,
)
from structinit.schemes.checks import check_settable, finish_plan, impulse_check
from structinit.schemes.plan import Plan
from structinit.schemes.position_mlp_impulse import POSITION_MLP_TARGET_MASS, plan_position_mlp_impulse
from structinit.schemes.registry import register_planner
from structinit.schemes.relative_impulse import check_relative_options, plan_relative_impulse
from structinit.schemes.reservation import RESERVE_MODES, resolve_reservation
from structinit.schemes.rope_impulse import plan_rope_impulse, rotary_at_grid
from structinit.utils import check_choice, check_finite, check_options, make_generator

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
            readable in every layer (see :mod:`structinit.functional.reservation`);
            ``'auto'`` is ``'residual'`` where the model allows it and otherwise warns and
            reserves nothing; ``'none'`` reserves nothing. Default: the solver's (``'auto'``
            for analytic, ``'none'`` for the published closed_form and gd).

    Solver options:
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
    row and an ordinary column); no head targets them and fidelity ignores their rows.

    The offsets are remembered on each attention module (``module.structinit_impulse``) for
    :func:`structinit.impulse_fidelity` (see :func:`structinit.get_record`). Returns the
    :class:`structinit.Plan`; ``impulse_init_`` commits it and returns ``model``.

    Examples:
        >>> model = structinit.create_model("vit_tiny_patch2_32")
        >>> _ = structinit.impulse_init_(model, kernel_size=3, target_mass=0.5, seed=0)
        >>> bool((structinit.impulse_fidelity(model)["hit"] == 1).all())
        True
    """
    # Options are checked before anything else; an unknown one lists the solver's options and ours.
    own = [p.name for p in inspect.signature(plan_impulse).parameters.values()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "survey"]
    check_options(IMPULSE_SOLVERS.get(solver), solver_options, f"impulse solver {solver!r}",
                  hint=f"; every impulse init also takes {', '.join(own)}")
    solver_obj = make_impulse_solver(solver, **solver_options)
    value_init = check_choice("value_init", solver_obj.default_value_init if value_init is None else value_init,
                              VALUE_INITS)
    reserve_given = reserve
    reserve = check_choice("reserve", solver_obj.default_reserve if reserve is None else reserve, RESERVE_MODES)
    check_kernel_size(kernel_size)
    if grid is None and survey.takes_token_ids:  # before anything is read: a sequence has no grid to shape
        raise ValueError(f"impulse cannot set {type(survey.model).__name__}: it reads token ids, a 1-D sequence with "
                         "no grid of image tokens, and impulse shapes attention as convolutions on a 2-D grid; "
                         "nothing was written. Use 'mimetic' (it needs no grid), or pass grid=(h, w) if the ids are "
                         "an image's tokens in row-major order")
    chosen = select_layers(survey.layers(), layers)
    skipped = survey.attention.skipped() if layers is None else []
    if offsets is not None:  # checked before the probe (a throwaway generator: nothing is drawn from the caller's)
        _resolve_offsets(chosen, offsets, kernel_size, per_layer_offsets, torch.Generator().manual_seed(0))
    # What the model computes decides next (a layout error would hide it): every chosen layer must compute plain
    # softmax(q kᵀ·scale + bias) from the q/k writes, normalising neither q nor k (the solvers design q kᵀ itself).
    check_settable(survey, chosen, "impulse")
    for name, ad in chosen:
        if ad.qk_normalised and survey.relative_bias(name, ad) is None:
            raise ValueError(
                f"impulse cannot set the attention of layer {name!r} ({type(ad.module).__name__}): q and k are "
                "normalised after their projections (q_norm/k_norm), and the impulse solvers design q kᵀ before "
                "any norm, so the maps would miss their targets; nothing was written. Use 'mimetic', or build "
                "the model without the q/k norm for the init")
    biases = [survey.relative_bias(name, ad) for name, ad in chosen]
    relative = [b is not None for b in biases]
    plan, reservation = Plan(), None
    if any(relative):  # Swin, BEiT: position lives in a relative bias table, written directly
        if not all(relative):
            raise ValueError("some chosen attention layers have a relative position bias and others do not; "
                             "initialise them separately (layers=)")
        mlp = [isinstance(b, PositionMlpBias) for b in biases]  # Swin-V2, relpos-MLP ViTs: an MLP makes the table
        if any(mlp) and not all(mlp):
            raise ValueError("some chosen attention layers store their relative position bias table and others "
                             "generate it with an MLP; initialise them separately (layers=)")
        check_relative_options(chosen, solver, solver_options, {
            "grid": grid, "num_prefix_tokens": num_prefix_tokens, "pos_embed": pos_embed, "reserve": reserve_given},
            **({"carrier": "a relative position bias an MLP generates, whose layers impulse fits"} if any(mlp) else {}))
        layouts = [TokenLayout(b.grid, b.num_prefix_tokens) for b in biases]
        gen = make_generator(generator, seed)
        per_layer = _resolve_offsets(chosen, "random" if offsets is None else offsets, kernel_size,
                                     per_layer_offsets, gen)
        if any(mlp):
            plan_position_mlp_impulse(plan, chosen, biases, per_layer,
                                      solver_options.get("target_mass", POSITION_MLP_TARGET_MASS), gen)
        else:
            plan_relative_impulse(plan, chosen, biases, per_layer, solver_obj.target_mass)
    elif any(ad.rotary is not None for _, ad in chosen):  # RoPE: position lives in the rotation of q and k
        if not all(ad.rotary is not None for _, ad in chosen):
            raise ValueError("some chosen attention layers rotate q and k by position (RoPE) and others do not; "
                             "initialise them separately (layers=)")
        check_relative_options(chosen, solver, solver_options, {
            "num_prefix_tokens": num_prefix_tokens, "pos_embed": pos_embed, "reserve": reserve_given},
            carrier="the rotation of q and k (RoPE), which impulse sets through content-free q and k")
        if grid is not None or any(ad.rotary_received for _, ad in chosen):
            # A rotation the model hands its layers is read again now, on the grid asked for (a learned
            # RoPE's angles move in training, and the survey's probe may be of another size).
            chosen = rotary_at_grid(survey, chosen, tuple(grid) if grid is not None else chosen[0][1].rotary.grid)
        layouts = [TokenLayout(ad.rotary.grid, ad.rotary.num_prefix_tokens) for _, ad in chosen]
        for lay in layouts:
            check_kernel_size(kernel_size, lay.grid)
        gen = make_generator(generator, seed)
        per_layer = _resolve_offsets(chosen, "random" if offsets is None else offsets, kernel_size,
                                     per_layer_offsets, gen)
        plan_rope_impulse(survey, plan, chosen, per_layer, solver_obj.target_mass)
    else:
        layout = infer_layout(survey, grid, num_prefix_tokens)
        check_kernel_size(kernel_size, layout.grid)
        layouts = _layer_layouts(survey, chosen, layout)
        dims = sorted({ad.dim for _, ad in chosen})
        if len(dims) > 1:
            raise ValueError(f"the chosen attention layers take different widths {dims}; init them separately "
                             "(layers=)")
        dim = dims[0]
        gen = make_generator(generator, seed)
        offsets = _resolve_offsets(chosen, solver_obj.default_offsets if offsets is None else offsets, kernel_size,
                                   per_layer_offsets, gen)
        pe = _position_embedding(survey, layout, dim, pos_embed, solver_obj, plan)
        if reserve != "none":
            # The basis comes from the PE as the model will hold it (its dtype), not the float64 one.
            pe_dst = grid_pos_embed(survey, layout) if pos_embed is None else None
            stored = pe if pe is None or pe_dst is None else pe.to(pe_dst.dtype).double()
            reservation = resolve_reservation(survey, chosen, stored, reserve, "impulse", layout)
        x = solver_obj.pseudo_input(pe, grid=layout.grid, dim=dim, generator=gen)
        specs = [LayerSpec(tuple(offs), ad.head_dim, ad.scale) for (_, ad), offs in zip(chosen, offsets)]
        per_layer = []  # the offsets the solver placed
        for (_, ad), lay, solved in zip(chosen, layouts, solver_obj.solve(x, layout.grid, specs, gen)):
            record = {"offsets": list(solved.offsets), "grid": lay.grid,
                      "num_prefix_tokens": lay.num_prefix_tokens, "solver": solver}
            plan.add_qk(ad, solved.wq, solved.wk, record=record)
            plan.add(ad.positional_writes(list(solved.offsets), layout.grid))  # a map's position-only part, if any
            per_layer.append(list(solved.offsets))
    if value_init == "mimetic":  # W_v W_o = γZ − δI on every chosen layer
        for _, ad in chosen:
            wv, wo, _ = mimetic_vo(ad.dim, ad.num_heads * ad.head_dim, gamma=vo_gamma, delta=vo_delta, generator=gen)
            plan.add(ad.vo_writes(wv, wo))
    if reservation is not None:
        reservation.plan(plan)
    check = impulse_check(survey, chosen, per_layer, layouts)
    if check is not None:
        plan.checks.append(check)
    finish_plan(plan, survey, "impulse", chosen, skipped)
    return plan


def _layer_layouts(survey: ModelSurvey, chosen, layout: TokenLayout) -> list[TokenLayout]:
    """Per chosen layer, ``layout`` with the prefix tokens the layer really receives (the
    probe's count): a class token that joins in front of the grid after the first layers
    (ConViT) is a prefix of the later ones. A layer that receives any other count is refused
    before anything is written."""
    joining = survey.position.joining_prefix_tokens
    out, odd = [], []
    for name, ad in chosen:
        verdict = survey.attention.verdict(name)
        tokens = None if verdict is None else verdict.tokens
        if tokens is None or tokens == layout.num_tokens:
            out.append(layout)
        elif joining and tokens == layout.num_tokens + joining:
            out.append(TokenLayout(layout.grid, layout.num_prefix_tokens + joining))
        else:
            out.append(None)
            odd.append((name, ad, tokens))
    if odd:
        name, ad, tokens = odd[0]
        index = {n: i for i, (n, _) in enumerate(survey.layers())}
        fit = [index[n] for (n, _), lay in zip(chosen, out) if lay is not None and n in index]
        raise ValueError(
            f"impulse: attention layer {name!r} ({type(ad.module).__name__}) receives {tokens} tokens, but the "
            f"model's layout is {layout.num_prefix_tokens} prefix + {layout.num_patches} grid "
            f"({layout.grid[0]}×{layout.grid[1]}) tokens, and no class token of the model joins later to make up "
            f"the difference ({len(odd)} layer(s) so: a later stage on another grid, or tokens the model adds); "
            "nothing was written. "
            + (f"Initialise the layers that take the grid as laid out, layers={fit}, or pass" if fit else "Pass")
            + " the grid=/num_prefix_tokens= the layers really use")
    return out


impulse_init_ = register_planner("impulse", plan_impulse, target="attention")


def _position_embedding(survey, layout, dim, pos_embed, solver, plan: Plan) -> torch.Tensor | None:
    """The (N, D) float64 PE the solver works from; plans the solver's PE rewrite, if any.

    The model's PE is checked finite only where the solver reads it: a solver that overwrites
    it must not be blocked by NaNs it never reads.
    """
    pe_dst = grid_pos_embed(survey, layout)
    pe = pos_embed if pos_embed is not None else pe_dst
    if pe is not None:
        if tuple(pe.shape[-2:]) != (layout.num_patches, dim):
            raise ValueError(f"pos_embed has shape {tuple(pe.shape)}, expected ({layout.num_patches}, {dim})")
        pe = pe.detach().reshape(layout.num_patches, -1).double().cpu().clone()
    if solver.reads_model_pe():
        if pe is None:
            raise ValueError(
                f"solver={solver.name!r} builds attention from the position embedding, but {NOT_FOUND}; "
                "pass pos_embed=<(N, D) tensor that the model adds to its tokens>"
            )
        check_finite("pos_embed", pe)
    learned = pos_embed is None and pe_dst is not None and pe_dst.requires_grad
    new_pe = solver.position_embedding(pe, learned=learned, grid=layout.grid, dim=dim)
    if new_pe is None:
        return pe
    if pe is None:
        raise ValueError(
            f"solver={solver.name!r} with a pe_scale writes the model's position embedding, but {NOT_FOUND}; "
            "pass pos_embed=<(N, D) tensor the model adds to its tokens> and pe_scale=None"
        )
    if pos_embed is not None:
        raise ValueError(
            f"solver={solver.name!r} with a pe_scale rewrites the model's position embedding, but it "
            "was passed in as pos_embed=; pass pe_scale=None to use it unchanged"
        )
    plan.add([(pe_dst, new_pe)])
    return new_pe


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
            counts = sorted({a.num_heads for _, a in chosen})
            hint = "give one (dy, dx) per head"
            if len(counts) > 1:  # Swin: the head count grows per stage; one list cannot fit all of them
                hint += (f"; the chosen layers have {', '.join(map(str, counts))} heads: init each group in its own "
                         "call, layers=[...] with a list of that many offsets, or use offsets='random'")
            raise ValueError(f"offsets has {len(offs)} entries but layer {name!r} has {ad.num_heads} heads; {hint}")
    return [offs for _ in chosen]
