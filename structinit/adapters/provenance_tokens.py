"""Where each token of an attention map comes from in the module's input, found by provenance:
the module may take (B, T, D) tokens, sequence first (T, B, D), (B, D, H, W) or (B, H, W, D)
maps, and may cut windows itself. A labelled cotangent on one map slice's q (token t weighted
t + 1) and its gradient on the input say which input position each token reads, whatever
reshapes, permutes and rolls the module does; a :class:`~structinit.adapters.traced.TokenMap`
turns any call's input (or output) into the map's tokens.
A module that transforms its input before projecting it (vit-pytorch's LayerNorm inside) is read
where its projections take the tokens (:func:`inner_tokens`, :func:`leaf_at`, :func:`tokens_of_call`)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from structinit.adapters.probe import probing
from structinit.adapters.provenance_record import Operand, first_tensor, restored
from structinit.adapters.traced import TokenMap

if TYPE_CHECKING:
    from structinit.adapters.observe import AttentionMap, ModuleCall


class TokenError(ValueError):
    """Why the tokens of a map could not be traced to the input; ``depth``, how far the reading
    got (0: q does not come from these tokens, 1: no axis of them is the width, 2: a token of q
    is not one position of them), to tell the closest of several places tried."""

    def __init__(self, message: str, depth: int = 2):
        super().__init__(message)
        self.depth = depth


def _channel_axes(grad: torch.Tensor, dim: int) -> list[int]:
    """The axes of the input whose entries are all fed or all not, position by position: the
    width, or several where a spatial side equals it and a norm feeds every entry."""
    axes = []
    for axis in [grad.ndim - 1, *range(1, grad.ndim - 1)]:
        fed = (grad != 0).movedim(axis, -1)
        if grad.shape[axis] == dim and bool((fed.all(-1) | ~fed.any(-1)).all()) and bool(fed.any()):
            axes.append(axis)
    return axes


def token_map(q: Operand, leaf: torch.Tensor, dim: int, heads: int) -> TokenMap:
    """The :class:`TokenMap` of the map whose q is ``q``, computed from ``leaf``, the module's
    input in the traced call; :class:`TokenError` when a slice's tokens do not each read one
    input position of one image."""
    leads = q.lead_shape
    slices = math.prod(leads[:-1]) if len(leads) >= 2 else leads[0] // heads
    leads_of = [(*divmod_all(s, leads[:-1]), 0) if len(leads) >= 2 else (s * heads,) for s in range(slices)]
    axes = _channel_axes(_read_by(q, leaf, leads_of[0], torch.ones(q.moved_shape[-2])), dim)
    if not axes:
        raise TokenError("its map's tokens do not read whole positions of its input", depth=1)
    first = None
    for channel in axes:  # a side as long as the width is read as one only if its positions then add up
        # the images along the first axis, or the second of a sequence-first (T, B, D) input
        for batch in [0, 1] if leaf.ndim == 3 and channel % 3 == 2 else [0]:
            try:
                positions = [_slice_positions(q, leaf, lead, channel, batch) for lead in leads_of]
            except TokenError as err:
                first = first or err
                continue
            return TokenMap(channel, _windows(positions, _rows(leaf, batch, channel).shape[1]), batch)
    raise first


def _rows(t: torch.Tensor, batch: int, channel: int) -> torch.Tensor:
    """``t`` as (images, positions, width), its images along ``batch`` and width along ``channel``."""
    return t.movedim((batch, channel % t.ndim), (0, -1)).flatten(1, -2)


def _slice_positions(q: Operand, leaf: torch.Tensor, lead, channel: int, batch: int = 0) -> tuple[int, torch.Tensor]:
    """(image, the input position each token of slice ``lead`` reads), reading ``channel`` as
    the width and ``batch`` as the images; :class:`TokenError` when they are not one position
    each of one image."""
    t = q.moved_shape[-2]
    ones, labels = (_rows(_read_by(q, leaf, lead, weights), batch, channel)  # (B, positions, D)
                    for weights in (torch.ones(t), torch.arange(1, t + 1)))
    pick = ones.abs().argmax(-1, keepdim=True)
    read = torch.nonzero(ones.abs().amax(-1) > 0)
    ratio = (labels.gather(-1, pick) / ones.gather(-1, pick)).squeeze(-1)[tuple(read.T)].double()
    order = ratio.round().long() - 1
    exact = bool((ratio - ratio.round()).abs().max() <= 1e-3) if len(read) else False
    if len(read) != t or not exact or not torch.equal(order.sort().values, torch.arange(t)):
        middle = (torch.arange(t) == t // 2).double()
        spread = _rows(_read_by(q, leaf, lead, middle), batch, channel).abs().amax(-1) > 0
        if int(spread.sum()) > 1:
            raise TokenError("its q reads several positions of its input per token (a convolution over the "
                             "tokens between its projection and the product): its q kᵀ is no product of "
                             "projections of one token each")
        raise TokenError("a slice of its map does not read one input position per token")
    images = read[:, 0].unique()
    if len(images) != 1:
        raise TokenError("a slice of its map reads tokens of several images (a packed sequence)")
    row = torch.empty(t, dtype=torch.long)
    row[order] = read[:, 1]
    return int(images[0]), row


def _read_by(q: Operand, leaf: torch.Tensor, lead, weights: torch.Tensor) -> torch.Tensor:
    """The gradient on ``leaf`` of slice ``lead`` of q weighted by ``weights`` over its tokens,
    and over its channels at random (a norm's output sums to a constant, which no gradient of
    equal weights would pass)."""
    channels = 1 + torch.rand(q.channels, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    moved = torch.zeros(q.moved_shape, dtype=q.tensor.dtype, device=q.tensor.device)
    moved[lead] = weights.to(moved)[:, None] * channels.to(moved)
    got = torch.autograd.grad(q.tensor, leaf, q.unmove(moved), retain_graph=True, allow_unused=True)[0]
    if got is None:
        raise TokenError("its q is not computed from the tokens it is called with", depth=0)
    return got


def divmod_all(index: int, shape) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        index, r = divmod(index, n)
        out.append(r)
    return tuple(reversed(out))


def _windows(positions: list[tuple[int, torch.Tensor]], count: int) -> torch.Tensor | None:
    """Each image's windows (nW, T) from the slices' (image, positions); None when every slice is
    a whole image in order. TokenError when the slices are not image by image, alike per image."""
    images = [b for b, _ in positions]
    per = images.count(images[0])
    if images != [b for b in range(len(images) // per) for _ in range(per)]:
        raise TokenError("its map's slices do not run image by image")
    windows = torch.stack([row for _, row in positions[:per]])
    if any(not torch.equal(row, windows[i % per]) for i, (_, row) in enumerate(positions)):
        raise TokenError("its images are not cut into windows alike")
    if per == 1 and torch.equal(windows[0], torch.arange(count)):
        return None
    return windows


# -- a module that transforms its tokens inside (a pre-norm) -----------------------------------------

@contextlib.contextmanager
def leaf_at(module: nn.Module, readers: tuple[str, ...], args: tuple, kwargs: dict, leaf: torch.Tensor):
    """(args, kwargs, leaf) as given when ``readers`` is empty; else the leaf is a copy of the
    tokens the ``readers`` submodules receive, handed to each of them in every run inside."""
    if not readers:
        yield args, kwargs, leaf
        return
    box: dict = {}

    def swap(m, a, kw):
        x = first_tensor(a, kw)
        if "leaf" not in box:
            box["leaf"] = x.detach().clone().requires_grad_(x.is_floating_point())
        if x.shape != box["leaf"].shape:
            return None
        return tuple(box["leaf"] if t is x else t for t in a), kw

    handles = [module.get_submodule(n).register_forward_pre_hook(swap, with_kwargs=True) for n in readers]
    try:
        with probing(module), torch.no_grad():
            module(*args, **kwargs)  # the tokens, once: the same leaf in every run after
        yield args, kwargs, box["leaf"]
    finally:
        for h in handles:
            h.remove()


def inner_tokens(module: nn.Module, args: tuple, kwargs: dict, any_shape: bool = True) -> list[tuple[str, ...]]:
    """Where a module that transforms its input inside reads its tokens: for each tensor that a
    submodule makes or takes, in call order (the input's shape first, then its rank, then the
    rest), the names of the submodules that take it as their first argument: the q/k/v
    projections after a pre-norm, after a norm of a slice of the channels (SHViT's), on a slice of
    the channels (EfficientViT-MSRA's), after a strided depthwise convolution that pools the
    positions first (LowFormer's), or after the normed input is reshaped into windows (vit-pytorch's
    MaxViT); of the input's rank, those of its shape alone unless ``any_shape``."""
    x = first_tensor(args, kwargs)
    names = {m: n for n, m in module.named_modules() if m is not module}
    made, read = [], []
    hooks = [m.register_forward_hook(lambda m, a, out: made.append(out)) for m in names]
    hooks += [m.register_forward_pre_hook(lambda m, a, kw: read.append((m, first_tensor(a, kw)
              if any(isinstance(t, torch.Tensor) for t in (*a, *kw.values())) else None)), with_kwargs=True)
              for m in names]
    try:
        with restored(module, []), probing(module), torch.no_grad():
            module(*args, **kwargs)
    except Exception:  # the trace's own error says more
        return []
    finally:
        for h in hooks:
            h.remove()
    taken = [a for _, a in read if a is not None and not any(a is t for t in made)]  # a slice cut in the forward
    tensors, out = [t for t in [*made, *taken] if isinstance(t, torch.Tensor) and t is not x and t.is_floating_point()
                    and (t.ndim != x.ndim or any_shape or t.shape == x.shape)], []
    for t in sorted(tensors, key=lambda t: (t.shape != x.shape, t.ndim != x.ndim)):
        readers = tuple(dict.fromkeys(names[m] for m, a in read if a is t))
        if readers and readers not in out:
            out.append(readers)
    return out


def tokens_of_call(adapter, args: tuple, kwargs: dict) -> torch.Tensor:
    """The tokens a call of the module of ``adapter`` (a
    :class:`~structinit.adapters.traced.TracedAdapter`) hands its maps: read from the call's own
    arguments, or, for a module read after an inner norm, from its submodule's in one more run
    of the module (restored after)."""
    if adapter.input_module is adapter.module:
        return adapter.input_tokens(args, kwargs)
    seen = {}

    def grab(m, a, kw) -> None:
        seen.setdefault("x", adapter.input_tokens(a, kw).detach())

    handle = adapter.input_module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with restored(adapter.module, []), probing(adapter.module), torch.no_grad():
            adapter.module(*args, **kwargs)
    finally:
        handle.remove()
    return seen["x"]


# -- the tokens of a recorded call's maps (structinit.adapters.observe.ModuleCall) ------------------

def call_rows(call: ModuleCall, tokens: int, rows: int) -> torch.Tensor | None:
    """The tokens of a recorded call's maps as (``rows``, ``tokens``, D) (:func:`map_rows`): those
    its input module received, else those its own q projection received (a layer that cuts, pads
    or shifts its own windows hands its projection the tokens its maps are made of)."""
    x = map_rows(call.x, tokens, rows)
    return x if x is not None else map_rows(call.q_input, tokens, rows)


def map_rows(x: torch.Tensor | None, tokens: int, rows: int) -> torch.Tensor | None:
    """The tokens ``x`` (…, D) a layer received, as the rows (``rows``, ``tokens``, D) of its
    maps (rows, heads, T, T): ``x`` itself when it is (B, T, D); windows the layer received
    already cut, (…, windows, T, D) or (…, windows, h, w, D), read row-major, as the layer's own
    reshape reads them; None when no split of its leading axes gives that (a layer that cuts its
    own windows out of an image map: its tokens are not its maps' rows)."""
    if x is None or x.ndim < 3:
        return None
    if x.ndim == 3:
        return x if x.shape[-2] == tokens else None
    lead = x.shape[:-1]
    for k in range(1, len(lead)):
        if math.prod(lead[:k]) == rows and math.prod(lead[k:]) == tokens:
            return x.reshape(rows, tokens, x.shape[-1])
    return None


def map_tokens(x: torch.Tensor | None, maps: list[AttentionMap], heads: int) -> torch.Tensor | None:
    """``x`` as the (rows, T, D) tokens of one of a layer's square ``maps``: itself when it is 3-D
    (T tokens of its own count, or its maps are not square), windows received already cut read as
    :func:`map_rows` reads them; None when no split gives them (a layer that cuts its own windows)."""
    if x is None:
        return None
    square = [m for m in maps if m.queries == m.keys and m.probs.numel() % (heads * m.keys ** 2) == 0]
    if x.ndim == 3:
        return x
    return next((r for m in square if (r := map_rows(x, m.keys, m.probs.numel() // (heads * m.keys ** 2)))
                 is not None), None)


def fits_maps(x: torch.Tensor | None, maps: list[AttentionMap]) -> bool:
    """Whether ``x`` (rows, T, D) holds the T tokens of one of ``maps``, a square one."""
    return x is not None and any(m.queries == m.keys == x.shape[-2] for m in maps)


def module_output(call: ModuleCall) -> torch.Tensor | None:
    """The tensor a recorded call returned (the first one of a tuple, as Hugging Face's
    attention and ``nn.MultiheadAttention`` return (output, weights)), or None."""
    out = call.output
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None


def token_count(call: ModuleCall) -> int | None:
    """The tokens a layer's maps span in the probe: its (B, T, D) input's T, else (image maps,
    windows) the keys of its first square map."""
    x = call.x
    if not call.done or x is None:
        return None
    if x.ndim == 3:
        return int(x.shape[-2])
    return next((m.keys for m in call.maps if m.probs.ndim >= 3 and m.queries == m.keys), None)


def pooling_words(m: AttentionMap) -> str:
    """Why a map of fewer queries than keys, or the reverse, is no self-attention over its tokens, in words."""
    more = m.keys - m.queries  # a few keys more than its tokens: memory keys, a sink, a bias key
    return (f"self-attention of {m.queries} tokens over {m.keys} keys, {more} more than its tokens (learned memory "
            "keys, an attention sink, or nn.MultiheadAttention's add_bias_kv or add_zero_attn), whose maps an init "
            "shaped on the tokens alone does not set" if m.queries > 1 and 0 < more <= max(2, m.queries // 4) else
            f"cross-attention of {m.queries} quer{'y' if m.queries == 1 else 'ies'} over {m.keys} tokens (" +
            ("an attention-pooling or class-attention head, or queries pooled to fewer tokens)" if more > 0 else
             "learned queries, or keys pooled to fewer tokens)"))


def keys_from_elsewhere(call: ModuleCall) -> str:
    """Why a call is cross-attention from its queries to other tokens, or '': its k projection
    (a weight apart from q's) read other tokens than its q projection (a decoder's queries over
    an encoder's output, as many as its own tokens)."""
    q, k = call.q_input, call.k_input
    if q is None or k is None or (q.shape == k.shape and torch.equal(q, k)):
        return ""
    return ("cross-attention: its keys are projected from other tokens than its queries (an encoder's output, "
            "or another stream), so it has no self-attention over its tokens to shape")


def pooled_inside(call: ModuleCall) -> str:
    """Why a call's map is over tokens pooled inside the layer, or '': its maps square over k of
    the T tokens of its input, T a whole multiple of k, one map per head and sample ((B, heads,
    k, k), or (B, heads, 1, k, k)): q and k pooled to fewer tokens (MViT's stage change; a strided
    convolution before the projections of an image map, EfficientFormer-V2's), so that its map
    is over the pooled tokens, not its own. The input is (B, T, D) tokens or an image map of
    H·W tokens, (B, C, H, W) or (B, H, W, C)."""
    x = next((a for a in call.args if isinstance(a, torch.Tensor)), None)
    if x is None or x.ndim not in (3, 4):
        return ""
    t = x.shape[1] if x.ndim == 3 else _image_tokens(x)
    for m in call.maps:
        p = m.probs
        if (m.queries == m.keys and t % m.keys == 0 and t // m.keys >= 2 and p.ndim in (4, 5)
                and p.shape[0] == x.shape[0] and (p.ndim == 4 or p.shape[2] == 1)):
            return _pooled_words(m.keys, t)
    return ""


def _image_tokens(x: torch.Tensor) -> int:
    """H·W of a (B, C, H, W) image map, or of a (B, H, W, C) one when its last axis is the wider."""
    return x.shape[2] * x.shape[3] if x.shape[1] >= x.shape[3] else x.shape[1] * x.shape[2]


def maps_over_tokens(maps: list[AttentionMap], seen: set[int], head_dim: int, tokens: int, rows: int,
                     heads: int) -> list[AttentionMap]:
    """The ``maps`` over tokens rather than over a head's features (a softmax over channels, as
    cross-covariance and linear attention form): those whose keys are a count the layer was
    called with (``seen``) or other than its head width, and those whose keys are windows that
    tile its ``tokens`` tokens (as many maps per head as there are windows, in each of its
    ``rows`` rows), however wide their heads."""
    def tiles(m):
        windows = tokens // m.keys  # queries pooled in each, or not
        return tokens % m.keys == 0 and windows > 1 and m.probs.numel() == heads * m.queries * m.keys * rows * windows
    return [m for m in maps if m.keys in seen or m.keys != head_dim or tiles(m)]


def off_token_maps(maps: list[AttentionMap], seen: set[int], tokens: int, rows: int, heads: int) -> tuple[str, str]:
    """(kind, words) for a layer none of whose ``maps`` (over tokens, not channels) spans its
    ``tokens`` tokens, called with ``rows`` rows of them: 'pooling' for cross-attention (queries or
    keys pooled) and for q and k both pooled inside the layer to fewer tokens (one map per head
    and row: a stage change, its map not over its own tokens); 'windows' for maps over windows
    that fill its tokens, cut after its projections; '' when neither."""
    # keys that are its tokens, or windows of them (queries pooled window by window: Hiera's)
    cross = next((m for m in maps if m.queries != m.keys and (seen & {m.queries, m.keys} or tokens % m.keys == 0)),
                 None)
    if cross is not None:
        return "pooling", pooling_words(cross)
    for m in maps:
        if m.queries == m.keys < tokens and tokens % m.keys == 0:
            per_head = m.probs.numel() // (heads * m.keys**2)
            if per_head == rows * (tokens // m.keys):
                return "windows", (f"its maps are {m.keys}×{m.keys}, over windows of its {tokens} tokens cut after "
                                   "its projections")
            if per_head == rows:
                return "pooling", _pooled_words(m.keys, tokens)
    return "", ""


def _pooled_words(pooled: int, tokens: int) -> str:
    return (f"q and k pooled inside it to {pooled} of its {tokens} tokens (a stage change): its map is over the pooled "
            "tokens, not its own")


def same_logits(ours: torch.Tensor, maps: list[AttentionMap], dtype: torch.dtype) -> bool:
    """Whether one of ``maps`` has the logits ``ours`` (the adapter's recomputation) to the float
    rounding of their size, on every open pair: large logits saturate the softmax, where a
    rounding of the logits moves probabilities further than the probability tolerance allows."""
    rel = 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2
    open_pairs = torch.isfinite(ours) & (ours > torch.finfo(ours.dtype).min / 2)
    if not bool(open_pairs.any()):
        return False
    size = 1 + float(torch.where(open_pairs, ours.abs(), 0).max())  # where, not a mask: no copy of the open pairs
    for m in maps:
        if m.logits is not None and m.logits.numel() == ours.numel():
            got = m.logits.reshape(ours.shape).to(ours.dtype)
            if float(torch.where(open_pairs, (got - ours).abs(), 0).max()) <= rel * size:
                return True
    return False
