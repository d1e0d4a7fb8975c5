"""How faithfully each head implements its impulse: the attention mass on its target and the
argmax hit rate, with the position-only pseudo input or with real images."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from structinit.adapters import TokenLayout, infer_layout, is_token_mixing, select_layers
from structinit.adapters.observe import RealMap, real_maps
from structinit.adapters.position_input import layer_position_input, position_only_maps
from structinit.adapters.probe import first_sample
from structinit.adapters.relative import reachable
from structinit.adapters.survey import ModelSurvey, as_survey
from structinit.adapters.token_order import canonical, layer_windows, maps_on_grid, out_of_order
from structinit.functional.targets import Offset, enumerated_offsets, target_index, target_pairs
from structinit.models import create_model
from structinit.schemes.records import get_record
from structinit.schemes.registry import init_, schemes


def _layer_offsets(chosen, offsets) -> list[list[Offset]]:
    out = []
    for i, (name, ad) in enumerate(chosen):
        if offsets is not None:
            offs = offsets[i] if offsets and isinstance(offsets[0][0], (list, tuple)) else offsets
        else:
            record = get_record(ad.module, "impulse")
            if record is None:
                raise ValueError(
                    f"attention layer {name!r} has no impulse offsets recorded (it was not "
                    "initialised by structinit's impulse scheme in this process); pass offsets="
                )
            offs = record["offsets"]
        if len(offs) != ad.num_heads:
            raise ValueError(f"layer {name!r} has {ad.num_heads} heads but {len(offs)} offsets were given")
        out.append([tuple(o) for o in offs])
    return out


def recorded_layout(model: nn.Module | ModelSurvey, chosen, grid=None, num_prefix_tokens=None) -> TokenLayout:
    """The token layout the impulse init recorded on the ``chosen`` layers; explicit ``grid`` /
    ``num_prefix_tokens`` must agree with it. Without a record it is inferred from the model
    (:func:`structinit.infer_layout`)."""
    records = {name: get_record(ad.module, "impulse") for name, ad in chosen}
    layouts = {name: TokenLayout(tuple(r["grid"]), int(r["num_prefix_tokens"]))
               for name, r in records.items() if r is not None}
    if not layouts:
        return infer_layout(model, grid, num_prefix_tokens)
    distinct = set(layouts.values())
    if len(distinct) > 1:
        raise ValueError(f"the chosen layers were initialised with different token layouts "
                         f"{sorted(map(str, distinct))}; measure them separately (layers=)")
    layout = distinct.pop()
    _check_agrees(layout, grid, num_prefix_tokens, "the impulse init recorded")
    return layout


def _check_agrees(layout: TokenLayout, grid, num_prefix_tokens, source: str) -> None:
    for arg, value, known in (("grid", grid, layout.grid), ("num_prefix_tokens", num_prefix_tokens,
                                                            layout.num_prefix_tokens)):
        if value is not None and (tuple(value) if arg == "grid" else value) != known:
            raise ValueError(f"{arg}={value!r}, but {source} {arg}={known!r} on these layers; "
                             f"omit {arg}= to use it")


def _attention_layers(model: nn.Module | ModelSurvey) -> list:
    """The model's attention layers; a model that mixes its tokens with MLPs instead (an
    MLP-Mixer) is pointed to the measure made for it."""
    try:
        return as_survey(model).layers()
    except ValueError as err:
        model = as_survey(model).model
        if not any(is_token_mixing(m) for m in model.modules()) or not str(err).startswith("no attention layer found"):
            raise
        raise ValueError(f"{type(model).__name__} has no attention layer: it mixes its tokens with MLPs (an "
                         "MLP-Mixer), whose impulse maps are measured by "
                         "structinit.analysis.token_mixing.token_mixing_fidelity(model, images)") from None


def layer_layouts(model: nn.Module | ModelSurvey, chosen, grid=None, num_prefix_tokens=None) -> list[TokenLayout]:
    """The token layout of each chosen layer: its window for a layer with a relative position
    bias (Swin, BEiT; :attr:`~structinit.AttentionAdapter.relative`), else the layout the
    impulse init recorded on it when every such layer has a record, else the model's layout
    (:func:`recorded_layout`), with the windows a layer attends within where they are cut from
    the grid (:func:`~structinit.adapters.token_order.layer_windows`)."""
    model = as_survey(model)
    biases = [model.relative_bias(name, ad) for name, ad in chosen]
    plain = [layer for layer, b in zip(chosen, biases) if b is None]
    records = [get_record(ad.module, "impulse") for _, ad in plain]
    if plain and all(r is not None for r in records):  # each layer's own: a class token may join later (ConViT)
        # a later stage's own position embedding, where the init recorded one, traced again from its layer
        own = iter([TokenLayout(tuple(r["grid"]), int(r["num_prefix_tokens"]),
                                position=model.stage_position(name, ad) if "pos_embed" in r else None)
                    for r, (name, ad) in zip(records, plain)])
        model_layout = None
    else:
        own, model_layout = None, recorded_layout(model, plain, grid, num_prefix_tokens) if plain else None
    out = []
    for (name, ad), rb in zip(chosen, biases):
        if rb is not None:
            out.append(TokenLayout(rb.grid, rb.num_prefix_tokens))
            _check_agrees(out[-1], grid, num_prefix_tokens, "the relative position bias fixes")
            continue
        if own is None:
            out.append(model_layout)
        else:
            out.append(next(own))
            _check_agrees(out[-1], grid, num_prefix_tokens, "the impulse init recorded")
        out[-1] = layer_windows(model, name, ad, out[-1]) or out[-1]  # windows cut from the grid (SAM's ViT)
    return out


def attention_layouts(model: nn.Module, layers: Sequence[int] | int | None = None, grid=None,
                      num_prefix_tokens=None) -> list[TokenLayout]:
    """The token layout each attention layer of ``model`` sees, for the chosen ``layers``
    (indices into the attention layers; default all): what
    :func:`~structinit.analysis.attention_figure` needs where layers differ, as in ConViT,
    whose class token joins after its gated positional layers.

    Examples:
        >>> import structinit
        >>> model = structinit.create_model("vit_cpu_patch4_32")
        >>> attention_layouts(model, layers=[0])
        [TokenLayout(grid=(8, 8), num_prefix_tokens=0)]
    """
    survey = as_survey(model)
    return layer_layouts(survey, select_layers(_attention_layers(survey), layers), grid, num_prefix_tokens)


def add_scores(sums: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, open_pairs: torch.Tensor | None,
               targets: list[torch.Tensor], num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sums`` (heads, 2: mass, hits) and ``counts`` (heads,) plus one layer's maps ``probs``
    (B, H, T, T): for each head h, the mass on its target and whether the row's argmax is the
    target, over the grid rows whose target (``targets[h]``, grid indices, −1 outside) is
    inside the grid and open in the call (``open_pairs``); the first T − ``num_patches`` tokens
    are prefix tokens."""
    sums, counts = sums.clone(), counts.clone()
    prefix = probs.shape[-1] - num_patches
    arg = probs.argmax(-1)
    for h, t in enumerate(targets):
        rows, cols = target_pairs(t.to(probs.device), prefix)
        on_target = probs[:, h, rows, cols]
        hits = (arg[:, h, rows] == cols).double()
        weight = (torch.ones_like(on_target, dtype=torch.float64) if open_pairs is None else
                  open_pairs[:, min(h, open_pairs.shape[1] - 1), rows, cols].double().expand_as(hits))
        sums[h, 0] += float((on_target.double() * weight).sum())  # float(): the maps may live on a GPU
        sums[h, 1] += float((hits * weight).sum())
        counts[h] += float(weight.sum())
    return sums, counts


