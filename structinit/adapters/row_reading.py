"""Which row of a position embedding each token holds, read by gradients: the primitive behind
the token order of a layer's input (:mod:`structinit.adapters.token_order`) and the placement of
the embedding's rows on the image (:func:`raster_rows`).

A forward runs with the embedding's leaf tensor recording gradients. Two cotangents go back from
T token rows: u on every token, and (t + 1)·u on token t (u a fixed random direction). A grid row
r of the embedding that feeds exactly one token t gets the gradient g on the first and (t + 1)·g
on the second, so their ratio names t; a row that feeds none gets nothing, and a row whose ratio
is not one whole number feeds several tokens (they mix on the way, and no order can be read).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from structinit.adapters.position import square_patch
from structinit.adapters.probe import ModelCall, probing, run_forward


def leaf_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` views (a parameter, a buffer or a plain tensor attribute), or ``t``."""
    return t if t._base is None else t._base


@contextlib.contextmanager
def recording(pos_embed: torch.Tensor):
    """The tensor ``pos_embed`` views, recording gradients inside (its flag restored after);
    None when it cannot (not floating point, or made by an op)."""
    leaf = leaf_of(pos_embed)
    if not leaf.is_floating_point() or leaf.grad_fn is not None:
        yield None
        return
    was = leaf.requires_grad
    try:
        leaf.requires_grad_(True)
        with torch.enable_grad():
            yield leaf
    finally:
        leaf.requires_grad_(was)


def read_rows(x: torch.Tensor, leaf: torch.Tensor, pos_embed: torch.Tensor, num_patches: int) -> torch.Tensor | None:
    """(B, T) long: for each of the T token rows of each sample of ``x`` (B, T, C), the grid row
    of ``pos_embed`` (…, R, D; its last ``num_patches`` rows the grid's) that feeds it, −1 for a
    token no grid row feeds; None when some grid row feeds no token or several (module doc).
    ``leaf`` is the tensor ``pos_embed`` views, recording gradients in the graph of ``x``."""
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
            # laid out as the leaf is (autograd may hand back a strided view), so that the view's strides read it
            g = torch.empty_strided(leaf.shape, leaf.stride(), dtype=g.dtype, device=g.device).copy_(g)
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


