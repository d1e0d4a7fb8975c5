"""Which grid position each token the first attention layer receives came from, read off the
forward: an encoder may reorder its tokens after the position embedding is added (MAE's random
masking shuffles them, even at mask ratio 0).

Row r of the position embedding (grid index r, counted from 1) is perturbed in the forwards
whose bit b of r + 1 is set, one forward per bit (⌈log₂(N + 1)⌉ of them, each stopped at the
first attention layer). A token row that changes in exactly the forwards of bit pattern c came
from grid index c − 1; a row that never changes is not on the grid (a class or register
token). Every forward runs with the same seed, so a random order is the same in each, and the
same as in any other probe of that seed (:func:`structinit.adapters.observe.observe`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from structinit.adapters.position import find_position_embedding
from structinit.adapters.registry import layer_relative_bias
from structinit.adapters.trace import tokens_at


def _tokens(model: nn.Module, adapter, inputs, seed: int) -> torch.Tensor | None:
    x = tokens_at(model, adapter, inputs, seed)
    return None if x is None else x.float()


@torch.no_grad()
def token_order(model: nn.Module, adapter, pos_embed: torch.Tensor, num_patches: int, inputs,
                seed: int = 0) -> torch.Tensor | None:
    """(B, T) long: for each token row the first attention layer (``adapter``) receives, the grid
    index its position came from, −1 for a token not on the grid; None when the forward cannot
    be read this way (it mixes tokens before the layer, or does not run). ``pos_embed`` is the
    model's own (…, R, D) tensor, its last ``num_patches`` rows the grid's, restored bit for bit."""
    base = _tokens(model, adapter, inputs, seed)
    if base is None or base.ndim != 3:  # (B·windows, h, w, C): a layer that cuts its own windows has no row order
        return None
    rows = pos_embed.reshape(-1, pos_embed.shape[-1])
    offset = rows.shape[0] - num_patches
    code = torch.zeros(base.shape[:2], dtype=torch.long, device=base.device)
    saved = pos_embed.detach().clone()
    # a direction, not a constant: a LayerNorm before the layer would remove a constant shift
    delta = torch.randn(rows.shape[-1], generator=torch.Generator().manual_seed(0)) * (float(saved.float().abs().max())
                                                                                       + 1.0)
    tol = 1e-4 * (1.0 + float(base.abs().max()))
    for bit in range(math.ceil(math.log2(num_patches + 1))):
        chosen = [offset + r for r in range(num_patches) if (r + 1) >> bit & 1]
        try:
            flat = pos_embed.data.reshape(-1, pos_embed.shape[-1])
            flat[chosen] += delta.to(device=flat.device, dtype=flat.dtype)
            after = _tokens(model, adapter, inputs, seed)
        finally:
            pos_embed.data.copy_(saved)
        if after is None or after.shape != base.shape:
            return None
        changed = (after - base).abs().amax(-1) > tol
        code |= changed.long() << bit
    order = code - 1
    for sample in order:
        grid = sample[sample >= 0]
        if grid.numel() != num_patches or not torch.equal(grid.sort().values.cpu(), torch.arange(num_patches)):
            return None  # not one token per grid position: tokens mix before the layer
    return order


def out_of_order(model: nn.Module, first: tuple, num_patches: int, inputs, seed: int = 0) -> torch.Tensor | None:
    """:func:`token_order` for the model's first chosen layer ``first`` (name, adapter) on
    ``inputs``, when it shows the tokens out of [prefix, grid] order; None when they are in
    order, or cannot be read (no position embedding, or a layer with a relative position bias,
    whose grid is its window)."""
    name, adapter = first
    pe = find_position_embedding(model).pos_embed
    if pe is None or layer_relative_bias(model, name, adapter) is not None:
        return None
    order = token_order(model, adapter, pe, num_patches, inputs, seed)
    return None if order is None or is_identity(order) else order


def is_identity(order: torch.Tensor) -> bool:
    """Whether every sample's grid tokens sit in grid order after the same prefix tokens."""
    prefix = int((order[0] < 0).sum())
    expected = torch.cat([torch.full((prefix,), -1), torch.arange(order.shape[1] - prefix)])
    return bool((order.cpu() == expected).all())


def canonical(probs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Maps (B, H, T, T) put back in grid order, rows and columns: the tokens off the grid first
    (in their sequence order), then grid index 0 … N−1; ``order`` (B, T) from :func:`token_order`."""
    perms = []
    for o in order:
        on_grid = torch.nonzero(o >= 0).flatten()
        by_index = torch.empty_like(on_grid)
        by_index[o[on_grid]] = on_grid
        perms.append(torch.cat([torch.nonzero(o < 0).flatten(), by_index]))
    perm = torch.stack(perms)
    heads, t = probs.shape[1], probs.shape[-1]
    rows = torch.gather(probs, 2, perm[:, None, :, None].expand(-1, heads, -1, t))
    return torch.gather(rows, 3, perm[:, None, None, :].expand(-1, heads, t, -1))