@torch.no_grad()
def impulse_fidelity(
    model: nn.Module,
    images: torch.Tensor | None = None,
    *,
    offsets: Sequence | None = None,
    layers: Sequence[int] | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int | None = None,
    pos_embed: torch.Tensor | None = None,
    batch_size: int = 64,
) -> dict[str, torch.Tensor]:
    """How well each head implements its impulse.

    Returns ``{'mass': (layers × heads), 'hit': (layers × heads)}``: the mean attention
    probability on each head's target token, and the fraction of rows whose argmax (over all
    tokens, prefix tokens included) is the target — over grid rows whose target lies inside
    the grid and is not masked in the call, and over all images. Layers with fewer heads than
    the widest have NaN in the extra columns.

    With ``images`` the model runs forward and each layer is scored on the attention
    probabilities it computes itself (:func:`structinit.adapters.observe.real_maps`), in grid
    order even when the model shuffles its tokens (MAE's encoder;
    :mod:`structinit.adapters.token_order`). With ``images=None`` every chosen layer is fed the
    position-only pseudo input LayerNorm(PE) (the grid rows of the model's position embedding,
    or ``pos_embed``), as in the papers, inside one forward of a probe image, and scored on the
    maps its own softmax makes of it. A model that cannot be probed (it takes tokens, not
    images) is scored on the adapters' recomputation of that input, with a warning.

    A layer with a relative position bias (Swin's window attention, BEiT) is scored on its own
    window: its grid is the window, its queries are every window of every image, and a pair the
    call masks (Swin's shifted windows join regions that are not neighbours) is not a target;
    its position-only input is content-free zero tokens (so a shifted window's mask counts).
    A layer that attends within windows cut from the grid of an absolute position embedding
    (SAM's ViT) is scored on the grid: a row counts where its target shares its window, and an
    argmax on the window's padding is a miss.

    Offsets and the token layout are read from each layer (recorded by
    :func:`structinit.impulse_init_`) unless ``offsets`` gives one list of (dy, dx) per head
    (shared) or one such list per layer; ``grid`` / ``num_prefix_tokens`` are needed only without
    a record and must agree with one. Every layer's token count is checked against prefix +
    grid: a mismatch is an error that names both numbers, never a silently wrong score.
    """
    model = as_survey(model)  # read once: the layers, layouts and probe of every step below
    chosen = select_layers(_attention_layers(model), layers)
    layouts = layer_layouts(model, chosen, grid, num_prefix_tokens)
    offs = _layer_offsets(chosen, offsets)
    heads = max(ad.num_heads for _, ad in chosen)
    sums = torch.zeros(len(chosen), heads, 2, dtype=torch.float64)
    counts = torch.zeros(len(chosen), heads, dtype=torch.float64)
    targets = [[target_index(lay.grid, o) for o in layer] for lay, layer in zip(layouts, offs)]

    def reduce(i: int, probs: torch.Tensor, open_pairs: torch.Tensor | None) -> None:
        # Windows are put on the grid one image at a time: an image's (heads, N, N) maps are what it holds at once
        step = probs.shape[0] if layouts[i].windows is None else layouts[i].windows.shape[0]
        for start in range(0, probs.shape[0], step):
            whole = open_pairs is None or open_pairs.shape[0] != probs.shape[0]  # None, or one for every slice
            part = open_pairs if whole else open_pairs[start:start + step]
            grid_probs, grid_open = maps_on_grid(probs[start:start + step], part, layouts[i])
            sums[i], counts[i] = add_scores(sums[i], counts[i], grid_probs, grid_open, targets[i],
                                            layouts[i].num_patches)

    if images is None:
        for i, (real, _) in enumerate(position_only_layers(model, chosen, layouts, pos_embed)):
            layouts[i].check_tokens(real.probs.shape[-1], f"attention layer {chosen[i][0]!r}")
            reduce(i, real.probs, real.open_pairs)
    else:
        for i, _, real in grid_order_maps(model, images, chosen, layouts, batch_size):
            reduce(i, real.probs, real.open_pairs)
    mass, hit = (torch.where(counts > 0, sums[..., j] / counts, float("nan")).float() for j in (0, 1))
    return {"mass": mass, "hit": hit}


