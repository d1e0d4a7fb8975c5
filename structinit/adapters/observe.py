"""What a model's attention really computes: the attention probabilities each layer forms in
its own forward, captured where they are made.

One forward pass runs under a :class:`~torch.overrides.TorchFunctionMode` that sees every
``softmax`` (function, method or ``torch.softmax``), every fused attention call
(``scaled_dot_product_attention``, ``flex_attention``: :mod:`structinit.adapters.fused`) and every
``torch.nn.functional.multi_head_attention_forward`` (``nn.MultiheadAttention``, which the mode
also keeps off its fused fast path). Module hooks say which module is running, so each map is
filed under the innermost module that made it. A map is kept when it is *attention-shaped*:
a softmax over the last axis of a tensor of three or more axes, i.e. (…, queries, keys).

For softmax the logits are its input; for a fused call they are the q kᵀ·scale (after its masks
and ``score_mod``) of the very q and k the module hands it, after any rotation or norm; for
``nn.MultiheadAttention`` the probabilities come from torch's own function run again with
``need_weights=True`` (no logits). Nothing here reads an adapter's idea of the layer: this is
the ground truth the adapters are checked against (:mod:`structinit.adapters.verify`).

The forward runs in eval mode without gradients, with torch's global random state forked and
seeded, so a probe neither consumes the caller's random numbers nor sees a different random
token order (an MAE-style shuffle) from one probe to the next.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from structinit.adapters.fused import FUSED, compiling, fused_call
from structinit.adapters.probe import call_copy, detach_all, handed, probing, replaced_tokens, run_forward
from structinit.adapters.relative import reachable
from structinit.functional.attention import MASKED_PROB, kept_keys

if TYPE_CHECKING:
    from structinit.adapters.attention import AttentionAdapter

_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax}
_MHA = F.multi_head_attention_forward
_MHA_SIGNATURE = inspect.signature(_MHA)
# A module that holds no parameter only carries a map made in it (vit-pytorch's ``attend = nn.Softmax(dim=-1)``,
# MaxViT's Sequential(Softmax, Dropout), an ``Attend`` its parent hands q, k and v): the map belongs to its parent.
_carrier = lambda m: next(m.parameters(), None) is None


@dataclass
class AttentionMap:
    """One attention-shaped softmax a module computed: ``probs`` (…, Tq, Tk) float32, and the
    ``logits`` it came from (same shape, up to a constant per row) when they were visible."""

    probs: torch.Tensor
    logits: torch.Tensor | None
    source: str  # 'softmax', 'fused' or 'multihead'
    q: torch.Tensor | None = None  # what a fused call received (B, H, Tq, r)
    k: torch.Tensor | None = None
    applied: bool = True  # a softmax's map: whether the forward used it (False for one computed and dropped)
    open_pairs: torch.Tensor | None = None  # (T, T) bool, for maps joined from segments: the pairs inside one
    # Key columns the forward dropped from the map before applying it (attention sinks, as gpt-oss's learned
    # per-head logit): ``probs`` and ``logits`` are the columns kept, whose rows then sum to less than one.
    sinks: int = 0

    def drop_keys(self, cols: slice) -> None:
        """Keep key columns ``cols`` of the map (:attr:`sinks`), and of its logits less the
        log-sum-exp of the sinks' (none where they are all -inf: a sink switched off): a shift of
        each row (a max subtracted for stability) then leaves them as they were, up to a constant per head."""
        self.sinks = self.keys - (cols.stop - cols.start)
        self.probs = self.probs[..., cols]
        if self.logits is not None:
            dropped = torch.cat([self.logits[..., :cols.start], self.logits[..., cols.stop:]], -1)
            shift = dropped.logsumexp(-1, keepdim=True)
            self.logits = self.logits[..., cols] - shift.masked_fill(shift.isneginf(), 0.0)

    @property
    def queries(self) -> int:
        return int(self.probs.shape[-2])

    @property
    def keys(self) -> int:
        return int(self.probs.shape[-1])


@dataclass
class ModuleCall:
    """The first call of one watched module during the probe: the (B, T, D) tokens its q/k
    projection received, the call's arguments, the maps made inside it, and its output."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    x: torch.Tensor | None = None
    maps: list[AttentionMap] = field(default_factory=list)
    output: object = None
    done: bool = False
    source: torch.Tensor | None = None  # the tokens as the model passed them (before a substitution)
    # What the layer's own q projection received and its output projection returned: the tokens
    # of its maps and its output in their rows, for a layer that cuts (pads, shifts) its own windows
    q_input: torch.Tensor | None = None
    o_output: torch.Tensor | None = None
    k_input: torch.Tensor | None = None  # what a k projection apart from q's received (an encoder's output?)
    # Calls in the forward; what the first was handed, and the first later one handed otherwise (if any)
    times: int = 0
    handed: tuple = ()
    unlike: tuple | None = None


