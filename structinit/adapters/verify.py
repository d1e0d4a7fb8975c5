"""Every attention layer an adapter claims, checked against what the model itself computes.

A probe runs through the model (:func:`structinit.adapters.observe.observe`); each layer is judged on its first call:

- **self**: its (T × T) softmax map over the T tokens it receives equals the adapter's
  softmax(q kᵀ·scale + bias) from them, and its output is that map applied to the value
  projection, through the output projection (or the per-head context, when that is a sibling);
- **pooling**: its maps are not over its tokens (an attention-pooling or class-attention head,
  or queries, keys or both pooled to fewer tokens inside the layer); schemes leave it alone and list it;
- **refused**: anything else, with what differs: heads mixed before the softmax (talking
  heads), q and k rotated by position (RoPE), a norm on q and k, a logit term that does not
  depend on content, a q/k layout other than the adapter's, no map at all (linear attention), an
  output that is not the map applied to v, or a later call in the forward handed other shapes.

Modules that form an attention-shaped map and that no adapter claims are listed too (``unknown``).
A model that cannot be probed is judged by names only; :attr:`AttentionSurvey.probed` says which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from structinit.adapters.attention import AttentionAdapter, adapter_logits, head_mixers, in_matrix, out_matrix
from structinit.adapters.logit_transforms import (
    HEAD_MIXING,
    LAYOUT,
    NAME_MISREADS,
    NO_MAP,
    NO_PROJECTION,
    POSITION_BIAS,
    SELF_MASK,
    UNCALLED,
    UNLIKE_CALLS,
    VALUE_PATH,
    added_term,
    as_shape,
    diagnose,
)
from structinit.adapters.observe import ModuleCall, observe
from structinit.adapters.probe import unlike_calls
from structinit.adapters.provenance import TraceError, trace_attention
from structinit.adapters.provenance_output import dropped_in_eval
from structinit.adapters.provenance_record import HandedQueries
from structinit.adapters.provenance_tokens import (
    fits_maps,
    keys_from_elsewhere,
    map_tokens,
    maps_over_tokens,
    module_output,
    off_token_maps,
    pooled_inside,
    pooling_words,
    same_logits,
    token_count,
    tokens_of_call,
)
from structinit.adapters.traced import CallTokens
from structinit.functional.attention import MASKED_PROB, closes_the_future, masked_inside
from structinit.utils.state import own_precision


@dataclass(frozen=True)
class Verdict:
    """How one adapted layer behaved in the probe: ``kind`` 'self', 'pooling' or 'refused'
    (with ``code``, one of this module's constants, and ``reason`` in words); ``checked`` is
    False when the layer could not be compared with its adapter (it was judged by names)."""

    name: str
    adapter: AttentionAdapter
    kind: str
    code: str = ""
    reason: str = ""
    checked: bool = True
    # Talking-heads mixers (names inside the module) that make it plain self-attention when set to
    # the identity: a scheme that writes the layer sets them so (structinit.schemes.checks.plain_heads).
    mixers: tuple[str, ...] = ()
    tokens: int | None = None  # how many tokens the layer's maps span in the probe (its (B, T, D) input's T)


@dataclass
class AttentionSurvey:
    """The attention of a model as its forward shows it (module doc)."""

    verdicts: list[Verdict] = field(default_factory=list)
    unknown: list[tuple[str, str]] = field(default_factory=list)  # (module name, what it computes)
    pooling: list[tuple[str, str]] = field(default_factory=list)  # unclaimed pooling heads (name, why)
    probed: bool = False
    probe: object = None  # what the model took: (B, C, H, W) images, (B, T) token ids, or a caller's ModelCall
    # Softmax maps over 3-D logits of unequal counts in unclaimed modules, (name, what): attention whose keys
    # are pooled (CvT's), or a router's; not read as attention, but a reason to write nothing else in its place
    unread: list[tuple[str, str]] = field(default_factory=list)

    def of(self, kind: str) -> list[Verdict]:
        return [v for v in self.verdicts if v.kind == kind]

    def skipped(self) -> list[tuple[str, str]]:
        """(name, why) of every attention-pooling head, claimed by an adapter or not."""
        return [(v.name, v.reason) for v in self.of("pooling")] + self.pooling

    def verdict(self, name: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.name == name), None)


def no_value_path(unread: str) -> str:  # why a layer has no W_v W_o to set, in words
    return f"{unread}: the value path is not linear token by token, so it has no W_v W_o to set"


def tolerance(dtype: torch.dtype) -> float:  # how far a probability may sit from the float32 recomputation
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def output_tolerance(dtype: torch.dtype) -> float:  # a layer output's, relative to its largest entry
    return 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2


def _value_path(adapter: AttentionAdapter, probs: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None,
                rel: float = 1e-3) -> bool:
    """Whether ``out`` is ``probs`` applied to the value projection of ``x`` (then the output
    projection, or as the per-head context), to ``rel`` of its largest entry; True when the
    layer returned nothing comparable."""
    if out is None:
        return True
    views = adapter.read_views()
    (wv, bv), (wo, bo) = views["v"], views["o"]
    wv, wo, bv = in_matrix(wv), out_matrix(wo), None if bv is None else bv.reshape(-1)
    b, h, t, _ = probs.shape
    v = adapter.head_values(nn.functional.linear(x.float(), wv.float(), None if bv is None else bv.float()), h)
    if v is None:
        return False
    context = (probs @ v).transpose(1, 2).reshape(b, t, -1)
    projected = nn.functional.linear(context, wo.float(), None if bo is None else bo.float())
    out = out.float()
    for want in (projected, context):
        # windows received already cut come back in the same layout: the rows of x, as map_rows read them
        rows = out.reshape(want.shape) if out.numel() == want.numel() and out.shape[-1] == want.shape[-1] else out
        for got in (out, out.transpose(0, 1) if out.ndim == 3 else out, rows):
            if got.shape == want.shape:
                scale = float(want.abs().max()) + 1e-6
                if float((got - want).abs().max()) <= rel * scale:
                    return True
    return False


@torch.no_grad()
def judge(name: str, adapter: AttentionAdapter, call: ModuleCall, dtype: torch.dtype) -> Verdict:
    """The :class:`Verdict` on one adapted layer from its recorded call (module doc)."""
    if not call.done:
        return Verdict(name, adapter, "refused", UNCALLED, "it was not called in the model's forward (an unused "
                       "layer, or a fused fast path)")
    if call.unlike is not None:
        return Verdict(name, adapter, "refused", UNLIKE_CALLS, unlike_calls(call.times, call.handed, call.unlike))
    maps = [m for m in call.maps if m.probs.ndim >= 3]
    if not maps:
        return Verdict(name, adapter, "refused", NO_MAP,
                       "it forms no softmax(q kᵀ) map over its tokens (linear or factorised attention): there "
                       "is no map to shape")
    x, out = map_tokens(call.x, maps, adapter.num_heads), module_output(call)
    rows = None if fits_maps(x, maps) or call.o_output is None else map_tokens(call.q_input, maps, adapter.num_heads)
    if fits_maps(rows, maps):  # a layer that cuts its own windows: its maps' rows are what its projections see
        x, out = rows, call.o_output
    # No tokens of its maps to read, or NaN/inf in the model already: the probe can tell nothing.
    cross = next((m for m in maps if m.probs.ndim >= 4), None)  # queries pooled inside the layer (SAM 2's Hiera)
    if x is None and cross is not None and all(m.queries != m.keys for m in maps if m.probs.ndim >= 4):
        return Verdict(name, adapter, "pooling", reason=pooling_words(cross))
    if x is None or not bool(torch.isfinite(x).all()):
        return Verdict(name, adapter, "self", checked=False)
    tokens = x.shape[-2]
    first = call.args[0] if call.args and isinstance(call.args[0], torch.Tensor) else None
    seen = {tokens} | ({first.shape[-2]} if first is not None and first.ndim == 3 else set())  # q's and the call's
    # A softmax over a head's features (linear attention normalises q that way) is not a map over tokens
    over_tokens = maps_over_tokens(maps, seen, adapter.head_dim, tokens, x.shape[0], adapter.num_heads)
    square = [m for m in over_tokens if m.queries == m.keys == tokens]
    if not square:
        kind, words = off_token_maps(over_tokens, seen, tokens, x.shape[0], adapter.num_heads)
        if kind == "pooling":
            return Verdict(name, adapter, "pooling", reason=words)
        if kind == "windows":  # cut after its projections: the trace reads which tokens each window holds
            return Verdict(name, adapter, "refused", LAYOUT, words)
        n, per_row = x.shape[0], x.shape[1] * adapter.num_heads  # sequence first: the trace reads the tokens so
        if any(m.queries == m.keys == n and m.probs.numel() == per_row * n * n for m in over_tokens):
            return Verdict(name, adapter, "refused", LAYOUT, f"its maps are {n}×{n}, over the first axis of its input: "
                           f"its tokens come sequence first, (T, B, D), not as {type(adapter).__name__} reads them")
        return Verdict(name, adapter, "refused", NO_MAP,
                       f"it forms no softmax(q kᵀ) map over its {tokens} tokens (its softmax maps are "
                       f"{maps[0].queries}×{maps[0].keys}: linear or factorised attention): there is no map to shape")
    adapter.receive_call(call.args, call.kwargs, x)
    terms = adapter.call_terms(call.args, call.kwargs, x)
    try:
        ours = adapter.attention_probs(x.float(), terms)
    except RuntimeError as err:  # its weights are not laid out as the adapter reads them: the trace reads them
        return Verdict(name, adapter, "refused", LAYOUT, f"its projections are not laid out as "
                       f"{type(adapter).__name__} reads them ({str(err).splitlines()[0]})")
    real = adapter.observed_probs([m.probs for m in square], ours.shape)
    if real is None or not computes_as_read(adapter, real, ours, square, x, terms, dtype):
        best = min(square, key=lambda m: float((as_shape(m.probs, ours.shape) - ours).abs().max())
                   if as_shape(m.probs, ours.shape) is not None else float("inf"))
        if as_shape(best.probs, ours.shape) is None:
            return Verdict(name, adapter, "refused", LAYOUT,
                           f"its map has shape {tuple(best.probs.shape)}, the adapter's {tuple(ours.shape)}")
        code, words = getattr(adapter, "qk_transform", None) or diagnose(adapter, best, ours, x, terms)
        if code == POSITION_BIAS:  # what a check after a write of the projections must find it adds again
            adapter.added_term = added_term(adapter, best, x, terms)
        return Verdict(name, adapter, "refused", code, words)
    adapter.masks_future = closes_the_future(real <= MASKED_PROB)  # a causal mask it builds inside
    if getattr(adapter, "output_unread", None):  # its maps are the q kᵀ read; its value path has no V O to set
        return Verdict(name, adapter, "refused", NO_PROJECTION, no_value_path(adapter.output_unread))
    if not _value_path(adapter, real, x, adapter.output_tokens(out), rel=output_tolerance(dtype)):
        return Verdict(name, adapter, "refused", VALUE_PATH, dropped_in_eval(adapter.module, call.args, call.kwargs)
                       or "its output is not its attention map applied to v through its output projection (heads "
                       "mixed after the softmax, a second map mixed in, or a projection structinit does not see)")
    if adapter.masks_self:  # plain attention otherwise: what the mask hides is impulse's centre offset
        return Verdict(name, adapter, "refused", SELF_MASK,
                       "it masks each token's logit on itself (a masked diagonal, as in LSA), a logit term that does "
                       "not depend on content: a head cannot attend to its own token, impulse's centre offset")
    return Verdict(name, adapter, "self")


def computes_as_read(adapter: AttentionAdapter, real: torch.Tensor, ours: torch.Tensor, maps: list, x: torch.Tensor,
                     terms: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether a layer's own maps ``real`` are the maps ``ours`` its adapter computes from the
    parameters it reads, on its tokens ``x``: to the probability tolerance, or with some pairs
    closed by a mask it builds inside, or from the same logits (``maps``, the softmaxes seen in
    the call) where large logits saturate the softmax, or, for a map whose sink columns the forward
    dropped, with its rows renormalised over the tokens' keys."""
    tol = tolerance(dtype)
    if any(getattr(m, "sinks", 0) for m in maps):  # the sinks' share of each row is no pair of tokens
        real = real / real.sum(-1, keepdim=True).clamp_min(1e-30)
    return (float((real - ours).abs().max()) <= tol or masked_inside(real, ours, tol)
            or same_logits(adapter_logits(adapter, x.float(), terms), maps, dtype))


@own_precision()
def survey_attention(model: nn.Module, candidates: list[tuple[str, AttentionAdapter]],
                     probes: Iterable[torch.Tensor]) -> AttentionSurvey:
    """Judge every candidate (name, adapter) by one probe through ``model``, the first of
    ``probes`` its forward takes (:func:`structinit.adapters.probe.probe_choices`), and list
    the attention no candidate covers (module doc). When it takes none, every candidate is
    'self', unchecked, and ``probed`` is False. Images are probed with one first: where every map
    is a claimed layer's plain self-attention, that is the survey; else the whole probe runs
    (a logit term that does not depend on content shows as what two images share)."""
    for inputs in probes:
        images = isinstance(inputs, torch.Tensor) and inputs.is_floating_point() and len(inputs) > 1
        for probe in [inputs[:1], inputs] if images else [inputs]:
            try:
                calls, by_module = observe(model, probe, [(ad.module, ad.input_module, ad) for _, ad in candidates])
            except Exception:  # a probe the model does not take: the next size, or text
                continue
            if (survey := _judged(model, candidates, probe, calls, by_module, whole=probe is inputs)) is not None:
                return survey
    return AttentionSurvey([Verdict(n, ad, "self", checked=False) for n, ad in candidates])


def _judged(model, candidates, inputs, calls, by_module, whole: bool = True) -> AttentionSurvey | None:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    verdicts = [dataclasses.replace(judge(n, ad, calls[ad.module], dtype), tokens=token_count(calls[ad.module]))
                for n, ad in candidates]
    if not whole and any(v.kind not in ("self", "pooling") for v in verdicts):
        return None
    verdicts = _with_plain_heads(model, candidates, verdicts, inputs, dtype)
    names = {m: n for n, m in model.named_modules()}
    unclaimed, pooling, unread = {}, [], []
    for module, maps in by_module.items():
        if any(module is m for _, ad in candidates for m in ad.module.modules()):
            continue
        # (B, heads, [windows,] q, k) is attention whatever its counts; a 3-D softmax of unequal ones may not be
        attention = [m for m in maps if m.probs.ndim >= 3 and (m.queries == m.keys or m.probs.ndim >= 4)]
        if not attention:
            unread += [(names.get(module, "?"), f"{type(module).__name__}: a {m.queries}×{m.keys} softmax map over "
                        "3-D logits") for m in [m for m in maps if m.probs.ndim == 3 and m.applied][:1]]
            continue
        m, name = attention[0], names.get(module, "?")
        if all(a.queries != a.keys for a in attention):
            pooling.append((name, f"{type(module).__name__}: {pooling_words(m)}"))
        else:
            unclaimed[module] = (name, f"{type(module).__name__}: a {m.queries}×{m.keys} softmax map")
    if not whole and (unclaimed or pooling):
        return None
    # A layer its adapter misread (another head layout, another value path, or misleading names: q and k in each
    # other's roles, a scale the forward does not apply) is read again by the trace; the trace's verdict replaces
    # the adapter's when it understands the layer, its reason joins the refusal if not.
    misread = {v.adapter.module: (v.name, "") for v in verdicts
               if v.kind == "refused" and v.code in (LAYOUT, VALUE_PATH, *NAME_MISREADS)}
    traced, unknown, crossed = traced_verdicts(model, inputs, {**unclaimed, **misread}, dtype)
    traced = _with_plain_heads(model, [(v.name, v.adapter) for v in traced], traced, inputs, dtype)
    again = {name for name, _ in misread.values()}
    better = {v.name: v for v in traced if v.name in again and v.kind != "refused"}
    why = {n: w.lstrip("; ") for n, w in unknown if n in again}
    verdicts = [better.get(v.name) or _unread(v, why.get(v.name), calls[v.adapter.module]) for v in verdicts]
    traced = [v for v in traced if v.name not in again]
    pooling += [c for c in crossed if c[0] not in again]  # left alone as a pooling head is
    unknown = [u for u in unknown if u[0] not in again]
    order = list(names)
    verdicts = sorted([*verdicts, *traced], key=lambda v: order.index(v.name) if v.name in order else len(order))
    return AttentionSurvey(verdicts, unknown, pooling, probed=True, probe=inputs, unread=unread)


def _unread(verdict: Verdict, why: str | None, call: ModuleCall) -> Verdict:
    """A layer its adapter misread that the trace could not read either (``why``): cross-attention,
    left alone as a pooling head is, where its keys are projected from other tokens than its
    queries; else refused, with both reasons."""
    if why is None:
        return verdict
    if crossed := keys_from_elsewhere(call):
        return dataclasses.replace(verdict, kind="pooling", code="", reason=crossed)
    return dataclasses.replace(verdict, reason=f"{verdict.reason}; read by what it computes, {why}")


def traced_verdicts(model: nn.Module, inputs, unclaimed: dict[nn.Module, tuple[str, str]],
                    dtype: torch.dtype) -> tuple[list[Verdict], list[tuple[str, str]], list[tuple[str, str]]]:
    """Attention that no adapter claims, read by provenance (:mod:`structinit.adapters.provenance`)
    from its call in a second probe and judged like any adapted layer; (verdicts, what stays
    unknown, with why the trace could not read it, and the cross-attention from queries made
    outside the layer, with why)."""
    if not unclaimed:
        return [], [], []
    reader = CallTokens()
    try:
        calls, _ = observe(model, inputs, [(m, m, reader) for m in unclaimed])
    except Exception:  # the first probe ran: a second that fails says nothing more
        return [], list(unclaimed.values()), []
    verdicts, unknown, crossed = [], [], []
    for module, (name, what) in unclaimed.items():
        call = calls[module]
        try:
            adapter = trace_attention(module, call.args, call.kwargs) if call.done else None
        except HandedQueries as err:  # queries made elsewhere (a global query): cross-attention
            crossed.append((name, f"{what}; cross-attention from queries made outside it: {err}"))
            continue
        except (TraceError, ValueError, RuntimeError, TypeError, IndexError, KeyError) as err:
            pooled = pooled_inside(call)  # a stage change: left alone as a pooling head is
            (crossed if pooled else unknown).append((name, f"{what}; {pooled or err}"))
            continue
        if adapter is None:
            unknown.append((name, what))
            continue
        call.x = tokens_of_call(adapter, call.args, call.kwargs).detach()
        verdicts.append(dataclasses.replace(judge(name, adapter, call, dtype), tokens=token_count(call)))
    return verdicts, unknown, crossed


def _with_plain_heads(model, candidates, verdicts, inputs, dtype) -> list[Verdict]:
    """Talking heads: a layer refused for mixing its heads, with Linear(h, h) or (h, h) mixers, is
    judged again with them set to the identity (restored after); a 'self' or another mechanism
    then is its verdict, with the mixers named, which a scheme sets so."""
    mixing = {i: m for i, (v, (_, ad)) in enumerate(zip(verdicts, candidates)) if v.kind == "refused"
              and v.code in (HEAD_MIXING, VALUE_PATH) and (m := head_mixers(ad.module, ad.num_heads))}
    if not mixing:
        return verdicts
    saved = [(t, t.detach().clone()) for mixers in mixing.values() for _, t, _ in mixers]
    with torch.no_grad():
        try:
            for mixers in mixing.values():
                for _, t, value in mixers:
                    t.copy_(value.to(device=t.device, dtype=t.dtype))
            again = [candidates[i] for i in mixing]
            calls, _ = observe(model, inputs, [(ad.module, ad.input_module, ad) for _, ad in again])
        finally:
            for t, value in saved:
                t.copy_(value)
    verdicts = list(verdicts)
    for i, mixers in mixing.items():
        name, ad = candidates[i]
        plain = judge(name, ad, calls[ad.module], dtype)
        named = tuple(n for n, _, _ in mixers)
        if plain.kind == "self":
            verdicts[i] = Verdict(name, ad, "self", checked=plain.checked, mixers=named, tokens=verdicts[i].tokens)
        elif plain.kind == "refused" and plain.code not in (verdicts[i].code, LAYOUT):
            # plain heads but for another mechanism (a nonlinear value path): that one is what stops a scheme
            verdicts[i] = dataclasses.replace(plain, mixers=named, tokens=verdicts[i].tokens)
    return verdicts
