"""Which grid position each token the first attention layer receives came from, read off the
forward: an encoder may reorder its tokens after the position embedding is added (MAE's random
masking shuffles them, even at mask ratio 0).

One forward runs with the position embedding's leaf tensor recording gradients, stopped at the
first attention layer. Per probe sample, two cotangents go back from the tokens the layer
receives: u on every token, and (t + 1)·u on token t (u a fixed random direction). A grid row r
of the embedding that feeds exactly one token t gets the gradient g on the first and (t + 1)·g
on the second, so their ratio names t; a row that feeds none gets nothing, and a row whose
ratio is not one whole number feeds several tokens (they mix before the layer, and no order
can be read). A token no grid row feeds is off the grid (a class or register token). The
forward runs seeded, so a random order is the same as in any other probe of that seed
(:func:`structinit.adapters.observe.observe`).
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters.survey import ModelSurvey
from structinit.adapters.trace import tokens_at


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` views (a parameter, a buffer or a plain tensor attribute), or ``t``."""
    return t if t._base is None else t._base


def token_order(model: nn.Module, adapter, pos_embed: torch.Tensor, num_patches: int, inputs,
                seed: int = 0) -> torch.Tensor | None:
    """(B, T) long: for each token row the first attention layer (``adapter``) receives, the grid
    index its position came from, −1 for a token not on the grid; None when the forward cannot
    be read this way (it mixes tokens before the layer, or does not run). ``pos_embed`` is the
    model's own (…, R, D) tensor, its last ``num_patches`` rows the grid's; nothing of the
    model changes (one forward, module doc)."""
    leaf = _leaf(pos_embed)
    if not leaf.is_floating_point() or leaf.grad_fn is not None:
        return None
    was = leaf.requires_grad
    try:
        leaf.requires_grad_(True)
        with torch.enable_grad():
            x = tokens_at(model, adapter, inputs, seed, keep_graph=True)
            if x is None or x.ndim != 3 or not x.requires_grad:  # (B·windows, h, w, C): no row order
                return None
            return _read_order(x, leaf, pos_embed, num_patches)
    finally:
        leaf.requires_grad_(was)


def _read_order(x: torch.Tensor, leaf: torch.Tensor, pos_embed: torch.Tensor, num_patches: int) -> torch.Tensor | None:
    batch, tokens, width = x.shape
    u = torch.randn(width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.arange(1, tokens + 1, dtype=torch.float64)
    order = torch.full((batch, tokens), -1, dtype=torch.long)
    for b in range(batch):
        grads = []
        for weight in (torch.ones(tokens, dtype=torch.float64), labels):
            cot = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
            cot[b] = (weight[:, None] * u).to(x.device)
            (g,) = torch.autograd.grad(x, leaf, cot.to(x.dtype), retain_graph=True, allow_unused=True)
            if g is None:
                return None
            view = g.as_strided(pos_embed.shape, pos_embed.stride(), pos_embed.storage_offset() - leaf.storage_offset())
            rows = view.reshape(-1, view.shape[-1]).double().cpu()
            grads.append(rows[rows.shape[0] - num_patches:])
        ones, labelled = grads
        norm = ones.norm(dim=-1)
        if bool((norm <= 1e-6 * float(norm.max())).any()):
            return None  # a grid row that reaches no token: not one token per grid position
        token = (labelled * ones).sum(-1) / norm**2  # the ratio, read where the gradient is
        nearest = token.round()
        residual = (labelled - nearest[:, None] * ones).norm(dim=-1) / norm
        if bool((residual > 1e-3).any()) or bool(((nearest < 1) | (nearest > tokens)).any()):
            return None  # rows that feed several tokens: they mix before the layer
        index = nearest.long() - 1
        if index.unique().numel() != num_patches:
            return None
        order[b, index] = torch.arange(num_patches)
    return order


def out_of_order(survey: ModelSurvey, first: tuple, num_patches: int, inputs, seed: int = 0) -> torch.Tensor | None:
    """:func:`token_order` for the surveyed model's first chosen layer ``first`` (name, adapter)
    on ``inputs``, when it shows the tokens out of [prefix, grid] order; None when they are in
    order, or cannot be read (no position embedding, or a layer with a relative position bias,
    whose grid is its window)."""
    name, adapter = first
    pe = survey.position.pos_embed
    if pe is None or survey.relative_bias(name, adapter) is not None:
        return None
    order = token_order(survey.model, adapter, pe, num_patches, inputs, seed)
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