def position_only_layers(model: nn.Module | ModelSurvey, chosen, layouts, pos_embed=None) -> list[tuple]:
    """(real map, token order) per chosen layer (name, adapter) on its position-only input, in
    the model's own forward (:func:`~structinit.adapters.position_input.position_only_maps`),
    with the maps put back in grid order where the model reorders its tokens. A model that
    cannot be probed (it takes tokens, or its input size cannot be told) gets the adapters'
    recomputation of the same input, with a warning that says so."""
    found = position_only_maps(model, chosen, layouts, pos_embed)
    if found is None:
        name = type(as_survey(model).model).__name__
        warnings.warn(f"cannot run {name}'s own forward on a probe image (its input size cannot be "
                      "told from the model), so its position-only maps are the adapters' recomputation of each "
                      "layer, not maps the model computed; pass images to read the model's own", stacklevel=3)
        out = []
        for (name, ad), lay in zip(chosen, layouts):
            x, terms = layer_position_input(model, name, ad, lay, pos_embed)
            with torch.no_grad():
                out.append((RealMap(ad.attention_probs(x.float(), terms), reachable(terms)), None))
        return out
    maps, _, order = found  # a layer attending within windows is put on its grid by its own windows instead
    return [(real, None) if lay.windows is not None else (_in_grid_order(real, order), order)
            for real, lay in zip(maps, layouts)]


