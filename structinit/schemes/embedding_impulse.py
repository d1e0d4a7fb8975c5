"""``impulse`` for attention whose position comes with the tokens: an absolute position
embedding added before the first layer (ViT, DeiT, ConViT, vit-pytorch's models).

The solver (:data:`structinit.functional.impulse_solvers.IMPULSE_SOLVERS`) designs each
head's q and k from the position-only pseudo input LayerNorm(PE), the grid rows of the model's
position embedding (or a sin-cos table it writes there first), so that head h's map on it puts
its mass on the token at its offset. With a reservation, the patch embedding (and every
residual write) is projected off the subspace the q/k read position from, so that content
cannot move the maps off their structure (:mod:`structinit.schemes.reservation`)."""

from __future__ import annotations

import torch

from structinit.adapters import TokenLayout, grid_pos_embed, infer_layout
from structinit.adapters.layout import layout_position, pos_embed_writes, stage_layout
from structinit.adapters.position import NOT_FOUND
from structinit.adapters.probe import _rows, token_candidates
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.token_order import layer_windows
from structinit.functional.impulse_solvers import LayerSpec
from structinit.functional.targets import check_kernel_size
from structinit.schemes.impulse_request import ImpulseRequest, Placed
from structinit.schemes.plan import Plan
from structinit.schemes.reservation import resolve_reservation
from structinit.utils import check_finite, make_generator


def plan_on_embedding(request: ImpulseRequest, plan: Plan) -> Placed:
    """The embedding carrier (module doc): the layout from the model (or ``grid=`` /
    ``num_prefix_tokens=``), then per stage (the layers that take the model's position embedding,
    and each later stage that adds its own after a merge) the PE the solver works from (and its
    rewrite, if the solver has one), the reservation, and each layer's solved q and k with its
    record."""
    survey, chosen = request.survey, request.chosen
    layout = infer_layout(survey, request.grid, request.num_prefix_tokens)
    layouts = _layer_layouts(survey, chosen, layout)
    gen = make_generator(request.generator, request.seed)
    offsets = request.resolve_offsets(request.solver_obj.default_offsets, gen)
    stages: dict[int | None, list[int]] = {}  # the layers of each stage, by the PE they take (None: the model's)
    for i, lay in enumerate(layouts):
        stages.setdefault(None if lay.position is None else id(lay.position), []).append(i)
    placed, reservations = [None] * len(chosen), []
    for key, index in stages.items():
        own = layout if key is None else layouts[index[0]]
        got, reservation = _plan_stage(request, plan, own, [chosen[i] for i in index], [layouts[i] for i in index],
                                       [offsets[i] for i in index], gen, main=key is None)
        reservations += [reservation] if reservation is not None else []
        for i, offs in zip(index, got):
            placed[i] = offs
    return Placed(chosen, layouts, placed, gen, reservations)


def _plan_stage(request: ImpulseRequest, plan: Plan, layout: TokenLayout, chosen, layouts, offsets, gen, main: bool):
    """One stage's writes: its PE (rewritten if the solver does), its reservation, its layers'
    q and k. Returns (the offsets placed per layer, the reservation or None)."""
    survey, solver = request.survey, request.solver_obj
    check_kernel_size(request.kernel_size, layout.grid)
    dims = sorted({ad.dim for _, ad in chosen})
    if len(dims) > 1:
        raise ValueError(f"the chosen attention layers take different widths {dims}; init them separately "
                         "(layers=)")
    dim = dims[0]
    pe = _position_embedding(survey, layout, dim, request.pos_embed if main else None, solver, plan)
    reservation = None
    if request.reserve != "none":
        # The basis comes from the PE as the model will hold it (its dtype), not the float64 one.
        pe_dst = grid_pos_embed(survey, layout) if request.pos_embed is None or not main else None
        stored = pe if pe is None or pe_dst is None else pe.to(pe_dst.dtype).double()
        reservation = resolve_reservation(survey, chosen, stored, request.reserve, "impulse", layout)
    x = solver.pseudo_input(pe, grid=layout.grid, dim=dim, generator=gen)
    specs = [LayerSpec(tuple(offs), ad.head_dim, ad.scale) for (_, ad), offs in zip(chosen, offsets)]
    per_layer = []  # the offsets the solver placed
    for (_, ad), lay, solved in zip(chosen, layouts, solver.solve(x, layout.grid, specs, gen)):
        record = {"offsets": list(solved.offsets), "grid": lay.grid,
                  "num_prefix_tokens": lay.num_prefix_tokens, "solver": request.solver}
        if lay.position is not None:
            record["pos_embed"] = lay.position.pos_embed_name
        plan.add_qk(ad, solved.wq, solved.wk, record=record)
        plan.add(ad.positional_writes(list(solved.offsets), layout.grid))  # a map's position-only part, if any
        per_layer.append(list(solved.offsets))
    return per_layer, reservation


