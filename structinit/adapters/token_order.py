"""Which grid position each token the first attention layer receives came from, read off the
forward: an encoder may reorder its tokens after the position embedding is added (MAE's random
masking shuffles them, even at mask ratio 0). The same reading names the grid position of each
token of the windows a later layer attends within (:func:`window_order`).

Whether the embedding reaches a later layer's tokens at all is read off one forward by dataflow
(:class:`PositionReach`), and what it finds unreached confirmed by moving the embedding
(:func:`unreached`).

One forward runs with the position embedding's leaf tensor recording gradients, stopped at the
layer, and each token is read back to the one grid row of the embedding that feeds it
(:func:`structinit.adapters.row_reading.read_rows`); a token no grid row feeds is off the grid
(a class or register token). The forward runs seeded, so a random order is the same as in any
other probe of that seed (:func:`structinit.adapters.observe.observe`).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from structinit.adapters.fused import compiling
from structinit.adapters.layout import TokenLayout, grid_positions, layout_position
from structinit.adapters.observe import _tensors_in
from structinit.adapters.probe import first_sample, is_token_probe
from structinit.adapters.row_reading import (
    image_maps,
    image_positions,
    read_rows,
    recording,
    silenced,
    with_pixel_patches,
)
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.trace import tokens_at


def token_order(model: nn.Module, adapter, pos_embed: torch.Tensor, num_patches: int, inputs,
                seed: int = 0, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
    """(B, T) long: for each token row the first attention layer (``adapter``) receives, the grid
    index its position came from, −1 for a token not on the grid; None when the forward cannot
    be read this way (it mixes tokens before the layer, or does not run). ``pos_embed`` is the
    model's own (…, R, D) tensor, its last ``num_patches`` rows the grid's; nothing of the
    model changes (one forward, module doc). With ``grid``, the h×w grid the rows are taken to
    run over row by row, a :class:`TokensOffGrid` error when the model's own image map shows its
    tokens elsewhere (:func:`check_on_image`)."""
    with recording(pos_embed) as leaf, (image_maps(model, num_patches) if grid else contextlib.nullcontext()) as maps:
        on = inputs if leaf is None or not grid else with_pixel_patches(inputs, num_patches, maps)
        x = None if leaf is None else tokens_at(model, adapter, on, seed, keep_graph=True)
        unread = x is None or x.ndim != 3 or not x.requires_grad  # (B·windows, h, w, C): no row order
        grad = None if unread else torch.autograd.grad(x, leaf, torch.ones_like(x), retain_graph=True,
                                                       allow_unused=True)[0]
        apart = not unread and (grad is None or not bool(grad.any()))  # no gradient from the PE, or 0 (a gate at 0)
        order = None if unread or apart else read_rows(x, leaf, pos_embed, num_patches)
        if order is not None and grid is not None:
            check_on_image(order[0], image_positions(x, maps), tuple(grid))
    # a rotary layer carries its position itself: a table of the rotation's is no embedding its tokens must take
    if apart and adapter.rotary is None and _unmoved(model, adapter, pos_embed, inputs, seed, x):
        raise PositionUnreached("the position embedding does not reach the tokens this layer receives (the model "
                                "adds it after the layer, on another path, or through a factor that is 0 at init, as a "
                                "gate): the layer's tokens carry no position")
    return order


def unreached(model: nn.Module, adapter, pos_embed: torch.Tensor, inputs, seed: int = 0) -> bool:
    """Whether the tokens the layer of ``adapter`` receives stay the same with every entry of
    ``pos_embed`` moved (two forwards stopped at the layer; the embedding restored bit for bit)."""
    x = tokens_at(model, adapter, inputs, seed)
    return x is not None and _unmoved(model, adapter, pos_embed, inputs, seed, x)


class PositionReach(TorchFunctionMode):
    """Which tensors of a forward run inside it are made from the tensors ``sources``: an op
    that takes one makes its outputs from it too (and the tensor it writes in place, a
    ``__setitem__``'s or an ``out=``), unless it is an elementwise product with a factor of zeros
    (a gate at 0 at init); and a tensor that shares a source's storage (a view, its ``.data``) is
    that source. It costs a lookup per tensor an op takes: no second forward and no
    gradients. A path outside torch (a NumPy round trip) is not seen, so a tensor it calls
    unreached is one to confirm (:func:`unreached`).

    Examples:
        >>> pe = torch.zeros(4, 2)
        >>> with PositionReach([pe]) as reach:
        ...     a, b = torch.ones(4, 2) + pe[None], torch.ones(4, 2) * 2
        >>> reach.reaches(a, pe), reach.reaches(b, pe)
        (True, False)
    """

    def __init__(self, sources):
        super().__init__()
        self._storages = {t.untyped_storage().data_ptr(): id(t) for t in sources}
        self._made: dict[int, tuple[weakref.ref, frozenset]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if compiling():  # flex_attention compiling its op: no tensor of the forward's own
            return out
        made = frozenset().union(*(self.sources_of(t) for t in _tensors_in((*args, *kwargs.values()))))
        if made and getattr(func, "__name__", "") in _PRODUCTS and any(not (
                isinstance(v, torch.Tensor) and self.sources_of(v)) and _zeros(v) for v in (*args, *kwargs.values())):
            made = frozenset()  # a factor of zeros (a gate at 0) carries none
        if made:
            written = [args[0]] if args and isinstance(args[0], torch.Tensor) and _in_place(func) else []
            for t in _tensors_in((out, kwargs.get("out"), *written)):
                self._made[id(t)] = (weakref.ref(t), made | self.sources_of(t))
        return out

    def sources_of(self, t: torch.Tensor) -> frozenset:
        """The ids of the sources ``t`` is made from."""
        entry = self._made.get(id(t))
        made = entry[1] if entry is not None and entry[0]() is t else frozenset()
        try:
            source = self._storages.get(t.untyped_storage().data_ptr())
        except Exception:  # a tensor with no storage of its own (a wrapper subclass): what ops made it says
            source = None
        return made if source is None else made | {source}

    def reaches(self, t: torch.Tensor, source: torch.Tensor) -> bool:
        """Whether ``t`` is made from ``source`` (one of the sources)."""
        return self._storages.get(source.untyped_storage().data_ptr()) in self.sources_of(t)


_PRODUCTS = frozenset({"mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__"})  # elementwise, by name


def _zeros(v) -> bool:
    """Whether ``v`` is a number 0 or a non-empty tensor of zeros."""
    if isinstance(v, torch.Tensor):
        return v.numel() > 0 and not bool(v.any())
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


def _in_place(func) -> bool:
    """Whether ``func`` writes its first argument: ``add_``, ``__setitem__``, ``__iadd__`` …"""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.startswith("__i") and name.endswith("__")) or (
        name.endswith("_") and not name.startswith("_"))


class PositionUnreached(ValueError):
    """The first attention layer's tokens do not depend on the position embedding at all."""


class TokensOffGrid(ValueError):
    """The grid the layout says the tokens run over is not where the model's image puts them."""


def check_on_image(rows: torch.Tensor, seen: tuple[tuple[int, int], torch.Tensor] | None,
                   grid: tuple[int, int]) -> None:
    """Raise :class:`TokensOffGrid` unless each token's grid row of the position embedding,
    ``rows`` (T,) (−1 off the grid), sits on ``grid`` where the model's own image map puts the
    token, up to a symmetry of the grid: ``seen`` is that map's (h, w) and each token's position
    on it, row-major (:func:`~structinit.adapters.row_reading.image_positions`; None when the
    model has no such map, and nothing is checked). Impulse writes each head's offset on
    ``grid``; a grid the image transposes or mirrors keeps every k×k convolution one (its offset
    transposed or negated), but any other placement turns it into no convolution of the image."""
    if seen is None:
        return
    (h, w), at = seen
    on = (rows >= 0) & (at >= 0)
    if not bool(on.any()):
        return  # the map feeds none of the grid's tokens: not the grid's map
    if bool(((rows >= 0) != (at >= 0)).any()):  # as many tokens each, but not the same ones
        patch, other = int(((at >= 0) & (rows < 0)).nonzero()[0]), int(((rows >= 0) & (at < 0)).nonzero()[0])
        raise TokensOffGrid(f"the position embedding's grid rows do not feed the tokens the image does: token {patch}, "
                            f"from patch {divmod(int(at[patch]), w)} of the model's {h}×{w} patch map, takes no grid "
                            f"row, and token {other}, which no patch feeds (a class or register token), takes grid row "
                            f"{int(rows[other])}; structinit reads an embedding's rows as its prefix tokens' first, "
                            "then the grid's, so put the prefix tokens first to initialise it with impulse")
    rows, at = rows[on], at[on]
    if _symmetry(rows, at, tuple(grid), (h, w)) is not None:
        return
    said = f"grid=({grid[0]}, {grid[1]})"
    for shape in ((h, w), (w, h)):
        how = _symmetry(rows, at, shape, (h, w))
        if how is not None:
            raise TokensOffGrid(f"{said} does not match the model: its tokens come from its own {h}×{w} patch map "
                                f"{how[0]}; pass grid=({shape[0]}, {shape[1]}), on which each k×k convolution impulse "
                                f"writes is one on the image, its offset (dy, dx) landing at {how[1]}")
    raise TokensOffGrid(f"{said} does not match the model: its tokens come from its own {h}×{w} patch map in an order "
                        "that no grid of rows and columns follows; put them in row-major order before the first "
                        "attention layer to initialise it with impulse")


def _symmetry(rows: torch.Tensor, at: torch.Tensor, shape: tuple[int, int],
              image: tuple[int, int]) -> tuple[str, str] | None:
    """How a grid of ``shape`` whose row-major indices are ``rows`` lies on the h×w ``image`` at
    positions ``at`` (row-major): (the order the tokens are read in, where an offset (dy, dx) on
    the grid lands on the image), for a transpose and mirrors of the image; None for no such one."""
    h, w = image
    gy, gx = rows.div(shape[1], rounding_mode="floor"), rows % shape[1]
    iy, ix = at.div(w, rounding_mode="floor"), at % w
    for transposed, flip_y, flip_x in itertools.product((False, True), repeat=3):
        y, x = (gx, gy) if transposed else (gy, gx)
        if shape == ((w, h) if transposed else (h, w)) and bool(((h - 1 - y if flip_y else y) == iy).all()) and bool(
                ((w - 1 - x if flip_x else x) == ix).all()):
            how = ["column by column" if transposed else "row by row"]
            how += ["from the bottom up"] * flip_y + ["from right to left"] * flip_x
            dy, dx = ("dx", "dy") if transposed else ("dy", "dx")
            return ", ".join(how), f"({'−' * flip_y}{dy}, {'−' * flip_x}{dx})"
    return None


@torch.no_grad()
def _unmoved(model: nn.Module, adapter, pos_embed: torch.Tensor, inputs, seed: int, x: torch.Tensor) -> bool:
    """Whether the tokens ``x`` the layer received stay the same with every entry of ``pos_embed``
    moved (restored bit for bit after): no gradient reached them, and no path without one does either
    (a copy made under ``no_grad``, a ``.data`` read)."""
    saved = pos_embed.detach().clone()
    try:
        pos_embed.add_(1.0 + saved.abs())
        moved = tokens_at(model, adapter, inputs, seed)
    finally:
        pos_embed.copy_(saved)
    return moved is not None and moved.shape == x.shape and torch.equal(moved, x.detach())


def out_of_order(survey: ModelSurvey, first: tuple, grid: tuple[int, int], inputs,
                 seed: int = 0) -> torch.Tensor | None:
    """:func:`token_order` for the surveyed model's first chosen layer ``first`` (name, adapter)
    on ``inputs``, with its h×w ``grid`` checked against the model's own image, when it shows
    the tokens out of [prefix, grid] order; None when they are in order, or cannot be read (no
    position embedding, or a layer with a relative position bias, whose grid is its window)."""
    name, adapter = first
    pe = survey.position.pos_embed
    if pe is None or survey.position.pos_reader is not None or survey.relative_bias(name, adapter) is not None:
        return None  # a read table gives its tokens in the order it feeds them
    order = token_order(survey.model, adapter, pe, grid[0] * grid[1], inputs, seed, grid)
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


def layer_windows(survey: ModelSurvey, name: str, adapter, layout: TokenLayout) -> TokenLayout | None:
    """``layout`` with the windows layer ``name`` attends within (:func:`window_order`), for a
    layer whose maps span another count of tokens than prefix + grid (smaller windows, or one
    padded past the grid) and whose position comes with the tokens (no relative bias, no
    rotation); None when it is not such a layer or they cannot be read on the survey's probe.
    The windows are read on the position embedding ``layout`` takes (a later stage's own)."""
    verdict = survey.attention.verdict(name)
    tokens = None if verdict is None else verdict.tokens
    probe = survey.probe
    if (tokens is None or tokens == layout.num_tokens or probe is None or is_token_probe(probe)
            or adapter.rotary is not None or survey.relative_bias(name, adapter) is not None):
        return None
    cut = getattr(getattr(adapter, "token_map", None), "windows", None)
    if cut is not None and not torch.equal(cut.flatten().cpu(), torch.arange(cut.numel())):
        return None  # it cuts its windows itself, from the grid it receives: its input is not the windows
    # (windows that are whole leading axes of its input, as NesT's (B, blocks, n, D), are its input)
    others = [v.adapter.module for v in survey.attention.verdicts if v.adapter.module is not adapter.module]
    order = window_order(survey, adapter, others, layout, tokens, first_sample(probe))
    if order is None or not cut_from_grid(order, layout.grid) or (order.shape[0] == 1 and layout.num_prefix_tokens):
        return None  # (the whole grid in one slice, beside prefix tokens: the grid, with tokens the layout lacks)
    return TokenLayout(layout.grid, layout.num_prefix_tokens, windows=order, position=layout.position)


def cut_from_grid(windows: torch.Tensor, grid: tuple[int, int]) -> bool:
    """Whether ``windows`` (slices, T) are windows cut from the h×w ``grid``: each slice's grid
    positions fill one rectangle of it (in any order: Hiera unrolls its mask units), the rest
    padding; and they are windows indeed, more than one or one padded past the grid (a single
    slice of every grid token and no padding, or with tokens that are not padding, is the grid
    itself, with tokens the layout does not know)."""
    placed = windows[windows >= 0]
    padded = bool((windows == -1).any()) and not bool((windows == OFF_GRID).any())
    if not (windows.shape[0] > 1 or padded) or placed.unique().numel() != len(placed):
        return False  # the grid itself, with tokens the layout does not know; or a position in two windows
    for order in windows:
        index = order[order >= 0]
        if len(index) == 0:
            continue
        gy, gx = index.div(grid[1], rounding_mode="floor"), index % grid[1]
        height, width = int(gy.max() - gy.min()) + 1, int(gx.max() - gx.min()) + 1
        if height * width != len(index):
            return False
    return True


OFF_GRID = -2  # in a window order: a token no grid position feeds that is not padding (a class token)


def window_order(survey: ModelSurvey, adapter, others: list[nn.Module], layout: TokenLayout, tokens: int,
                 inputs) -> torch.Tensor | None:
    """(slices, ``tokens``) long: the grid index of each token of each window the layer of
    ``adapter`` attends within, −1 for a window's padding (zero tokens no grid position feeds),
    :data:`OFF_GRID` for another token no grid position feeds; None when it cannot be read so.
    Read as :func:`token_order` reads the first layer's order, on one probe image, from the rows
    of the position embedding ``layout`` takes, each placed on the grid where it sits
    (:func:`~structinit.adapters.layout.grid_positions`), with the output of every attention
    module in ``others`` (the model's other attention layers) zero for the forward: the layers
    before then mix no tokens, and each grid row of the position embedding reaches the one token
    it becomes (SAM's ViT pads its grid to whole windows and cuts them before each windowed layer;
    NesT adds its embedding to blocks of the grid)."""
    found = layout_position(survey, layout)
    pe, positions, num_patches = found.pos_embed, grid_positions(found, layout.num_patches), layout.num_patches
    if pe is None or positions is None:
        return None
    with recording(pe) as leaf, silenced(others):
        x = None if leaf is None else tokens_at(survey.model, adapter, inputs, keep_graph=True)
        if x is None or not x.requires_grad or x.numel() % (tokens * x.shape[-1]):
            return None
        flat = x.reshape(1, -1, x.shape[-1])
        order = read_rows(flat, leaf, pe, num_patches)
    if order is None:
        return None
    order = torch.where(order >= 0, positions[order.clamp(min=0)], order)
    order[(order < 0) & flat.detach().ne(0).any(-1).cpu()] = OFF_GRID  # a token, not padding: a class token
    return order.reshape(-1, tokens)


def windows_in_grid(probs: torch.Tensor, windows: torch.Tensor, num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window maps (B·slices, H, T, T) as maps over the grid, (B, H, 1 + N, 1 + N), and the
    pairs open in them, (B, 1, 1 + N, 1 + N): row and column 1 + g are grid position g (its
    window's row, its key in the same window); column 0 is the largest probability a row puts
    on its window's padding, a key off the grid as a class token is (so an argmax there is a
    miss); pairs across windows are closed. ``windows`` (slices, T) from :func:`window_order`,
    the slices of one image, repeated image by image."""
    slices = windows.shape[0]
    batch, heads = probs.shape[0] // slices, probs.shape[1]
    out = probs.new_zeros(batch, heads, 1 + num_patches, 1 + num_patches)
    open_pairs = torch.zeros(batch, 1, 1 + num_patches, 1 + num_patches, dtype=torch.bool, device=probs.device)
    for i in range(batch * slices):
        b, order = i // slices, windows[i % slices].to(probs.device)
        real = order >= 0
        at = order[real] + 1
        rows = probs[i][:, real]  # (H, real tokens, T)
        out[b][:, at[:, None], at[None, :]] = rows[:, :, real]
        open_pairs[b, 0, at[:, None], at[None, :]] = True
        if bool((~real).any()):
            out[b][:, at, 0] = rows[:, :, ~real].amax(-1)
            open_pairs[b, 0, at, 0] = True
    return out, open_pairs


def maps_on_grid(probs: torch.Tensor, open_pairs: torch.Tensor | None,
                 layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's maps and open pairs over its grid (:func:`windows_in_grid`) when ``layout``
    has windows, the pairs the call masked inside a window staying closed; as they are
    otherwise."""
    if layout.windows is None:
        return probs, open_pairs
    on_grid, open_grid = windows_in_grid(probs, layout.windows, layout.num_patches)
    if open_pairs is not None:
        inside, _ = windows_in_grid(open_pairs.expand_as(probs).to(probs.dtype), layout.windows, layout.num_patches)
        open_grid = open_grid & (inside > 0)
    return on_grid, open_grid
