"""The record :mod:`structinit.adapters.provenance` reads: one call of a module with every torch
call it makes (function, arguments, result), the operands of the products around its attention
map, and a guard that leaves the module exactly as it was."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from structinit.adapters.attention import mixes_heads
from structinit.adapters.fused import FUSED, compiling, differentiable_flex, fused_call, fused_output
from structinit.adapters.observe import _SOFTMAX
from structinit.adapters.probe import call_copy, probing
from structinit.functional.attention import kept_keys
from structinit.utils.state import ModuleState

_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_BADDBMM = {torch.baddbmm, torch.Tensor.baddbmm}
_PRODUCTS = _MATMUL | _BADDBMM | {torch.einsum}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul_,
        torch.Tensor.__imul__}
_DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.div_, torch.Tensor.__itruediv__}
# What a map may pass through on its way to the values: a copy in another dtype, dropout, a mask.
_CARRY = {F.dropout, torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as, torch.Tensor.contiguous,
          torch.Tensor.clone, torch.Tensor.masked_fill, torch.masked_fill, torch.Tensor.type, torch.Tensor.half,
          torch.Tensor.bfloat16}
# Reshapes of the batch and head axes that leave each map's (T, S) whole: (B·H, T, S) ↔ (B, H, T, S)
_REGROUP = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
            torch.Tensor.unflatten}
_TOKEN_KEYS = ("hidden_states", "x", "query", "input", "inputs", "tokens")


class TraceError(ValueError):
    """Why a module's attention could not be followed back to its parameters; ``depth``, how far the
    reading got (3: past the tokens, 0: they do not make q; ``provenance_tokens.TokenError``, 0 to 2)."""

    def __init__(self, message: str, depth: int = 3):
        super().__init__(message)
        self.depth = depth


class HandedQueries(TraceError):
    """The module's queries are made outside it and handed to it (GCViT's global query): its map
    is cross-attention from them to its tokens, not self-attention over its tokens."""


Op = tuple  # (func, args, kwargs, out)


class _Recorder(TorchFunctionMode):
    """Keeps every torch call; ``swap`` maps a call's index to the result it returns instead."""

    def __init__(self, swap: dict[int, torch.Tensor] | None = None):
        super().__init__()
        self.ops: list[Op] = []
        self.swap = swap or {}
        self.snapshots: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, index = kwargs or {}, len(self.ops)
        if compiling():  # flex_attention compiling its op: recorded when it runs (adapters.fused)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        made = fused_output(func, out)  # a fused op's attention output: flex's comes with its log-sum-exp
        if not _holds_tensor(made):  # a size or a stride: dynamo's guards read those, more on a first call,
            return out  # so they are left out, and the indices of the ops recorded do not move
        if index in self.swap:
            out = self.swap[index] if made is out else (self.swap[index], *out[1:])
            made = self.swap[index]
        elif func in _PRODUCTS and isinstance(out, torch.Tensor):
            self.snapshots[index] = out.detach().clone()  # as made: an in-place scale or mask may follow
        self.ops.append((func, args, kwargs, made))
        return out


def _holds_tensor(out) -> bool:
    """Whether a call's result is a tensor or holds one (a split's tuple), not a size or a flag."""
    return isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and any(
        isinstance(t, torch.Tensor) for t in out))


@dataclass
class Record:
    """One call: its torch calls in order, its output, and each product's result as it was made."""

    ops: list[Op]
    out: object
    snapshots: dict[int, torch.Tensor]


def record(module: nn.Module, args: tuple, kwargs: dict, swap: dict[int, torch.Tensor] | None = None) -> Record:
    """The :class:`Record` of one call of ``module`` in eval mode, with gradients, under a forked
    random state seeded 0 (the module's mode is restored; :func:`restored` restores the rest)."""
    recorder = _Recorder(swap)
    args, kwargs = call_copy(args, False), call_copy(kwargs, False)  # a fresh cache each call: each run starts alike
    with probing(module), torch.enable_grad(), differentiable_flex(), recorder:
        out = module(*args, **kwargs)
    return Record(recorder.ops, out, recorder.snapshots)