def _layer_layouts(survey: ModelSurvey, chosen, layout: TokenLayout) -> list[TokenLayout]:
    """Per chosen layer, ``layout`` with the prefix tokens the layer really receives (the
    probe's count): a class token that joins in front of the grid after the first layers
    (ConViT) is a prefix of the later ones; a layer that attends within windows cut from the
    grid gets its windows (:func:`~structinit.adapters.token_order.layer_windows`). A layer that
    receives any other count is refused before anything is written."""
    joining = survey.position.joining_prefix_tokens
    out, odd = [], []
    for name, ad in chosen:
        verdict = survey.attention.verdict(name)
        tokens = None if verdict is None else verdict.tokens
        if tokens is None or tokens == layout.num_tokens:
            out.append(layout)
        elif joining and tokens == layout.num_tokens + joining:
            out.append(TokenLayout(layout.grid, layout.num_prefix_tokens + joining))
        else:  # windows cut from the grid (SAM's ViT), each token's position read off the forward; a later
            # stage's own position embedding; else refused
            out.append(layer_windows(survey, name, ad, layout) or _stage(survey, name, ad, tokens))
            if out[-1] is None:
                odd.append((name, ad, tokens))
    if odd:
        _refuse_unplaced(survey, odd)
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
            + " the grid=/num_prefix_tokens= the layers really use" + _resized(survey.probe, fit))
    return out


def _resized(probe, fit: list) -> str:
    """Advice for a model no layer of which takes its embedding's grid on an image probe: its
    forward may resize the embedding to the probe's grid (a size the model does not state)."""
    if fit or not (isinstance(probe, torch.Tensor) and probe.ndim == 4):
        return ""
    return (f"; or, where the forward resizes its position embedding to the image's grid (the probe was "
            f"{probe.shape[-2]}×{probe.shape[-1]} px), build the model with an embedding of the grid it runs on: "
            "impulse writes each head's offset on the embedding's own grid, which a resize blurs")


def _stage(survey: ModelSurvey, name: str, ad, tokens: int | None) -> TokenLayout | None:
    """The layout of a layer off the model's first grid that takes a later stage's own position
    embedding (added after a merge: Visformer's, CrossViT's second branch), attending over the
    stage's grid or within windows of it (NesT's blocks); or None."""
    found = None if tokens is None else survey.stage_position(name, ad)
    if found is None or found.pos_embed is None:
        return None
    whole = found.grid and TokenLayout(tuple(found.grid), found.num_prefix_tokens or 0, position=found)
    return stage_layout(found, tokens) or (whole and layer_windows(survey, name, ad, whole))


def _refuse_unplaced(survey: ModelSurvey, odd: list) -> None:
    """Refuse, naming the mechanism, layers off the model's layout whose tokens carry no position
    of their own: a later stage of another width (after a pooling or merge), with no relative or
    rotary position in the layer and no free tensor of that width with more than one row that
    could be added to its tokens. Impulse shapes a map from position in q and k; such a stage has
    only what the earlier layers and the merge made of the first stage's position, which no init
    can set in closed form."""
    if not survey.attention.probed:
        return
    model = survey.model
    own = {id(p) for name in [n for n, _ in survey.layers()] + [n for n, _ in survey.attention.skipped()]
           for p in model.get_submodule(name).parameters()}  # attention weights held as raw Parameters
    blind = [(n, ad, t) for n, ad, t in odd if ad.relative is None and ad.rotary is None
             and not [c for _, c in token_candidates(model, ad.dim, any_axis=True)
                      if _rows(c) > 1 and id(c) not in own]]
    if not blind:
        return
    name, ad, tokens = blind[0]
    widths = sorted({a.dim for _, a, _ in blind})
    raise ValueError(
        f"impulse: {len(blind)} attention layer(s) (the first {name!r}, {type(ad.module).__name__}, {tokens} tokens of "
        f"width {ad.dim}) lie off the grid of the model's position embedding, and their tokens carry no position "
        f"of their own: the model holds no tensor of width {', '.join(map(str, widths))} with more than one row "
        "outside its layers' weights to add to them, and the layers have no relative or rotary position (a "
        "later stage after a pooling or a merge, whose position is what the earlier layers made of the first "
        "stage's). Impulse builds each head's map from position in q and k, so it cannot shape these maps; "
        "nothing was written. Initialise the layers on the embedding's grid alone (layers=), or use 'mimetic', "
        "which needs no position")


def _position_embedding(survey, layout, dim, pos_embed, solver, plan: Plan) -> torch.Tensor | None:
    """The (N, D) float64 PE the solver works from; plans the solver's PE rewrite, if any.

    The model's PE is checked finite only where the solver reads it: a solver that overwrites
    it must not be blocked by NaNs it never reads.
    """
    pe_dst = grid_pos_embed(survey, layout)
    pe = pos_embed if pos_embed is not None else pe_dst
    if pos_embed is None and pe is not None and pe.shape[-1] != dim:
        raise ValueError(
            f"impulse: the attention layers read {dim}-wide tokens that they make inside from the model's "
            f"{pe.shape[-1]}-wide ones (a slice of the channels, or a projection to another width, before their q, k "
            "and v), and impulse designs q and k on the tokens the position embedding is added to; nothing was "
            "written. Use 'mimetic', which reads each layer where its projections do")
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
    learned = pos_embed is None and pe_dst is not None and layout_position(survey, layout).pos_embed.requires_grad
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
    plan.add(pos_embed_writes(survey, layout, new_pe))
    return new_pe