def _mha_map(args: tuple, kwargs: dict) -> AttentionMap | None:
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    # is_causal off: torch needs a mask beside the hint, and the mask is passed as well
    bound.arguments.update(need_weights=True, average_attn_weights=False, is_causal=False)
    _, weights = _MHA(*bound.args, **bound.kwargs)
    if weights is None:
        return None
    probs = weights.detach().float()
    return AttentionMap(probs if probs.ndim == 4 else probs.unsqueeze(0), None, "multihead")


class _Spy(TorchFunctionMode):
    """Files every attention-shaped map under the innermost running module (module doc)."""

    def __init__(self, stack: list[nn.Module], sink, on_linear=None):
        super().__init__()
        self.stack, self.sink, self.on_linear = stack, sink, on_linear
        self.derived: dict[int, tuple[weakref.ref, AttentionMap]] = {}  # tensors made from a softmax's map

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if compiling():  # flex_attention compiling its op: read when it runs (adapters.fused)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.derived:
            self._follow(args, kwargs, out)
        if not self.stack:
            return out
        if func is F.linear and self.on_linear is not None:
            self.on_linear(args, kwargs, out)
        found = None
        if func in _SOFTMAX and isinstance(out, torch.Tensor) and out.ndim >= 3:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim is not None and dim % out.ndim == out.ndim - 1:
                found = AttentionMap(out.detach().float(), args[0].detach().float(), "softmax", applied=False)
                self.derived[id(out)] = (weakref.ref(out), found)
        elif func in FUSED:
            call = fused_call(func, args, kwargs)
            logits = call.logits()
            found = AttentionMap(logits.softmax(-1), logits, "fused", call.query.detach().float(),
                                 call.key.detach().float())
        elif func is _MHA:
            found = _mha_map(args, kwargs)
        if found is not None:
            self.sink(self.stack, found)
        return out

    def _follow(self, args, kwargs, out) -> None:
        """A softmax's map is applied when an op takes a tensor made from it together with
        another tensor of two or more axes (its values, through a product or a mask); an op that
        takes it alone (a cast, a dropout, a reshape) makes another tensor made from it."""
        tensors = [t for t in _tensors_in((*args, *kwargs.values())) if t is not out]
        made = [self._map_of(t) for t in tensors]
        maps = [m for m in made if m is not None]
        if not maps:
            return
        if any(t.ndim >= 2 and m is None for t, m in zip(tensors, made)):
            for found in maps:  # applied: what it makes is the layer's output, followed no further
                found.applied = True
            self.derived = {k: entry for k, entry in self.derived.items() if not entry[1].applied}
            return
        if not maps[0].sinks and len(tensors) == 1 and tensors[0].shape == maps[0].probs.shape \
                and (kept := kept_keys(tensors[0], out)) is not None:
            maps[0].drop_keys(kept)
        for t in _tensors_in((out,)):
            self.derived[id(t)] = (weakref.ref(t), maps[0])

    def _map_of(self, t: torch.Tensor) -> AttentionMap | None:
        """The map ``t`` was made from, or None (an id a freed tensor held is not ``t``'s)."""
        entry = self.derived.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t and not entry[1].applied else None


