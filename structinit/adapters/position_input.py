"""What an attention layer attends with position alone (:func:`layer_position_input`). Impulse
designs its maps for this input; the check after an impulse write, fidelity without images and
the position-only figures feed it to the model's own layers inside one real forward
(:func:`position_only_maps`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from structinit.adapters.layout import TokenLayout, grid_pos_embed
from structinit.adapters.observe import ModuleCall, RealMap, observe, real_maps
from structinit.adapters.position import NOT_FOUND
from structinit.adapters.probe import ModelCall, first_sample, is_token_probe, probe_at
from structinit.adapters.survey import ModelSurvey, as_survey
from structinit.adapters.token_order import PositionReach, out_of_order
from structinit.functional.attention import layer_norm_tokens
from structinit.utils import check_finite


def position_only_input(model: nn.Module | ModelSurvey, layout: TokenLayout,
                        pos_embed: torch.Tensor | None = None) -> torch.Tensor:
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


def layer_position_input(model: nn.Module | ModelSurvey, name: str, adapter, layout: TokenLayout,
                         pos_embed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a layer attends with position alone, as (tokens, call terms): for a relative-bias
    layer, content-free zero tokens (1, P + N, D), so that its map is softmax of the bias (a
    bias the layer receives with its call comes back as the terms); for a rotary layer, tokens
    of ones, the same for every position (impulse's q and k read the biases, or one pre-norm
    channel that is 1 for every token); otherwise :func:`position_only_input` (1, N, D) and no
    terms."""
    rb = as_survey(model).relative_bias(name, adapter)
    if rb is None and adapter.rotary is None:
        return position_only_input(model, layout, pos_embed), None
    terms = rb.bias().detach().float()[None] if rb is not None and rb.received else None
    fill = torch.ones if rb is None else torch.zeros
    return fill(1, layout.num_tokens, adapter.dim), terms


def design_token_swap(model: nn.Module | ModelSurvey, name: str, adapter, layout: TokenLayout,
                      order: torch.Tensor | None,
                      pos_embed: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn(x) -> x'`` that puts a layer's position-only input (:func:`layer_position_input`)
    in place of the tokens it receives: the grid rows replaced by LayerNorm(PE), each token
    getting its own position's row where the model reorders them (``order``, (B, T)), prefix
    tokens kept; everything zero for a layer with a relative position bias, one for a rotary layer."""
    survey = as_survey(model)
    x_design, _ = layer_position_input(survey, name, adapter, layout, pos_embed)
    relative = survey.relative_bias(name, adapter) is not None
    rotary = not relative and adapter.rotary is not None

    def swap(x: torch.Tensor) -> torch.Tensor:
        if rotary:
            return torch.ones_like(x)
        if layout.windows is not None:  # windows cut from the grid: each token its own position's row, padding zero
            return _in_windows(x, layout.windows, x_design[0])
        # (B, H, W, D) image maps, channels last (SAM's ViT): their tokens row-major, as the layer reads
        # them, when they are the grid's (a map padded to a larger window is not: its tokens stay zero)
        flat = x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim > 3 else x
        if relative or flat.shape[-2] < layout.num_patches or (x.ndim > 3 and flat.shape[-2] != layout.num_patches):
            return torch.zeros_like(x)
        out = flat.clone()
        design = x_design.to(x.dtype)[0]
        if order is not None and order.shape == flat.shape[:2]:
            on_grid = order >= 0
            out[on_grid] = design[order[on_grid]]
        else:
            out[:, flat.shape[-2] - layout.num_patches:] = design
        return out.reshape(x.shape)
    return swap


def _in_windows(x: torch.Tensor, windows: torch.Tensor, design: torch.Tensor) -> torch.Tensor:
    """Tokens of ``x``'s shape, channels last, whose token i of window s is ``design``'s row
    ``windows[s, i]`` (zero for −1, a padding token); zeros where ``x`` is not those windows."""
    index = windows.reshape(-1).to(x.device)
    if x.shape[-1] != design.shape[-1] or x.numel() != index.numel() * x.shape[-1]:
        return torch.zeros_like(x)
    out = x.new_zeros(index.numel(), x.shape[-1])
    on_grid = index >= 0
    out[on_grid] = design.to(x.dtype)[index[on_grid]]
    return out.reshape(x.shape)


def position_only_maps(model: nn.Module | ModelSurvey, chosen: list, layouts: list[TokenLayout],
                       pos_embed: torch.Tensor | None = None, reach: PositionReach | None = None,
                       ) -> tuple[list[RealMap], dict[nn.Module, ModuleCall], torch.Tensor | None] | None:
    """What each chosen layer (name, adapter) computes on its position-only input, in the
    model's own forward: one probe image (:func:`design_probe`) runs through the model with every
    chosen layer's tokens swapped for :func:`design_token_swap`'s, and each layer's own softmax
    maps are read (:func:`~structinit.adapters.observe.real_maps`); ``reach``, when given, is
    entered around that forward (each call's ``source`` then tells whether the embedding reaches
    it). Returns (maps, calls, token order, None when the model keeps grid order), or None when
    neither probe runs through the model."""
    survey = as_survey(model)
    model = survey.model
    inputs = design_probe(survey, chosen, layouts)
    order = None if inputs is None else out_of_order(survey, chosen[0], layouts[0].grid, inputs)
    inputs = design_probe(survey, chosen, layouts, tokens=True) if inputs is None else inputs
    swaps = {ad.module: design_token_swap(survey, name, ad, lay, order, pos_embed)
             for (name, ad), lay in zip(chosen, layouts)}
    try:
        with reach or contextlib.nullcontext():
            calls, _ = observe(model, inputs, [(ad.module, ad.input_module, ad) for _, ad in chosen], substitute=swaps)
        return real_maps(model, inputs, chosen, calls), calls, order
    except Exception:  # the token probe is a guess: a model it does not fit cannot be probed
        if isinstance(inputs, ModelCall) or inputs.ndim == 4:
            raise
        return None


def design_probe(survey: ModelSurvey, chosen: list, layouts: list[TokenLayout], tokens: bool = False):
    """The input :func:`position_only_maps` runs the model on: the survey's probe image, or an
    image on the grid the layouts were designed for where a rotation is built at each call and
    the survey's own probe did not make that grid (a caller's input fixes the grid). For a model
    whose input size cannot be told: None, or with ``tokens`` the guess it is probed with, zero
    tokens (1, P + N, D) as the first layer sees them, as a model that takes tokens is called."""
    surveyed = survey.attention.verdict(chosen[0][0])
    probed = None if surveyed is None or surveyed.adapter.rotary is None else tuple(surveyed.adapter.rotary.grid)
    regrid = chosen[0][1].rotary is not None and survey.example is None and probed != tuple(layouts[0].grid)
    inputs = probe_at(survey.model, layouts[0].grid, count=1) if regrid else None
    if inputs is None and survey.probe is not None and not is_token_probe(survey.probe):
        inputs = first_sample(survey.probe)
    if inputs is None and tokens:
        inputs = torch.zeros(1, layouts[0].num_tokens, chosen[0][1].dim)
    return inputs