@contextlib.contextmanager
def restored(module: nn.Module, params: list[torch.Tensor]):
    """Gradients on for ``params`` inside; after, every parameter, buffer and tensor attribute of
    ``module`` and its children back as it was, values and identities, and the flags."""
    flags = [p.requires_grad for p in params]
    state = ModuleState(module, parameter_values=True)
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        state.restore()
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    """The tokens of a call: its first tensor argument, else a tensor under a usual keyword."""
    given = [*args, *(kwargs.get(k) for k in _TOKEN_KEYS)]  # positional first, then the usual keywords
    found = next((a for a in given if isinstance(a, torch.Tensor)), None)
    if found is None:
        raise ValueError("the call passes no tensor")
    return found


@dataclass
class Operand:
    """One operand of a product, with its token and channel axes; its lead axes are the rest
    (batch, windows, heads), read with the heads last: ``head`` is their axis when it is not the
    last lead axis already (NesT's (B, heads, blocks, T, r)). For a value operand,
    ``product_index`` is the product's call and ``context_axes`` the (token, channel) axes of its
    result."""

    tensor: torch.Tensor
    token: int
    channel: int
    product_index: int = -1
    context_axes: tuple[int, int] = (-2, -1)
    head: int | None = None
    keys_kept: slice | None = None  # a q's map: its tokens' key columns, where sinks join them (:func:`sinks_cut`)

    def __post_init__(self):
        self.token %= self.tensor.ndim
        self.channel %= self.tensor.ndim

    @property
    def _axes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self.head is None:
            return (self.token, self.channel), (-2, -1)
        return (self.head, self.token, self.channel), (-3, -2, -1)

    @property
    def lead_axes(self) -> list[int]:
        """The lead axes of :attr:`tensor`, in its own order."""
        return [a for a in range(self.tensor.ndim) if a not in (self.token, self.channel)]

    @property
    def moved_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.movedim(*self._axes).shape)

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return self.moved_shape[:-2]

    @property
    def channels(self) -> int:
        return int(self.tensor.shape[self.channel])

    def unmove(self, moved: torch.Tensor) -> torch.Tensor:
        source, place = self._axes
        return moved.movedim(place, source)

    def context_lead_axes(self, ndim: int) -> list[int]:
        token, channel = (a % ndim for a in self.context_axes)
        return [a for a in range(ndim) if a not in (token, channel)]

    @property
    def context_channel_axis(self) -> int:
        return self.context_axes[1]


