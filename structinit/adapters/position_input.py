"""What an attention layer attends with position alone: the papers' pseudo input
LayerNorm(PE) for a layer that reads position from the tokens, content-free zero tokens for a
layer with a relative position bias. Impulse designs its maps for this input; fidelity scores
them on it; the check after an impulse write feeds it to the model's own layers."""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters.layout import TokenLayout, grid_pos_embed
from structinit.adapters.position import NOT_FOUND
from structinit.adapters.registry import layer_relative_bias
from structinit.functional.attention import layer_norm_tokens
from structinit.utils import check_finite


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
