"""How faithfully each head implements its impulse: the attention mass on its target and the
argmax hit rate, with the position-only pseudo input or with real images."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from structinit.adapters import TokenLayout, find_attention_layers, grid_pos_embed, infer_layout, select_layers
from structinit.adapters.position import NOT_FOUND
from structinit.adapters.registry import layer_relative_bias
from structinit.adapters.relative import reachable
from structinit.analysis.capture import check_all_called, run_with_hooks
from structinit.functional.attention import layer_norm_tokens
from structinit.functional.targets import Offset, target_index
from structinit.schemes.records import get_record
from structinit.utils import check_finite


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


def recorded_layout(model: nn.Module, chosen, grid=None, num_prefix_tokens=None) -> TokenLayout:
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


def layer_layouts(model: nn.Module, chosen, grid=None, num_prefix_tokens=None) -> list[TokenLayout]:
    """The token layout of each chosen layer: its window for a layer with a relative position
    bias (Swin, BEiT; :attr:`~structinit.AttentionAdapter.relative`), else the model's layout
    (:func:`recorded_layout`)."""
    biases = [layer_relative_bias(model, name, ad) for name, ad in chosen]
    plain = [layer for layer, b in zip(chosen, biases) if b is None]
    model_layout = recorded_layout(model, plain, grid, num_prefix_tokens) if plain else None
    out = []
    for rb in biases:
        if rb is None:
            out.append(model_layout)
            continue
        window = TokenLayout(rb.grid, rb.num_prefix_tokens)
        _check_agrees(window, grid, num_prefix_tokens, "the relative position bias fixes")
        out.append(window)
    return out


def position_only_input(model: nn.Module, layout: TokenLayout, pos_embed: torch.Tensor | None = None) -> torch.Tensor:
    """The papers' pseudo input X̃ = LayerNorm(PE), (1, N, D) float32, from the grid rows of the
    model's position embedding (or ``pos_embed``); a clear error if there is none."""
    pe = pos_embed if pos_embed is not None else grid_pos_embed(model, layout)
    if pe is None:
        raise ValueError(f"{NOT_FOUND}; pass pos_embed=<(N, D) tensor> or images")
    check_finite("pos_embed", pe)
    rows = pe.detach().reshape(-1, pe.shape[-1])
    if rows.shape[0] != layout.num_patches:
        raise ValueError(f"pos_embed has {rows.shape[0]} rows, but the layout has {layout.num_patches} grid "
                         f"tokens ({layout.grid[0]}×{layout.grid[1]}); pass the (N, D) grid rows")
    return layer_norm_tokens(rows[None]).float()


def layer_position_input(model: nn.Module, name: str, adapter, layout: TokenLayout,
                         pos_embed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a layer attends with position alone, as (tokens, call terms): for a relative-bias
    layer, content-free zero tokens (1, P + N, D), so that its map is softmax of the bias (a
    bias the layer receives with its call comes back as the terms); otherwise
    :func:`position_only_input` (1, N, D) and no terms."""
    rb = layer_relative_bias(model, name, adapter)
    if rb is None:
        return position_only_input(model, layout, pos_embed), None
    terms = rb.bias().detach().float()[None] if rb.received else None
    return torch.zeros(1, layout.num_tokens, adapter.dim), terms


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

    With ``images`` the model runs forward and each layer sees its real input. With
    ``images=None`` every layer is fed the position-only pseudo input LayerNorm(PE) (the
    grid rows of the model's position embedding, or ``pos_embed``), as in the papers; a layer
    with a relative position bias gets content-free zero tokens instead.

    A layer with a relative position bias (Swin's window attention, BEiT) is scored on its own
    window: its grid is the window, its queries are every window of every image, and a pair the
    call masks (Swin's shifted windows join regions that are not neighbours) is not a target.

    Offsets and the token layout are read from each layer (recorded by
    :func:`structinit.impulse_init_`) unless ``offsets`` gives one list of (dy, dx) per head
    (shared) or one such list per layer; ``grid`` / ``num_prefix_tokens`` are needed only without
    a record and must agree with one. Every layer's token count is checked against prefix +
    grid: a mismatch is an error that names both numbers, never a silently wrong score.
    """
    chosen = select_layers(find_attention_layers(model), layers)
    layouts = layer_layouts(model, chosen, grid, num_prefix_tokens)
    offs = _layer_offsets(chosen, offsets)
    heads = max(ad.num_heads for _, ad in chosen)
    mass = torch.full((len(chosen), heads), float("nan"))
    hit = torch.full((len(chosen), heads), float("nan"))
    sums = torch.zeros(len(chosen), heads, 2, dtype=torch.float64)
    counts = torch.zeros(len(chosen), heads, dtype=torch.float64)
    targets = [[target_index(lay.grid, o) for o in layer] for lay, layer in zip(layouts, offs)]

    def reduce(i: int, x: torch.Tensor, terms: torch.Tensor | None, real: bool) -> None:
        if real:  # real tokens: prefix + grid, in the layer's layout
            layouts[i].check_tokens(x.shape[-2], f"attention layer {chosen[i][0]!r}")
        prefix = x.shape[-2] - layouts[i].num_patches  # the position-only input of a plain layer has none
        probs = chosen[i][1].attention_probs(x.float(), terms)  # (B, H, T, T)
        arg = probs.argmax(-1)
        open_pairs = reachable(terms)  # (B, 1 or H, T, T) or None
        for h, t in enumerate(targets[i]):
            rows = torch.nonzero(t >= 0).squeeze(1) + prefix
            cols = t[rows - prefix] + prefix
            on_target = probs[:, h, rows, cols]
            hits = (arg[:, h, rows] == cols).double()
            weight = (torch.ones_like(on_target, dtype=torch.float64) if open_pairs is None else
                      open_pairs[:, min(h, open_pairs.shape[1] - 1), rows, cols].double().expand_as(hits))
            sums[i, h, 0] += (on_target.double() * weight).sum()
            sums[i, h, 1] += (hits * weight).sum()
            counts[i, h] += weight.sum()

    if images is None:
        for i, ((name, ad), lay) in enumerate(zip(chosen, layouts)):
            reduce(i, *layer_position_input(model, name, ad, lay, pos_embed), real=False)
    else:
        was_training = model.training
        model.eval()
        try:
            for start in range(0, images.shape[0], batch_size):
                run_with_hooks(model, images[start : start + batch_size], chosen,
                               lambda i, x, terms: reduce(i, x, terms, real=True), with_terms=True)
        finally:
            model.train(was_training)
        check_all_called(chosen, (counts.sum(1) > 0).tolist())
    valid = counts > 0
    mass[valid] = (sums[..., 0][valid] / counts[valid]).float()
    hit[valid] = (sums[..., 1][valid] / counts[valid]).float()
    return {"mass": mass, "hit": hit}


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
    import time

    from structinit.functional.targets import enumerated_offsets
    from structinit.models import create_model
    from structinit.schemes.registry import init_, schemes

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
    for r in rows:
        lines.append(f"| {r.label} | {r.seconds:.3f} | {r.mass_first:.3f} | {r.hit_first:.3f} | "
                     f"{r.mass_mean:.3f} | {r.hit_mean:.3f} |")
    return "\n".join(lines)