def _producers(ops: list[Op]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, (_, _, _, result) in enumerate(ops):
        for t in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(t, torch.Tensor):
                out.setdefault(id(t), []).append(i)
    return out


def _made_before(producers, t: torch.Tensor, before: int) -> int | None:
    """The last call before ``before`` that returned ``t`` (in-place calls return their input)."""
    return max((i for i in producers.get(id(t), ()) if i < before), default=None)


def _scalar(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    return None


def _back_to_product(ops, producers, t: torch.Tensor, before: int, depth: int = 12):
    """(index of the product call that made ``t``, the scalar factor applied since) following the
    elementwise calls between (scales, masks, added biases, casts); None if none is found."""
    i = _made_before(producers, t, before)
    if i is None or depth == 0:
        return None
    func, args, _, _ = ops[i]
    if func in _PRODUCTS:  # baddbmm's alpha is in the product's output already, as every factor it applies
        return i, 1.0
    if regroups(func, args, t):
        return _back_to_product(ops, producers, args[0], i, depth - 1)
    parts = args[0] if func in (torch.cat, torch.concat) and args and isinstance(args[0], (tuple, list)) else args
    tensors = [a for a in parts if isinstance(a, torch.Tensor) and a.ndim == t.ndim]  # a cat: the logits, then sinks
    tensors.sort(key=lambda a: a.shape != t.shape)  # the logits themselves before a bias or mask added to them
    for a in tensors:
        found = _back_to_product(ops, producers, a, i, depth - 1)
        if found is None:
            continue
        index, factor = found
        scalars = [s for s in (_scalar(b) for b in args if b is not a) if s is not None]
        if func in _MUL and scalars:
            factor *= scalars[0]
        elif func in _DIV and scalars and args[0] is a:
            factor /= scalars[0]
        return index, factor
    return None


def regroups(func, args, result: torch.Tensor) -> bool:
    """Whether a call only regroups the lead axes of its tensor, each (T, S) map kept whole."""
    x = args[0] if args else None
    return (func in _REGROUP and isinstance(x, torch.Tensor) and isinstance(result, torch.Tensor)
            and x.ndim >= 3 and result.ndim >= 3 and x.shape[-2:] == result.shape[-2:] and x.numel() == result.numel())


def _einsum_axes(equation: str, operands) -> tuple[str, list[str], str] | None:
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    inputs = inputs.split(",")
    return (output, inputs, equation) if len(inputs) == 2 == len(operands) else None


def _product_operands(op: Op) -> tuple[Operand, Operand] | None:
    """The (query-side, key-side) operands of a product whose result is (…, T, S)."""
    func, args, kwargs = op[0], op[1], op[2]
    if func in _MATMUL:
        a, b = args[0], args[1]
        return Operand(a, -2, -1), Operand(b, -1, -2)
    if func in _BADDBMM:  # batch1 and batch2 may come by keyword (Bloom's alibi.baddbmm(batch1=q, batch2=kᵀ))
        a, b = (args[i] if len(args) > i else kwargs.get(key) for i, key in ((1, "batch1"), (2, "batch2")))
        return None if a is None or b is None else (Operand(a, -2, -1), Operand(b, -1, -2))
    operands = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    parsed = _einsum_axes(args[0], operands)
    if parsed is None:
        return None
    output, (sa, sb), _ = parsed
    query, key = output[-2], output[-1]
    shared = [c for c in sa if c in sb and c not in output]
    if len(shared) != 1 or query not in sa or key not in sb:
        return None
    c = shared[0]
    return Operand(operands[0], sa.index(query), sa.index(c)), Operand(operands[1], sb.index(key), sb.index(c))


def map_operands(rec: Record):
    """(q, k, (logits before any scale, factor after), scale of a scaled-dot-product call or None)
    of the module's first attention map that is applied to values (:func:`value_operand`; a map
    computed only to be kept is passed over), with v; None when it has none the trace can follow."""
    for found in _maps(rec):
        v = value_operand(rec.ops, found)
        if v is not None:
            return (*found, v)
    return None


def applied_maps(rec: Record) -> list[int]:
    """The channels of q behind each attention map the call applies to values, in call order:
    one entry for a layer that makes all its heads' maps at once, one a head for a per-head loop."""
    return [found[0].channels for found in _maps(rec) if value_operand(rec.ops, found) is not None]


def square_map(func, out) -> bool:
    """Whether a recorded op is a softmax that makes (…, T, T) maps, each query over as many keys."""
    return func in _SOFTMAX and isinstance(out, torch.Tensor) and out.ndim >= 3 and out.shape[-1] == out.shape[-2]


def _maps(rec: Record):
    ops = rec.ops
    producers = _producers(ops)
    for i, (func, args, kwargs, out) in enumerate(ops):
        if func in FUSED:
            call = fused_call(func, args, kwargs)
            q, k = call.query, call.key
            keys = k.detach().double()
            if keys.ndim >= 3 and keys.shape[-3] != q.shape[-3]:  # grouped-query: each key head serves several
                keys = keys.repeat_interleave(q.shape[-3] // keys.shape[-3], dim=-3)
            made = q.detach().double() @ keys.transpose(-2, -1)
            yield Operand(q, -2, -1, i), Operand(k, -2, -1, i), (made, 1.0), call.scale
        cut = sinks_cut(ops, i)
        if square_map(func, out) or cut is not None:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim is None or dim % out.ndim != out.ndim - 1:
                continue
            found = _back_to_product(ops, producers, args[0], i)
            operands = None if found is None else _product_operands(ops[found[0]])
            if operands is None:
                continue
            q, k = operands
            q.product_index = k.product_index = i
            q.keys_kept = cut
            yield q, k, (_product_part(ops[found[0]], rec.snapshots[found[0]]), found[1]), None


def sinks_cut(ops: list[Op], i: int) -> slice | None:
    """The key columns of softmax ``i``'s map (…, T, T + s) that a later call keeps, cutting off
    s columns first or last (attention sinks: a learned logit per head joined to q kᵀ, dropped
    after the softmax, as gpt-oss does); None when no call cuts it so."""
    out = ops[i][3]
    if ops[i][0] not in _SOFTMAX or not isinstance(out, torch.Tensor) or out.ndim < 3 or out.shape[-1] <= out.shape[-2]:
        return None
    cut = next((r for f, a, _, r in ops[i + 1:] if f is torch.Tensor.__getitem__ and a and a[0] is out
                and isinstance(r, torch.Tensor) and r.shape == (*out.shape[:-1], out.shape[-2])), None)
    return kept_keys(out, cut)


def _product_part(op: Op, made: torch.Tensor) -> torch.Tensor:
    """The q kᵀ part of a product's output: a ``baddbmm``'s without the term it adds to it
    (β·input: Bloom's ALiBi bias), which is no product of projections."""
    func, args, kwargs, _ = op
    if func not in _BADDBMM or not args or not isinstance(args[0], torch.Tensor):
        return made
    return made - kwargs.get("beta", 1.0) * args[0].detach().to(made.dtype)


_TRANSPOSES = {torch.transpose, torch.Tensor.transpose, torch.Tensor.mT.__get__, torch.swapaxes,
               torch.Tensor.swapaxes, torch.Tensor.permute, torch.permute}


def _swaps_last_two(func, args, result: torch.Tensor) -> bool:
    """Whether a call transposes its tensor's last two axes and keeps the rest in place."""
    if func not in _TRANSPOSES:
        return False
    x = args[0]
    if func in (torch.Tensor.permute, torch.permute):
        dims = args[1:] if len(args) > 2 or not isinstance(args[1], (tuple, list)) else args[1]
        order = [d % x.ndim for d in dims]
        return order == [*range(x.ndim - 2), x.ndim - 1, x.ndim - 2]
    if func is torch.Tensor.mT.__get__:
        return True
    return sorted(a % x.ndim for a in args[1:3]) == [x.ndim - 2, x.ndim - 1]


def value_operand(ops: list[Op], found) -> Operand | None:
    """The v operand of the product that applies the map (a scaled-dot-product call's own v)."""
    q = found[0]
    i = q.product_index
    func, args, kwargs, out = ops[i]
    if func in FUSED:
        return Operand(fused_call(func, args, kwargs).value, -2, -1, i, (-2, -1))
    derived, flipped = {id(out)}, set()  # the map as it goes on, and its transpose (keys first)
    for j in range(i + 1, len(ops)):
        func, args, kwargs, result = ops[j]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or not isinstance(result, torch.Tensor):
            continue
        first = id(tensors[0])
        carried = (func in _CARRY or regroups(func, args, result)
                   or (func is torch.Tensor.__getitem__ and q.keys_kept is not None)  # the sinks cut off
                   or (first in derived and mixes_heads(func, args, result)))  # talking heads: judged
        if first in derived | flipped and (carried or _swaps_last_two(func, args, result)):
            same = first in derived if carried else first in flipped
            (derived if same else flipped).add(id(result))
        elif func in _MATMUL and id(args[0]) in derived:
            return Operand(args[1], -2, -1, j, (-2, -1))
        elif func in _MATMUL and id(args[1]) in flipped:  # v (…, r, T) @ mapᵀ: the context keys last
            return Operand(args[0], -1, -2, j, (-1, -2))
        elif func is torch.einsum:
            operands = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            parsed = _einsum_axes(args[0], operands)
            if parsed is None or id(operands[0]) not in derived:
                return None
            output, (sp, sv), _ = parsed
            key = sp[-1]
            chan = [c for c in sv if c not in sp]
            if len(chan) != 1 or key not in sv:
                return None
            query = sp[-2]
            return Operand(operands[1], sv.index(key), sv.index(chan[0]), j,
                           (output.index(query), output.index(chan[0])))
    return None
