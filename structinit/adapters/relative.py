"""Relative position biases of attention layers (Swin's window attention, BEiT), and the
additive terms a layer receives with its call (Swin's shifted-window mask).

A relative-position attention adds to head h's logit for query i and key j a learned entry
``table[index[i, j], h]``. structinit finds one by structure: a Parameter
``relative_position_bias_table`` of shape (R, heads) and a long buffer
``relative_position_index`` of shape (T, T) (or a method that generates it), on the attention
module or inside it (timm's Swin and BEiT, Hugging Face's Swin and BEiT). The token layout is read from them: a
``window_size`` (h, w) on the same module, and T − h·w prefix tokens in front (BEiT's class
token, whose pairs use extra table rows).

The table row of an offset is read from the module's own index, not from a formula: every
(query, key) pair with key = query + (dy, dx) must share one row that no other pair uses,
otherwise writing it would bias pairs that are not the offset's. That holds for timm's and
Hugging Face's index and is checked, so a module with another convention gets a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from structinit.functional.targets import Offset, target_index

__all__ = ["MASKED_LOGIT", "RelativeBias", "call_logit_terms", "find_relative_bias", "holds_relative_bias",
           "reachable", "relative_bias_holder"]

TABLE, INDEX = "relative_position_bias_table", "relative_position_index"
GENERATE = "generate_relative_position_index"
# A call term at or below this counts as masking its pair (Swin adds −100; e^−30 ≈ 1e−13).
MASKED_LOGIT = -30.0


@dataclass(frozen=True)
class RelativeBias:
    """The relative position bias of one attention layer: ``table`` (R, heads) aliases the
    module's Parameter, ``index`` (T, T) its buffer; tokens are ``num_prefix_tokens`` prefix
    tokens then the row-major ``grid`` (the window). ``received``: the layer does not hold it
    but gets it with each call (Hugging Face's BEiT, timm's BEiT with a shared bias)."""

    owner: nn.Module
    table: torch.Tensor
    index: torch.Tensor
    grid: tuple[int, int]
    num_prefix_tokens: int
    received: bool = False  # computed outside the layer and handed to it with each call

    @property
    def num_heads(self) -> int:
        return int(self.table.shape[1])

    def bias(self) -> torch.Tensor:
        """(heads, T, T): the logit term the layer adds, ``table[index]`` per head."""
        t = self.index.shape[0]
        return self.table[self.index.reshape(-1)].reshape(t, t, -1).permute(2, 0, 1)

    def row_of(self, offset: Offset) -> int:
        """The table row holding the bias of every pair whose key is the query moved by
        ``offset``; a ValueError if the offset leaves the window or its pairs share no row of
        their own (the index does not encode offsets)."""
        return _offset_row(self.owner, self.index, self.grid, offset, self.num_prefix_tokens,
                           f"{type(self.owner).__name__}'s relative index does not give the offset {tuple(offset)} one "
                           "table row of its own (other offsets share it, as |dy|, |dx| do), so its bias cannot be "
                           "set without biasing other pairs; the table is shaped only where each offset has a row")


def _offset_row(owner: nn.Module, index: torch.Tensor, grid: tuple[int, int], offset: Offset, prefix: int,
                no_row: str) -> int:
    """The row of ``index`` ((prefix + h·w)², the window ``grid`` after ``prefix`` tokens) of every
    grid pair whose key is the query moved by ``offset``; a ValueError if the offset leaves the
    window, or with the message ``no_row`` if those pairs share no row of their own."""
    h, w = grid
    dy, dx = offset
    if not (abs(dy) < h and abs(dx) < w):
        raise ValueError(f"offset {tuple(offset)} lies outside the {h}×{w} window of {type(owner).__name__}, "
                         f"whose offsets are within ±{h - 1} rows and ±{w - 1} columns; choose a smaller "
                         "kernel_size")
    t = target_index(grid, offset)
    q = torch.nonzero(t >= 0).squeeze(1)
    rows = index[q + prefix, t[q] + prefix].cpu()
    row = int(rows[0])
    if not bool((rows == row).all()) or int((index == row).sum()) != len(q):
        raise ValueError(no_row)
    return row


def _window(module: nn.Module) -> tuple[int, int] | None:
    size = getattr(module, "window_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, (tuple, list, torch.Size)) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return int(size[0]), int(size[1])
    return None


def holds_relative_bias(module: nn.Module) -> bool:
    """Whether ``module`` itself holds a table Parameter and its index: a tensor, or a
    ``generate_relative_position_index(window_size)`` method (Hugging Face's BEiT)."""
    return isinstance(getattr(module, TABLE, None), nn.Parameter) and (
        isinstance(getattr(module, INDEX, None), torch.Tensor) or callable(getattr(module, GENERATE, None)))


def relative_bias_holder(module: nn.Module) -> nn.Module | None:
    """The module, itself or one inside it, that holds a relative bias, or None."""
    return next((m for m in module.modules() if holds_relative_bias(m)), None)


def _index(holder: nn.Module, grid: tuple[int, int]) -> torch.Tensor:
    """The (T, T) index: the buffer (Hugging Face's Swin keeps it flattened) or generated."""
    index = getattr(holder, INDEX, None)
    if not isinstance(index, torch.Tensor):
        index = getattr(holder, GENERATE)(tuple(grid))
    if index.ndim == 1:
        side = math.isqrt(index.numel())
        if side * side == index.numel():
            index = index.view(side, side)
    return index.to(holder.relative_position_bias_table.device)


def gathered_bias(module: nn.Module, heads: int) -> RelativeBias | None:
    """A learned bias the module gathers by an index, found by its structure whatever its names
    (TinyViT's and EfficientFormer's ``attention_biases[:, attention_bias_idxs]``): a
    floating-point Parameter of the module, (heads, R) or (R, heads), and a long buffer (T, T)
    whose entries lie in [0, R), T tokens on a square grid (or the module's ``window_size``);
    None when the module holds no such pair. Its bias is checked against the module's own maps
    like any other (:mod:`structinit.adapters.verify`)."""
    params = [p for p in module.parameters(recurse=False) if p.is_floating_point() and p.ndim == 2]
    for index in module.buffers(recurse=False):
        if index.dtype != torch.long or index.ndim != 2 or index.shape[0] != index.shape[1] or not index.numel():
            continue
        t, low, high = index.shape[0], int(index.min()), int(index.max())
        grid = _window(module) or ((math.isqrt(t),) * 2 if math.isqrt(t) ** 2 == t else None)
        if grid is None or grid[0] * grid[1] != t or low < 0:
            continue
        for p in params:
            table = p.T if p.shape[0] == heads and p.shape[1] > high else p if p.shape[1] == heads else None
            if table is not None and table.shape[0] > high:
                return RelativeBias(module, table, index, grid, 0)
    return None


def find_relative_bias(module: nn.Module, heads: int | None = None) -> RelativeBias | None:
    """The :class:`RelativeBias` of an attention module, or None if it has none: named as timm's
    and Hugging Face's (below), or, given its ``heads``, gathered by an index
    (:func:`gathered_bias`). A table and an index whose shapes do not make a layout with the
    module's ``window_size`` are an error.

    Examples:
        >>> attn = structinit.create_model("swin_cpu_patch2_32").layers[0].blocks[0].attn
        >>> rb = find_relative_bias(attn)
        >>> rb.grid, rb.num_prefix_tokens, tuple(rb.bias().shape)
        ((4, 4), 0, (2, 16, 16))
    """
    holder = relative_bias_holder(module)
    if holder is None:
        return None if heads is None else gathered_bias(module, heads)
    table = getattr(holder, TABLE)
    grid = _window(holder) or _window(module)
    name = type(module).__name__
    if grid is None:
        raise ValueError(f"{name} has a {TABLE} but no window_size (h, w) on {type(holder).__name__}; structinit "
                         "reads the window from it")
    index = _index(holder, grid)
    area = grid[0] * grid[1]
    t = index.shape[0] if index.ndim == 2 and index.shape[0] == index.shape[1] else -1
    rows = (2 * grid[0] - 1) * (2 * grid[1] - 1)
    if t not in (area, area + 1) or table.ndim != 2 or table.shape[0] < rows or index.dtype != torch.long \
            or int(index.max()) >= table.shape[0] or int(index.min()) < 0:
        raise ValueError(f"{name}: {TABLE} {tuple(table.shape)} and {INDEX} {tuple(index.shape)} do not fit the "
                         f"window {grid[0]}×{grid[1]} (expected an index of shape ({area}, {area}) or "
                         f"({area + 1}, {area + 1}) with a class token, and at least {rows} table rows)")
    return RelativeBias(holder, table, index, grid, t - area)


def _same_storage(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
        and a.data_ptr() == b.data_ptr()


def call_logit_terms(args: tuple, kwargs: dict, batch: int, heads: int, tokens: int,
                     x: torch.Tensor | None = None) -> torch.Tensor | None:
    """The additive logit terms among a layer call's arguments besides its tokens (the first
    argument; in a call with none, the keyword that holds ``x``, else the first tensor keyword),
    summed and broadcast to (batch, 1 or heads, T, T); None if there is none.

    A term is any floating tensor whose last two axes are (T, T): Swin's window mask
    (windows, T, T), tiled over the images of the batch as the layer does; a relative bias
    handed to the layer, (heads, T, T) (an argument whose name says ``bias``; otherwise a
    3-D term is read as per-window whenever the batch divides into its rows) or
    (1, heads, T, T); a (T, T) or (batch or 1, heads or 1, T, T) mask.
    """
    found = []
    # The tokens are the call's first argument; in a call with none, the keyword that holds ``x`` (the
    # tokens the projections read), else its first tensor keyword (Hugging Face passes hidden_states=…).
    # With as many tokens as channels they are (…, T, T) too, and no logit term.
    if args:
        # keys and values handed as the tokens themselves (nn.MultiheadAttention's (x, x, x)) are no term
        first = args[0]
        others = [(None, a) for a in args[1:] if not _same_storage(a, first)] + list(kwargs.items())
    else:
        passed = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        same = [k for k in passed if x is not None and kwargs[k].data_ptr() == x.data_ptr()]
        tokens_key = (same or passed or [None])[0]
        others = [(k, v) for k, v in kwargs.items() if k != tokens_key]
    for key, value in others:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim >= 2
                and tuple(value.shape[-2:]) == (tokens, tokens)):
            continue
        v = value.detach().float()
        named_bias = key is not None and "bias" in key and v.ndim == 3 and v.shape[0] == heads
        if v.ndim == 2:
            v = v[None, None]
        elif v.ndim == 3 and not named_bias and batch % v.shape[0] == 0:  # a mask per window: images·windows
            v = v.repeat(batch // v.shape[0], 1, 1)[:, None]
        elif v.ndim == 3 and v.shape[0] == heads:
            v = v[None]
        elif v.ndim != 4:
            continue
        found.append(v)
    return sum(found[1:], found[0]) if found else None


def reachable(terms: torch.Tensor | None) -> torch.Tensor | None:
    """Where the call terms leave a pair attendable (above :data:`MASKED_LOGIT`), or None."""
    return None if terms is None else terms > MASKED_LOGIT