@contextlib.contextmanager
def image_maps(model: nn.Module, num_patches: int):
    """A list, filled while the context lasts, of a zero (1, C, h, w) leaf recording gradients
    for each channels-first (B, C, h, w) map with h·w = ``num_patches`` (both sides ≥ 2) that a
    module of ``model`` returns under grad mode; each is added to its map, which keeps its
    values and every path it had (a position embedding added before stays readable), so that a
    backward from the tokens says where on the map each one comes from (:func:`image_positions`)."""
    found: list[torch.Tensor] = []

    def add_leaf(module, args, out):
        if (isinstance(out, torch.Tensor) and out.ndim == 4 and out.is_floating_point() and torch.is_grad_enabled()
                and min(out.shape[2:]) >= 2 and out.shape[2] * out.shape[3] == num_patches):
            found.append(torch.zeros((1, *out.shape[1:]), dtype=out.dtype, device=out.device, requires_grad=True))
            return out + found[-1]
        return None

    handles = [m.register_forward_hook(add_leaf) for m in model.modules()]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def with_pixel_patches(inputs, num_patches: int, maps: list[torch.Tensor]):
    """``inputs`` with a zero (1, C, H/p, W/p) leaf, each entry spread over one p×p patch, added
    to their (B, C, H, W) image, the leaf put first in ``maps``: the image itself as a map of
    patches, which says where each token comes from when no module returns one (patches cut by
    a reshape, an unfold or a rearrangement before a Linear). ``inputs`` as they are when they
    hold no floating-point image that ``num_patches`` square patches tile. Call under grad mode."""
    call = inputs if isinstance(inputs, ModelCall) else ModelCall((inputs,))
    image, size = call.main, call.image_size
    p = None if size is None else square_patch(size, num_patches)
    if p is None or min(size) < 2 * p:
        return inputs
    leaf = torch.zeros((1, image.shape[1], size[0] // p, size[1] // p), dtype=image.dtype, device=image.device,
                       requires_grad=True)
    maps.insert(0, leaf)
    moved = image + leaf.repeat_interleave(p, 2).repeat_interleave(p, 3)
    swap = lambda v: moved if v is image else v
    swapped = ModelCall(tuple(map(swap, call.args)), {k: swap(v) for k, v in call.kwargs.items()})
    return swapped if isinstance(inputs, ModelCall) else moved


def image_positions(x: torch.Tensor, maps: list[torch.Tensor]) -> tuple[tuple[int, int], torch.Tensor] | None:
    """The (h, w) of the last map :func:`image_maps` recorded before the tokens ``x`` (B, T, C)
    (or of the image's patches, :func:`with_pixel_patches`, when it recorded none),
    and (T,) long: the position on it (row-major) that feeds each of sample 0's tokens, −1 for a
    token none feeds (a class token); None when there is no such map or its positions do not
    each feed one token (tokens that mix on the way: no position can be read)."""
    if not maps or x.ndim != 3 or not x.requires_grad:
        return None
    leaf = maps[-1]
    h, w = leaf.shape[2:]
    order = read_rows(x[:1], leaf, leaf.permute(0, 2, 3, 1), h * w)
    return None if order is None else ((int(h), int(w)), order[0])


@contextlib.contextmanager
def silenced(modules: list[nn.Module]):
    """Every module in ``modules`` returns zeros of its output's shape (the first tensor of a
    tuple) while the context lasts."""
    def zero(module, args, out):
        if isinstance(out, torch.Tensor):
            return torch.zeros_like(out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (torch.zeros_like(out[0]), *out[1:])
        return out
    handles = [m.register_forward_hook(zero) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _Found(Exception):
    """Raised by :func:`raster_rows`'s hook: the map is found, the rest of the forward is not needed."""


def raster_rows(model: nn.Module, inputs, leaf: torch.Tensor, pos_embed: torch.Tensor, num_patches: int,
                attention: list[nn.Module]) -> torch.Tensor | None:
    """(N,) long: the grid row of ``pos_embed`` at each position of the image's h×w token grid,
    row-major, N = ``num_patches``; None when it cannot be read so. ``leaf`` is the tensor
    ``pos_embed`` views, recording gradients (:func:`structinit.adapters.trace.recording`).

    Where a token sits on the image is what the model's own spatial maps say: the first
    channels-first (B, D, h, w) map with h·w = N that a module returns after the embedding is
    added (NesT puts its blocks back on the image so before each pooling). The forward runs on
    ``inputs`` with every module in ``attention`` silenced, so that no token mixes with another
    on the way, and each position of the map is read back to the one row that feeds it
    (:func:`read_rows`, on the first sample)."""
    width, seen = pos_embed.shape[-1], {}

    def spot(module, args, out):
        if (isinstance(out, torch.Tensor) and out.ndim == 4 and out.shape[1] == width and out.requires_grad
                and min(out.shape[2:]) >= 2 and out.shape[2] * out.shape[3] == num_patches
                and torch.autograd.grad(out, leaf, torch.ones_like(out), retain_graph=True,
                                        allow_unused=True)[0] is not None):  # after the embedding is added
            seen["map"] = out
            raise _Found

    handles = [m.register_forward_hook(spot) for m in model.modules()]
    try:
        with silenced(attention), probing(model), torch.enable_grad():
            run_forward(model, inputs)
    except _Found:
        pass
    except Exception:  # the forward fails with silenced layers: no map to read
        return None
    finally:
        for h in handles:
            h.remove()
    if "map" not in seen:
        return None
    flat = seen["map"][:1].flatten(2).transpose(1, 2)  # (1, h·w, D), row-major
    order = read_rows(flat, leaf, pos_embed, num_patches)
    return None if order is None else order[0]