def grid_order_maps(model: nn.Module | ModelSurvey, images: torch.Tensor, chosen, layouts, batch_size: int):
    """Yield (layer index, images in the batch, real map) per chosen layer and batch of
    ``images``: the maps of the model's own forward (:func:`~structinit.adapters.observe.real_maps`),
    each layer's token count checked against its layout, put back in grid order where the model
    reorders its tokens (the same seed, the same order)."""
    survey = as_survey(model)
    reorders = reorders_tokens(survey, chosen, layouts)
    for start in range(0, images.shape[0], batch_size):
        batch = images[start : start + batch_size]
        order = out_of_order(survey, chosen[0], layouts[0].grid, batch) if reorders else None
        for i, real in enumerate(real_maps(survey.model, batch, chosen)):
            layouts[i].check_tokens(real.probs.shape[-1], f"attention layer {chosen[i][0]!r}")
            yield i, len(batch), real if layouts[i].windows is not None else _in_grid_order(real, order)


def _in_grid_order(real: RealMap, order: torch.Tensor | None) -> RealMap:
    """A layer's maps (B, H, T, T) and the pairs its call leaves open put back in grid order when
    the model reordered its tokens (``order`` (B, T), for maps of that many samples and tokens);
    unchanged otherwise."""
    probs, open_pairs = real.probs, real.open_pairs
    if order is None or probs.shape[0] != order.shape[0] or probs.shape[-1] != order.shape[1]:
        return real
    if open_pairs is not None:
        open_pairs = canonical(open_pairs.expand(probs.shape).float(), order) > 0.5
    return dataclasses.replace(real, probs=canonical(probs, order), open_pairs=open_pairs)


def reorders_tokens(model: nn.Module | ModelSurvey, chosen, layouts) -> bool:
    """Whether the model puts its tokens out of grid order before the first chosen layer, read on
    the probe with two seeds (a random order shows in one of them at least)."""
    survey = as_survey(model)
    inputs = None if survey.probe is None else first_sample(survey.probe)
    return inputs is not None and any(
        out_of_order(survey, chosen[0], layouts[0].grid, inputs, seed) is not None for seed in (0, 1))


@dataclass(frozen=True)
class FidelitySummary:
    """The four numbers a fidelity table reports: layer 1 and the mean over layers."""

    mass_first: float
    hit_first: float
    mass_mean: float
    hit_mean: float


def fidelity_summary(fid: dict[str, torch.Tensor]) -> FidelitySummary:
    """Reduce :func:`impulse_fidelity`'s (layers × heads) tables to a :class:`FidelitySummary`
    (heads averaged; NaN entries of narrower layers ignored)."""
    mass, hit = fid["mass"], fid["hit"]
    return FidelitySummary(mass[0].nanmean().item(), hit[0].nanmean().item(),
                           mass.nanmean().item(), hit.nanmean().item())


@dataclass
class FidelityRow:
    """One init's row: its time and :class:`~structinit.analysis.FidelitySummary`'s four numbers."""

    label: str
    seconds: float
    mass_first: float
    hit_first: float
    mass_mean: float
    hit_mean: float


def fidelity_rows(model_name: str, inits: Sequence[tuple[str, str, dict]], images: torch.Tensor | None = None,
                  seed: int = 0) -> list[FidelityRow]:
    """One row per init ``(label, scheme, options)`` of a fresh ``model_name``: the init's
    wall time and its impulse fidelity (layer 1 and mean over layers; position-only input
    unless ``images``). Schemes that place no impulse are scored against enumerated offsets,
    the chance level to beat; schemes not registered are skipped."""
    rows = []
    for label, scheme, opts in inits:
        if scheme not in schemes():
            continue
        model = create_model(model_name)
        start = time.perf_counter()
        init_(model, scheme, seed=seed, **opts)
        seconds = time.perf_counter() - start
        offsets = None if scheme == "impulse" else enumerated_offsets(model.blocks[0].attn.num_heads)
        summary = fidelity_summary(impulse_fidelity(model, images, offsets=offsets))
        rows.append(FidelityRow(label, seconds, **dataclasses.asdict(summary)))
    return rows


def format_fidelity_table(rows: list[FidelityRow], title: str) -> str:
    """The rows as a markdown table under a ``###`` title."""
    lines = [f"### {title}", "", "| init | time (s) | mass L1 | hit L1 | mass mean | hit mean |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.label} | {r.seconds:.3f} | {r.mass_first:.3f} | {r.hit_first:.3f} | {r.mass_mean:.3f} | "
              f"{r.hit_mean:.3f} |" for r in rows]
    return "\n".join(lines)
