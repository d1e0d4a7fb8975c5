"""Which entries of a module's parameters feed which head, and how the entries
:mod:`structinit.adapters.provenance` finds become views of them. The heads are the lead axis
of q along which other entries feed it (:func:`find_head`), wherever it lies among the batch
and window axes. Each head's labelled entries are checked to form one evenly strided
(heads·r, D) block, or one block per head with the heads apart, or, for q and k that pass
through a norm after their projection (q/k-norm, often with rotary positions), each head's
entries read as whole lines of input weights in storage order.

A norm mixes a head's channels, so a labelled cotangent comes out mixed and only the *set* of
entries feeding a head is known. Storage order is the channel order of the product when q and
k lay their heads out alike, and it need be no more than that: a head's logits are q·k summed
over its channels, so one permutation of the channels applied to both leaves them unchanged.
The survey and the schemes' checks then judge the layer on its own maps like any other."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from structinit.adapters.fused import fused_call
from structinit.adapters.provenance_record import (
    _PRODUCTS,
    Operand,
    Record,
    TraceError,
    _made_before,
    _producers,
    applied_maps,
    square_map,
)
from structinit.functional.attention import closes_the_future

# -- a float64 copy to trace on -----------------------------------------------------------------------

def double_twin(module: nn.Module, originals: dict) -> nn.Module | None:
    """A float64 copy of ``module`` with the same parameter names, or None when it cannot be made."""
    try:
        twin = copy.deepcopy(module).double()
    except Exception:  # an attribute that refuses copying
        return None
    names = [n for n, p in twin.named_parameters() if p.is_floating_point()]
    return twin if names == list(originals) else None


def in_double(value):
    if isinstance(value, torch.Tensor):
        return value.detach().double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(in_double(v) for v in value)
    if isinstance(value, dict):
        return {k: in_double(v) for k, v in value.items()}
    return value


class PastAProjection(TraceError):
    """A parameter reaches the product through more than a projection (a norm's weight, read at the input)."""


def decode(name: str, g1: torch.Tensor, gl: torch.Tensor, channels: int) -> dict[int, torch.Tensor]:
    where = torch.nonzero(g1)
    if not len(where):
        return {}
    ratio = (gl[tuple(where.T)] / g1[tuple(where.T)]).double()
    label = ratio.round()
    if not bool(((ratio - label).abs() < 1e-3).all() and (label >= 1).all() and (label <= channels).all()):
        raise PastAProjection(f"parameter {name!r} feeds the attention through more than a projection (a norm, "
                              "a rotation or a position term between it and the product)")
    order = torch.argsort(label, stable=True)  # each channel's entries in the order nonzero gives them
    channels_of, counts = torch.unique_consecutive(label[order], return_counts=True)
    return {int(c) - 1: ix for c, ix in zip(channels_of.tolist(), where[order].split(counts.tolist()))}


def block(name: str, param: torch.Tensor, entries: list[dict[int, torch.Tensor]], heads: int, r: int,
           width: int, kind: str) -> torch.Tensor:
    """The strided view of ``param`` holding entries[h][c] for every head h and channel c: a
    (heads·r, width) block ('in': each row runs along one axis of ``width`` entries), its
    transpose ('out') or a (heads·r,) vector ('bias'); with the heads apart from each other (q,
    k and v packed per head), the same with the heads on an axis of their own: (heads, r, width),
    (width, heads, r) or (heads, r) (:func:`structinit.adapters.attention.in_matrix` reads them). TraceError
    when the entries do not form one."""
    first = entries[0].get(0)
    line = 1 if kind == "bias" else width
    if any(len(e) != r or any(len(ix) != line for ix in e.values()) for e in entries):
        raise TraceError(f"parameter {name!r} does not hold one entry row per head and channel")
    stride = torch.tensor(param.stride())
    axis_stride = 0
    if kind != "bias":
        moving = [a for a in range(param.ndim) if len(first[:, a].unique()) > 1]
        if len(moving) != 1 or not along(torch.stack([ix for e in entries for ix in e.values()]), moving[0], width):
            raise TraceError(f"parameter {name!r} does not hold each head channel along one axis")
        axis_stride = param.stride(moving[0])
    def start(h, c):
        ix = entries[h][c]
        return int((ix.min(0).values * stride).sum()) if kind != "bias" else int((ix[0] * stride).sum())
    base = start(0, 0)
    sc = start(0, 1) - base if r > 1 else 0
    sh = start(1, 0) - base if heads > 1 else r * sc
    if r == 1:
        sc = sh
    if any(start(h, c) != base + h * sh + c * sc for h in range(heads) for c in range(r)):
        raise TraceError(f"parameter {name!r} does not lay its heads out as evenly strided blocks")
    offset = param.storage_offset() + base
    if sh != r * sc:  # heads apart from each other (q, k, v packed per head): one axis more, per head
        shape, strides = {"bias": ((heads, r), (sh, sc)), "in": ((heads, r, width), (sh, sc, axis_stride)),
                          "out": ((width, heads, r), (axis_stride, sh, sc))}[kind]
        return param.as_strided(shape, strides, offset)
    if kind == "bias":
        return param.as_strided((heads * r,), (sc,), offset)
    if kind == "in":
        return param.as_strided((heads * r, width), (sc, axis_stride), offset)
    return param.as_strided((width, heads * r), (axis_stride, sc), offset)


def along(ix: torch.Tensor, axis: int, width: int) -> bool:
    """Whether each set of entries ``ix`` (sets, N, ndim) runs 0 … width − 1 along ``axis`` and
    stays put on the others."""
    others = torch.cat([ix[..., :axis], ix[..., axis + 1:]], -1)
    runs = bool((ix[..., axis].sort(-1).values == torch.arange(width, device=ix.device)).all())
    return runs and bool((others == others[:, :1]).all())


def assemble(role: str, per_head: list[list[dict]], params, originals, heads, r, width, kind):
    """(weight view, bias view or None) of one role from each head's labelled entries, the
    weight's parameter name, and the views of any further biases: a projection with a bias
    followed by a BatchNorm with its own (a 1×1 conv and its norm, EfficientFormer-V2's) shifts
    each channel by their sum. The views are of ``originals[name]``."""
    weight, biases = None, []
    for i, (name, _) in enumerate(params):
        param = originals[name]
        entries = [head[i] for head in per_head]
        if not any(entries):
            continue
        if not all(entries):
            raise TraceError(f"parameter {name!r} feeds only some heads of {role}")
        is_bias = all(len(ix) == 1 for e in entries for ix in e.values()) and width > 1
        view = block(name, param, entries, heads, r, width, "bias" if is_bias else kind)
        if is_bias:
            biases.append(view)
        elif weight is not None:
            raise TraceError(f"{role} is the sum of several projections (parameter {name!r} is one more)")
        else:
            weight, weight_name = view, name
    if weight is None:
        raise TraceError(f"no parameter of the module projects the tokens to {role}")
    # the last bias, nearest the product (a norm's, after the projection's own), is the one a write sets
    return (weight, biases[-1] if biases else None), weight_name, tuple(biases[:-1])


def lines_in_storage_order(support: torch.Tensor, stride: tuple[int, ...], width: int,
                           channels: int) -> dict[int, torch.Tensor] | None:
    """``support`` (N, ndim), the entries of one parameter that feed one head, as
    channel → its line of ``width`` entries, the lines in storage order; None when the entries
    are not ``channels`` whole lines along one axis (a norm's weight, a bias, a position term)."""
    if len(support) != channels * width:
        return None
    strides = torch.tensor(stride)
    for axis in range(support.shape[1]):
        others = torch.cat([support[:, :axis], support[:, axis + 1:]], 1)
        keys, group = torch.unique(others, dim=0, return_inverse=True)
        if len(keys) != channels:
            continue
        lines = [support[group == g] for g in range(channels)]
        if not all(sorted(line[:, axis].tolist()) == list(range(width)) for line in lines):
            continue
        lines.sort(key=lambda line: int((line.min(0).values * strides).sum()))
        return dict(enumerate(lines))
    return None


# -- heads: which lead axis, and which entries feed each -------------------------------------------

MAX_LEADS = 512  # (batch × windows × heads) slices a product may have before the trace gives up


def grads_of(target: torch.Tensor, cotangent: torch.Tensor, params) -> list[torch.Tensor]:
    got = torch.autograd.grad(target, [p for _, p in params], cotangent, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for (_, p), g in zip(params, got)]


def lead_cotangent(op: Operand, lead: tuple[int, ...], labels: bool, token: int | None = None) -> torch.Tensor:
    """Zero but on slice ``lead`` of ``op``: 1 (or c + 1 on channel c) on every token, or on
    ``token`` alone."""
    moved = torch.zeros(op.moved_shape, dtype=op.tensor.dtype, device=op.tensor.device)
    chan = torch.arange(1, op.channels + 1, dtype=moved.dtype, device=moved.device) if labels else 1.0
    moved[(*lead, slice(None) if token is None else token)] = chan
    return op.unmove(moved)


def isolating(op: Operand, cot: torch.Tensor) -> torch.Tensor:
    """``cot`` with, on each token of each slice, its parts along the slice's own values and along
    ones removed. Through a norm over several heads' channels (OLMo-2's q norm over the full width)
    the gradient a slice's cotangent g sends to the other heads' channels is −z (z·g)/(D rms³),
    which is zero for such a g: the entries it reaches are the slice's own, as without a norm."""
    if op.channels <= 2:
        return cot
    source, place = op._axes
    g = cot.movedim(source, place).double()
    y = op.tensor.detach().movedim(source, place).double()
    ones = torch.full_like(y, op.channels ** -0.5)
    y = y - (y * ones).sum(-1, keepdim=True) * ones
    y = y / y.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    for unit in (ones, y):
        g = g - (g * unit).sum(-1, keepdim=True) * unit
    return op.unmove(g.to(cot.dtype))


def support(op: Operand, lead: tuple[int, ...], params) -> Support:
    """The parameter entries feeding slice ``lead`` of ``op`` (every token and channel), through
    random cotangent weights: a norm's output sums to a constant, which an all-ones cotangent
    would not pass."""
    weights = 1 + torch.rand(op.tensor.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = grads_of(op.tensor, lead_cotangent(op, lead, False) * weights.to(op.tensor), params)
    return Support(g != 0 for g in grads)


class Support(tuple):
    """Per parameter, the mask of its entries that feed a slice; equal when every mask is (one
    comparison per parameter, not per entry: a wide convolution has millions)."""

    def __eq__(self, other) -> bool:
        return isinstance(other, Support) and len(self) == len(other) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(self, other))

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None


def heads_of(q: Operand, params) -> tuple[int, callable]:
    """The head count and (lead, lead sizes) → head (lead in the tensor's own axis order) of the
    q operand: with two or more lead axes, the one along which other entries feed q
    (:func:`find_head`); for one flat lead axis (B·heads, T, r) the heads are the leads until the
    entries feeding them repeat, and a context regrouped to (B, heads, …) is read row-major."""
    leads = q.lead_shape
    if not leads:
        raise TraceError("its map has no head axis")
    if len(leads) >= 2:
        at = find_head(q, params)
        return q.tensor.shape[q.lead_axes[at]], lambda lead, sizes: lead[at]
    first, n = support(q, (0,), params), leads[0]
    if n > MAX_LEADS:
        raise TraceError(f"its products run over {n} slices, more than the {MAX_LEADS} the trace follows")
    heads = next((h for h in range(1, n) if support(q, (h,), params) == first), n)
    if n % heads:
        raise TraceError(f"its {n} product slices do not repeat every {heads} heads")
    return heads, lambda lead, sizes: _row_major(lead, sizes) % heads


def _row_major(lead: tuple[int, ...], sizes) -> int:
    """The flat index of ``lead`` in lead axes of ``sizes``, as a view that folds them reads it."""
    flat = 0
    for i, n in zip(lead, sizes):
        flat = flat * n + i
    return flat


def find_head(op: Operand, params) -> int:
    """The place among ``op``'s lead axes (its own order) of its heads: the one axis along which
    other entries feed it; with none, one head (the last axis of size 1); else the last. Set as
    ``op.head`` when it is not the last."""
    op.head = None  # the lead axes in the tensor's own order while they are compared
    shape, last = op.lead_shape, len(op.lead_shape) - 1
    base = support(op, (0,) * len(shape), params)
    moving = [i for i, n in enumerate(shape)
              if n > 1 and support(op, tuple(int(j == i) for j in range(len(shape))), params) != base]
    if len(moving) == 1:
        at = moving[0]
    elif not moving:  # one head: the last axis of size 1 holds it
        at = max((i for i, n in enumerate(shape) if n == 1), default=last)
    else:
        at = last
    op.head = op.lead_axes[at] if at != last else None
    return at


def one_map_a_head(rec, heads: int) -> None:
    """TraceError where a one-head map is one of several the call applies to values: each head's
    map made by a softmax of its own (a loop over the heads, over per-head projections or slices
    of one, or heads of different widths), which one map of strided heads does not describe."""
    widths = applied_maps(rec) if heads == 1 else ()
    if len(widths) < 2:
        return
    each = (f"of {', '.join(map(str, widths[:-1]))} and {widths[-1]} channels" if len(set(widths)) > 1
            else f"of {widths[0]} channels each")
    raise TraceError(f"it makes each head's map by a softmax of its own ({len(widths)} maps a call, {each}, as a "
                     "loop over heads does), where structinit reads a layer whose heads' maps one product of q and kᵀ "
                     "makes, from one projection per role: write it so to initialise it")


_GATHERS = {torch.gather, torch.Tensor.gather, torch.index_select, torch.Tensor.index_select, torch.take_along_dim,
            torch.Tensor.take_along_dim}
_ARITHMETIC = {"add", "sub", "rsub", "mul", "div", "truediv", "radd", "rmul", "rtruediv", "iadd", "isub", "imul",
               "itruediv", "add_", "sub_", "mul_", "div_"}


def logits_by_projection(rec: Record) -> bool:
    """Whether a square map's logits come from a Linear or a convolution with no product of two
    tensors before them in the module (VOLO's outlook attention: a token's weights over its
    window project that token alone); heads mixed after q kᵀ (talking heads) are not that."""
    producers = _producers(rec.ops)
    for i, (func, args, _, out) in enumerate(rec.ops):
        if not square_map(func, out):
            continue
        t, before, projected = args[0], i, False
        while t is not None and (j := _made_before(producers, t, before)) is not None:
            if rec.ops[j][0] in _PRODUCTS:
                break
            projected = projected or rec.ops[j][0] in (F.linear, F.conv1d, F.conv2d)
            t, before = next((a for a in rec.ops[j][1] if isinstance(a, torch.Tensor)), None), j
        else:
            if projected:
                return True
    return False


def no_map_reason(rec: Record) -> str:
    """Why the call shows no softmax(q kᵀ) map applied to values (:func:`map_operands` found none)."""
    if logits_by_projection(rec):
        return ("its logits are a projection of each token alone (outlook attention), not a product of queries and "
                "keys: it forms no softmax(q kᵀ) map to shape")
    return _map_changed(rec) or ("the trace cannot follow its softmax map back to a product of q and k and on to "
                                 "the product that applies it to v")


def _map_changed(rec: Record) -> str | None:
    """Why a square softmax map is not what weights the values, when the call changes it first
    (copies, masks, reshapes and slices passed over): by arithmetic with another tensor, a product
    with a parameter (re-attention) or rows gathered (tokens sampled); None when it does not."""
    no_map = ", so what weights them is no softmax(q kᵀ) map of its projections, the map structinit shapes"
    for i, (func, _, _, out) in enumerate(rec.ops):
        if not square_map(func, out):
            continue
        live = {id(out)}
        for later, args, kwargs, result in rec.ops[i + 1:]:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if not any(id(a) in live for a in tensors) or not isinstance(result, torch.Tensor):
                continue
            name = getattr(later, "__name__", "").strip("_")
            if name in _ARITHMETIC and len(tensors) > 1:
                return (f"its softmax map goes through `{name}` with another tensor before it weights the values "
                        "(another map subtracted, as differential attention does, or a term added or multiplied in)"
                        + no_map)
            if later in _GATHERS and id(tensors[0]) in live:
                return ("its softmax map has its rows gathered by indices its forward computes (tokens sampled from "
                        "it, as adaptive token sampling does), a map the trace does not follow to its values")
            if later in _PRODUCTS:
                mixer = next((a for a in tensors if isinstance(a, nn.Parameter)), None)
                if mixer is not None:
                    return (f"its softmax map is mixed across its heads by a {tuple(mixer.shape)} parameter before "
                            "it weights the values (as re-attention does)" + no_map)
                break
            if result.shape[-2:] == out.shape[-2:] or result.numel() == out.numel():  # not a slice of it
                live.add(id(result))
    return None


def head_leads(op: Operand, heads: int) -> list[tuple[int, ...]]:
    zeros = (0,) * (len(op.lead_shape) - 1)
    return [(*zeros, h) for h in range(heads)]


# -- what the map masks whatever the content ------------------------------------------------------

def causal_map(rec: Record, q: Operand) -> bool:
    """Whether the map masks every key after its query and nothing else: logits −∞ exactly
    above the diagonal (a softmax's input, or a fused call's after its masks: ``is_causal``)."""
    return closes_the_future(_closed(_logits(rec, q)))


def _logits(rec: Record, q: Operand) -> torch.Tensor:
    """The logits of the map ``q`` makes: the softmax's input, or a fused call's, masks applied."""
    func, args, kwargs, _ = rec.ops[q.product_index]
    call = fused_call(func, args, kwargs)
    return args[0].detach()[..., q.keys_kept or slice(None)] if call is None else call.logits()


def _closed(logits: torch.Tensor) -> torch.Tensor:
    """The logits a mask closed: −∞, or the most negative float of the dtype (``masked_fill``
    with ``-torch.finfo(dtype).max``, as LSA does), which softmax turns into 0 alike."""
    return torch.isneginf(logits) | (logits <= torch.finfo(logits.dtype).min / 2)


def masked_pairs(rec: Record, q: Operand) -> torch.Tensor | None:
    """The (slices, T, T) pairs the module's map masks whatever the content (−∞ logits alike in
    every head: a block-diagonal mask over a packed sequence, a padding mask), as the traced call
    built them inside, or None when it masks none or only the keys after each query."""
    closed = _closed(_logits(rec, q))
    t = closed.shape[-1]
    if not bool(closed.any()):
        return None
    # (slices, heads, T, T): the heads are the axis before the pairs, a 3-D map's slices all alike
    closed = closed.reshape(-1, *closed.shape[-3:]) if closed.ndim > 3 else closed.reshape(1, -1, t, t)
    if not bool((closed == closed[:, :1]).all()):  # differs between heads: not a mask of positions
        return None
    closed = closed[:, 0]
    return None if closes_the_future(closed) else closed