def _tensors_in(values) -> list[torch.Tensor]:
    """The tensors among ``values``, one level into tuples and lists (einsum's operands)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def _owner(stack: list[nn.Module]) -> nn.Module:
    return next((module for module in reversed(stack) if not _carrier(module)), stack[-1])


@torch.no_grad()
def observe(model: nn.Module, inputs, watched: Iterable[tuple[nn.Module, nn.Module, object]] = (),
            *, seed: int = 0, substitute: dict[nn.Module, Callable[[torch.Tensor], torch.Tensor]] | None = None,
            ) -> tuple[dict[nn.Module, ModuleCall], dict[nn.Module, list[AttentionMap]]]:
    """Run ``inputs`` through ``model`` once (module doc) and return what its attention did.

    ``watched`` holds (module, input module, adapter-like) triples: for each module its first
    call is recorded (:class:`ModuleCall`), with the tokens its input module received read by
    ``adapter.input_tokens(args, kwargs)`` and every map made anywhere inside it. The second
    result files every map of the pass by module (module doc). Raises whatever the forward
    raises; the caller decides what a failed probe means.

    ``substitute`` maps a watched module to ``fn(x) -> x'``: in its first call the tokens its
    input module receives are replaced by ``fn(x)`` (same shape), in every argument that holds
    them (``nn.MultiheadAttention`` gets them as query, key and value), so the module's own
    forward runs on tokens of the caller's choosing.
    """
    substitute = substitute or {}
    watched = list(watched)
    calls = {module: ModuleCall() for module, _, _ in watched}
    by_module: dict[nn.Module, list[AttentionMap]] = {}
    stack: list[nn.Module] = []
    active: list[ModuleCall] = []

    def sink(frames, found):
        by_module.setdefault(_owner(frames), []).append(found)
        for call in active:
            call.maps.append(found)

    def push(module, args):
        stack.append(module)

    def pop(module, args, output):
        if stack and stack[-1] is module:
            stack.pop()

    handles = [nn.modules.module.register_module_forward_pre_hook(push),
               nn.modules.module.register_module_forward_hook(pop)]
    projections = {id(calls[module]): _projection_storages(adapter) for module, _, adapter in watched}

    def on_linear(args, kwargs, out):
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if not isinstance(weight, torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        ptr = weight.untyped_storage().data_ptr()
        for call in active:
            q_ptr, k_ptr, o_ptr = projections[id(call)]
            if ptr == q_ptr and call.q_input is None:
                call.q_input = args[0].detach()
            elif ptr == k_ptr != q_ptr and call.k_input is None:
                call.k_input = args[0].detach()
            elif ptr == o_ptr and call.o_output is None:
                call.o_output = out.detach()

    handles += _watch_calls(watched, calls, active, substitute)
    try:
        with probing(model, seed), _Spy(stack, sink, on_linear):
            run_forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    # A map the forward computed and never used (Hugging Face's SAM 2 softmaxes each token's heads, then
    # drops it) is no attention: left out, it cannot stand in for the map the layer applies.
    for maps in (*by_module.values(), *(call.maps for call in calls.values())):
        maps[:] = [m for m in maps if m.applied]
    for call in calls.values():
        call.maps[:] = _joined_segments(call.maps, call.x)
    return calls, {module: maps for module, maps in by_module.items() if maps}


def _joined_segments(maps: list[AttentionMap], x: torch.Tensor | None) -> list[AttentionMap]:
    """Maps a layer computes one segment of its T tokens at a time (eager attention over a packed
    sequence's ``cu_seqlens``) as one (…, H, T, T) map, the pairs across segments closed."""
    if x is None or x.ndim != 3 or len(maps) < 2 or any(m.probs.ndim < 3 or m.queries != m.keys for m in maps):
        return maps
    lead, tokens = maps[0].probs.shape[:-2], x.shape[-2]
    if any(m.probs.shape[:-2] != lead for m in maps) or sum(m.queries for m in maps) != tokens:
        return maps
    probs = maps[0].probs.new_zeros(*lead, tokens, tokens)
    logits = None if any(m.logits is None for m in maps) else probs.new_full(probs.shape, float("-inf"))
    open_pairs = torch.zeros(tokens, tokens, dtype=torch.bool, device=probs.device)
    start = 0
    for m in maps:
        span = slice(start, start + m.queries)
        probs[..., span, span] = m.probs
        if logits is not None:
            logits[..., span, span] = m.logits.reshape(m.probs.shape)
        open_pairs[span, span] = True
        start += m.queries
    return [AttentionMap(probs, logits, "segments", open_pairs=open_pairs)]


def _projection_storages(adapter) -> tuple[int | None, int | None, int | None]:
    """The storages of an adapter's q, k and output projection weights (a fused qkv's q rows share
    the storage of the weight the layer hands ``F.linear``: k's is then q's), or None where it has none."""
    try:
        views = adapter.linear_views()
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None, None, None
    return tuple(views[role][0].untyped_storage().data_ptr() if role in views else None for role in "qko")


def _watch_calls(watched: list, calls: dict[nn.Module, ModuleCall], active: list[ModuleCall], substitute: dict) -> list:
    """Hooks that record each watched module's first call in ``calls`` (in ``active`` while it
    runs) and substitute its tokens (:func:`observe`); their handles, for the caller to remove."""
    handles = []
    for module, input_module, adapter in watched:
        call = calls[module]

        def enter(mod, args, kwargs, call=call):
            if call not in active:  # (not the module called inside its own call)
                call.times += 1
                if not call.done:
                    call.args, call.kwargs, call.handed = call_copy(args), call_copy(kwargs), handed(args, kwargs)
                    active.append(call)
                elif call.unlike is None and (now := handed(args, kwargs)) != call.handed:
                    call.unlike = now

        def leave(mod, args, kwargs, output, call=call):
            if call in active:
                active.remove(call)
                call.output, call.done = detach_all(output), True

        swap_tokens = substitute.get(module)

        def grab(mod, args, kwargs, call=call, adapter=adapter, swap=swap_tokens):
            if call not in active or call.x is not None:
                return None
            try:
                call.x = adapter.input_tokens(args, kwargs).detach()
            except (StopIteration, AttributeError, TypeError, IndexError):
                return None
            if swap is None:
                return None
            call.source = adapter.input_tokens(args, kwargs)
            call.x = swap(call.x)
            return replaced_tokens(args, kwargs, call.source, call.x, adapter)

        def follow(mod, args, kwargs, call=call, adapter=adapter):
            # k/v projections that read the same tokens as q (a q Linear beside a kv Linear, after a
            # norm inside the module) read the substituted tokens too
            if call not in active or call.source is None:
                return None
            return replaced_tokens(args, kwargs, call.source, call.x, adapter)

        handles += [module.register_forward_pre_hook(enter, with_kwargs=True),
                    input_module.register_forward_pre_hook(grab, with_kwargs=True),
                    module.register_forward_hook(leave, with_kwargs=True)]
        if swap_tokens is not None:
            handles += [m.register_forward_pre_hook(follow, with_kwargs=True) for m in adapter.sibling_inputs]
    return handles


@dataclass
class RealMap:
    """One layer's attention as its forward computed it: ``probs`` (B', heads, T, T) float32 (B'
    counts images × windows for a windowed layer) and ``open_pairs`` (B', 1 or heads, T, T) bool,
    the pairs the call did not mask, or None when it masked none."""

    probs: torch.Tensor
    open_pairs: torch.Tensor | None
    logits: torch.Tensor | None = None  # the softmax's input, same shape, when it was visible


@torch.no_grad()
def real_maps(model: nn.Module, inputs, chosen: list[tuple[str, AttentionAdapter]],
              calls: dict[nn.Module, ModuleCall] | None = None) -> list[RealMap]:
    """The attention probabilities each chosen layer computes in one forward of ``inputs``
    (:func:`~structinit.adapters.observe.observe`; or read from its ``calls``, already
    observed). RuntimeError, naming the layer, when one is not called or forms no square map
    over its tokens."""
    if calls is None:
        calls, _ = observe(model, inputs, [(ad.module, ad.input_module, ad) for _, ad in chosen])
    out = []
    for name, ad in chosen:
        call = calls[ad.module]
        found = [m for m in call.maps if m.probs.ndim >= 3 and m.queries == m.keys]
        square = [m.probs for m in found]
        if not call.done or not square:
            raise RuntimeError(f"attention layer {name!r} was {'not called' if not call.done else 'called'} in the "
                               "model's forward but formed no square attention map there; its maps cannot be read")
        t = square[0].shape[-1]
        shape = torch.Size((square[0].numel() // (ad.num_heads * t * t), ad.num_heads, t, t))
        probs = ad.observed_probs(square, shape)
        if probs is None:
            raise RuntimeError(f"attention layer {name!r} formed maps of shape {tuple(square[0].shape)}, which do not "
                               f"split into its {ad.num_heads} heads")
        source = next((m for m in found if m.probs.data_ptr() == probs.data_ptr()), None)
        if source is not None and source.open_pairs is not None:  # segments, each its own softmax
            open_pairs = source.open_pairs.expand(probs.shape)
        elif call.x is not None and call.x.ndim == 3 and call.x.shape[-2] == t:
            open_pairs = reachable(ad.call_terms(call.args, call.kwargs, call.x))
            if open_pairs is not None and open_pairs.shape[0] != probs.shape[0]:
                open_pairs = None
        else:  # the layer cuts its own windows and masks inside: read the mask off the map
            open_pairs = probs > MASKED_PROB
        logits = None if source is None or source.logits is None else source.logits.reshape(probs.shape)
        out.append(RealMap(probs, open_pairs, logits))
    return out
