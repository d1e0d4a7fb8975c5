"""Attention found by what it computes: each softmax map followed back to the parameter entries
that make its queries, keys and values, and forward to the projection that reads its output,
whatever the module is called and however it lays out its weights.

The module runs once on the arguments the model's probe handed it, with gradients, under a
:class:`~torch.overrides.TorchFunctionMode` that records every torch call. From the attention
map (a softmax over the last axis of a …×T×T tensor, or ``scaled_dot_product_attention``) the
record gives the operands of the product that made its logits (q and kᵀ) and of the product
that applies it (v). Labelled probing then says which entries feed which head and channel:

- a cotangent on one head's slice of q that is 1 on every channel, and one that is c + 1 on
  channel c: on every parameter entry that feeds that head linearly, the ratio of the two
  gradients is its channel plus one. A Linear, a Linear subclass, ``F.linear`` on a raw
  Parameter, ``einsum`` or ``@`` on a (3, heads, r, D) weight and a 1×1 convolution all read
  alike: the entries say where they are, not the names;
- the output side is read the same way, with the context the map produced replaced by labelled
  constants in a second run.

The run is on a float64 copy of the module (an exact ratio where a channel's tokens nearly
cancel). Rotary positions are read at position 0, where the rotation is the identity; q and k
behind a norm by where their entries are (:mod:`structinit.adapters.provenance_blocks`); key and
value heads shared by several query heads as grouped-query attention; which input position each
token of the map reads, through any reshape or window cut, by the same labelling on the module's
input (:mod:`structinit.adapters.provenance_tokens`).

Entries that do not form one evenly strided (heads·r, D) block per role, values or outputs that
pass more than a projection, or tokens that are not one input position each make no adapter: the
layer stays "attention that no adapter understands", with the reason. What is found becomes a
:class:`TracedAdapter` over strided views of the module's own parameters, which the survey
(:mod:`structinit.adapters.verify`) checks against the model's own maps.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from structinit.adapters.provenance_blocks import (
    PastAProjection,
    assemble,
    causal_map,
    decode,
    double_twin,
    find_head,
    grads_of,
    head_leads,
    heads_of,
    in_double,
    isolating,
    lead_cotangent,
    lines_in_storage_order,
    masked_pairs,
    no_map_reason,
    one_map_a_head,
)
from structinit.adapters.provenance_output import output_bent, output_block, output_unread, unreadable, values_unread
from structinit.adapters.provenance_record import (
    HandedQueries,
    Operand,
    TraceError,
    first_tensor,
    map_operands,
    record,
    restored,
)
from structinit.adapters.provenance_tokens import TokenError, inner_tokens, leaf_at, token_map, tokens_of_call
from structinit.adapters.traced import CallTokens, TracedAdapter
from structinit.utils.state import derived_weights


def trace_attention(module: nn.Module, args: tuple, kwargs: dict) -> TracedAdapter:
    """A :class:`TracedAdapter` for ``module`` from one call on ``args``/``kwargs`` (module doc);
    the module, its parameters, buffers and cached attributes are restored bit for bit after.
    A module that normalises its input inside (vit-pytorch's pre-norm) is read from the normalised
    tokens, where its projections read them (:func:`inner_tokens`); TraceError if it cannot be read."""
    try:
        return _trace_from(module, args, kwargs, ())
    except (TraceError, TokenError) as err:
        closest, by_place = err, []
        # tokens read elsewhere than the input (a slice of it, or a pooled copy) only when they were what failed
        for readers in inner_tokens(module, args, kwargs, any_shape=isinstance(err, TokenError)):
            try:
                return _trace_from(module, args, kwargs, readers)
            except (TraceError, TokenError) as again:  # the reason of the place the reading got furthest in;
                # or as far as the input's, stopped at its norm's weight (which this reading passes by)
                past_norm = closest is err and isinstance(err, PastAProjection) and again.depth == err.depth
                closest = again if again.depth > closest.depth or past_norm else closest
                by_place += [readers] * getattr(again, "values_by_place", False)
        for readers in by_place + [()] * getattr(err, "values_by_place", False):  # last, as it costs most: values
            try:  # behind a norm or a gate, read by place (at the inner tokens first)
                return _trace_from(module, args, kwargs, readers, values_by_place=True)
            except (TraceError, TokenError) as again:
                closest = again if again.depth > closest.depth else closest
        why = unreadable(module, args, kwargs)  # a weight remade each forward, or a random map, explains any failure
        raise (TraceError(why) if why else closest) from None


def _trace_from(module: nn.Module, args: tuple, kwargs: dict, readers: tuple[str, ...],
                values_by_place: bool = False) -> TracedAdapter:
    """:func:`trace_attention` with the tokens taken at the first input of the submodules named
    ``readers`` (all of the module's input when empty); the values read by place too when
    ``values_by_place`` (:func:`_read_role`)."""
    params = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
    if not params:
        raise TraceError("it holds no floating-point parameters: its q, k and v come from elsewhere")
    originals = dict(params)
    twin = double_twin(module, originals)
    if twin is not None:  # float64: a channel whose tokens nearly cancel still gives an exact ratio
        try:
            twin_params = [(n, p.requires_grad_(True)) for n, p in twin.named_parameters() if n in originals]
            # the twin is structinit's own float64 copy: what torch says of its dtypes is not the model's to hear
            with warnings.catch_warnings(), \
                    leaf_at(twin, readers, *_with_leaf(in_double(args), in_double(kwargs))) as (a, k, leaf):
                warnings.simplefilter("ignore")
                return _trace(twin, a, k, leaf, twin_params, module, originals, args, kwargs, readers, values_by_place)
        except (TraceError, TokenError):
            raise
        except Exception:  # a module that will not run in float64: trace it as it is
            pass
    with restored(module, [p for _, p in params]), leaf_at(module, readers, *_with_leaf(args, kwargs)) as found:
        return _trace(module, *found, params, module, originals, args, kwargs, readers, values_by_place)


def _with_leaf(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor]:
    """``args``/``kwargs`` with the tokens (their first tensor) replaced by a copy that gradients
    reach, to trace which input position each token of the map reads; and that copy."""
    x = first_tensor(args, kwargs)
    leaf = x.detach().clone().requires_grad_(x.is_floating_point())
    swap = lambda v: leaf if v is x else v
    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}, leaf


def _trace(module, args, kwargs, leaf, params, owner, originals, owner_args, owner_kwargs,
           readers: tuple[str, ...] = (), values_by_place: bool = False) -> TracedAdapter:
    """Trace ``module`` (``owner`` itself, or its float64 twin) on ``args``/``kwargs`` (whose
    tokens are ``leaf``); the views are built on ``owner``'s own parameters (``originals``, by
    name), its tokens read from ``owner_args``/``owner_kwargs`` (at the ``readers``' input, when
    named)."""
    rec = record(module, args, kwargs)
    ops = rec.ops
    found = map_operands(rec)
    if found is None:
        raise TraceError(no_map_reason(rec), depth=0 if readers else 3)  # read at the map's own input: too late
    q, k, product, sdpa_scale, v = found
    owned = [role for role, op in (("q", q), ("k", k), ("v", v)) if not op.tensor.requires_grad]
    if owned:  # made outside the module and handed to it (GCViT's global query): no projection of its own
        error = HandedQueries if "q" in owned else TraceError
        raise error(f"its {' and '.join(owned)} {'does' if len(owned) == 1 else 'do'} not come from its own "
                    "parameters (handed to it, as a global query is), and structinit writes the projections a "
                    "layer owns")
    if leaf.requires_grad and torch.autograd.grad(q.tensor, leaf, torch.ones_like(q.tensor), retain_graph=True,
                                                  allow_unused=True)[0] is None:
        raise TokenError("its q is not computed from the tokens it is called with", depth=0)  # before the costly reads
    r, rv = q.channels, v.channels  # values may be wider than queries and keys (LeViT): only q kᵀ needs one r
    if k.channels != r:
        raise TraceError(f"its q and k have {r} and {k.channels} channels a head; a head's q kᵀ needs them equal")
    heads, group = heads_of(q, params)
    dim = _input_width(q, params)
    tokens_of = token_map(q, leaf, dim, heads)
    inputs = tuple(owner.get_submodule(n) for n in readers)
    adapter = TracedAdapter(owner, {}, heads, r, 1.0, tokens_of, inputs=inputs)
    tokens = tokens_of_call(adapter, owner_args, owner_kwargs)
    views, names, shifts = {}, {}, {}
    per_head = _read_role("q", q, params, head_leads(q, heads), dim)
    views["q"], names["q"], shifts["q"] = assemble("q", per_head, params, originals, heads, r, dim, "in")
    kv_of, v.place_allowed = None, values_by_place
    for role, operand in (("k", k), ("v", v)):
        shared, per_kv = _shared_heads(role, operand, params, heads, dim)
        if kv_of is not None and shared != kv_of:
            n_k, n_v = len(set(kv_of)), len(set(shared))
            raise TraceError(f"its keys and values serve its {heads} query heads in different groups ({n_k} key "
                             f"head{'s' * (n_k > 1)}, {n_v} value head{'s' * (n_v > 1)}): no grouped-query layout")
        kv_of = shared
        views[role], names[role], shifts[role] = assemble(role, per_kv, params, originals, len(per_kv),
                                                          operand.channels, dim, "in")
    one_map_a_head(rec, heads)  # after q, k and v are read: a reason found there (q convolved) says more
    made, token_axis = ops[v.product_index][3], v.context_axes[0]
    slices = made.numel() // (made.shape[token_axis] * rv * heads)
    by_place = getattr(v, "by_place", False)  # then also a gate from any other parameter of the module
    gated = values_unread(v, dict(params)[names["v"]], [p for n, p in params if by_place and n not in names.values()])
    if by_place and gated is None:
        raise TraceError("its values pass more than a projection, and the trace cannot name what")
    try:
        views["o"], names["o"] = output_block(module, args, kwargs, ops, v, params, originals, heads, group, rv, dim)
        reach = slices * views["o"][0].shape[0]  # a token's output entries, in every slice
        unread = gated or output_bent(module, args, kwargs, v.product_index, made, token_axis, reach)
    except TraceError:  # an output path no projection is: named where it is a mechanism (q, k and v still read)
        values = (dict(params)[names["v"]], views["v"][0])
        unread = gated or output_unread(module, args, kwargs, v.product_index, made, token_axis, slices * dim, values)
        if unread is None:
            raise
    adapter = TracedAdapter(owner, views, heads, r, 1.0, tokens_of, names, kv_of, inputs, value_dim=rv,
                            more_biases={role: b for role, b in shifts.items() if b and role in views})
    adapter.output_unread = unread
    if q.head is not None:  # the logits as the adapter's, heads after the other lead axes
        product = (product[0].movedim(q.head, -3), product[1])
    try:
        adapter.scale = _scale(adapter, tokens.detach(), product, sdpa_scale)
    except TraceError:
        if not (getattr(q, "by_place", False) or getattr(k, "by_place", False)):
            raise
        # normalised q and k: no factor to fit on the projections' q kᵀ; the one the module applies
        adapter.scale = product[1] if sdpa_scale is None else sdpa_scale
    adapter.is_causal = causal_map(rec, q)
    adapter.masked = masked_pairs(rec, q)
    if adapter.masked is not None and _only_the_diagonal(adapter.masked):  # LSA: a token never attends to itself
        adapter.masks_self, adapter.masked = True, None
    if getattr(q, "by_place", False) and getattr(k, "by_place", False) and _normalised(q):
        adapter.qk_transform = ("qk-norm", "q and k are normalised after their projections (the trace found a "
                                "norm between them and the product)")
    return adapter


def _only_the_diagonal(closed: torch.Tensor) -> bool:
    """Whether the pairs a call closed, (slices, T, T), are each token with itself and no other."""
    eye = torch.eye(closed.shape[-1], dtype=torch.bool, device=closed.device)
    return bool((closed == eye).all())


def _input_width(q: Operand, params) -> int:
    """The width D of the tokens q is projected from: the largest block of entries feeding one
    head of q is its r lines of D input weights; through a norm over every head's channels, the
    block an isolating cotangent reaches (:func:`_entries_feeding`)."""
    lead = (0,) * len(q.lead_shape)
    for isolate in (True, False):
        largest = max(int(g.sum()) for g in _entries_feeding(q, lead, params, isolate))
        if largest and not largest % q.channels:
            return largest // q.channels
    raise TraceError("no parameter of the module projects its tokens to q", depth=0)  # tokens read past it


def _entries_feeding(op: Operand, lead, params, isolate: bool) -> list[torch.Tensor]:
    """Per parameter, where a random cotangent on slice ``lead`` of ``op`` reaches, on any of its
    first :data:`_TOKENS_READ` tokens (random: a norm's output sums to a constant, which an
    all-ones cotangent would not pass; several tokens: a class token of zeros reaches nothing).
    With ``isolate``, a cotangent that passes no norm over other heads' channels
    (:func:`isolating`), and the entries it reaches above the rounding of that norm (computed in
    float32 by many models): an entry of the head's own lines is small on one token only where
    that token's input is, which the others' are not."""
    weights = 1 + torch.rand(op.tensor.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fed = None
    for token in range(min(_TOKENS_READ, op.moved_shape[-2])):
        cot = lead_cotangent(op, lead, False, token) * weights.to(op.tensor)
        grads = grads_of(op.tensor, isolating(op, cot) if isolate else cot, params)
        found = [g.abs() > 1e-6 * float(g.abs().max()) if isolate else g != 0 for g in grads]
        fed = found if fed is None else [a | b for a, b in zip(fed, found)]
    return fed


_TOKENS_READ = 3  # tokens whose cotangents say which parameter entries feed a head


def _normalised(op: Operand) -> bool:
    """Whether every token's q of every head has the same length, as after a norm without weights."""
    moved = op.tensor.detach().movedim((op.token, op.channel), (-2, -1)).double()
    norms = moved.norm(dim=-1)
    return bool(norms.std() <= 1e-3 * norms.mean())


# -- the input projections --------------------------------------------------------------------------

def _labelled(op: Operand, lead, params, token: int | None = None, role: str = "q") -> list[dict[int, torch.Tensor]]:
    """For each parameter, channel → the multi-indices of its entries feeding slice ``lead`` of
    ``op`` linearly (module doc), read on every token or on ``token`` alone; TraceError naming
    an entry fed otherwise."""
    ones = grads_of(op.tensor, lead_cotangent(op, lead, False, token), params)
    labels = grads_of(op.tensor, lead_cotangent(op, lead, True, token), params)
    found = [decode(name, g1, gl, op.channels) for (name, _), g1, gl in zip(params, ones, labels)]
    found = [{} if _scales_channels(e, g1) else e for e, g1 in zip(found, ones)]
    if not any(found):  # a norm's output sums to a constant: no gradient of the summed channels reaches it
        noun = {"q": "queries", "k": "keys", "v": "values"}[role]
        if not any(g is not None and bool(g.any()) for g in ones):
            raise TraceError(f"no parameter feeds its {noun}: they are made from its tokens with no projection of "
                             "their own to set")
        raise TraceError(f"no parameter feeds its {noun} through a projection alone")
    return found


def _scales_channels(entries: dict[int, torch.Tensor], ones: torch.Tensor) -> bool:
    """Whether a parameter feeding one entry per channel scales the channels rather than shifts
    them (the weight of an eval-mode BatchNorm after the projection, LeViT's): a bias's gradient
    under an all-ones cotangent is the token count on every channel, a scale's is the channel's
    sum over the tokens. Left out of the views: the q kᵀ fit then holds only where the scale is
    one number, which it absorbs, and refuses the layer otherwise."""
    if not entries or any(len(ix) != 1 for ix in entries.values()):
        return False
    got = torch.stack([ones[tuple(ix[0].tolist())] for ix in entries.values()]).double()
    return bool((got - got[0]).abs().max() > 1e-6 * got.abs().max())


def _read_role(role: str, op: Operand, params, leads, dim: int) -> list[list[dict]]:
    """Each lead's labelled entries (:func:`_labelled`); q and k read on every token, else on the
    first alone: rotary positions mix each head's channels in pairs by an angle that is zero at
    position 0. Else, q, k and v behind a norm, by where their entries are (:func:`_by_place`)."""
    try:
        return [_labelled(op, lead, params, role=role) for lead in leads]
    except TraceError as err:
        if role == "v" and not getattr(op, "place_allowed", False):
            err.values_by_place = True  # the caller may read them by place, last
            raise
        try:
            if role == "v":  # values are not rotated: read by place, to name the norm or activation after them
                raise
            return [_labelled(op, lead, params, token=0, role=role) for lead in leads]
        except TraceError:  # a norm between the projection and the product: the entries by where they are
            found = [_by_place(op, lead, params, dim) for lead in leads]
            if not all(any(e) for e in found):
                raise err from None
            op.by_place = True
            return found


def _by_place(op: Operand, lead, params, dim: int) -> list[dict[int, torch.Tensor]]:
    """Each parameter's entries feeding slice ``lead`` of ``op``, as channel → line in storage
    order where they form whole lines of input weights (:mod:`structinit.adapters.provenance_lines`);
    the other parameters (the norm's own weight) are not the projection's and stay unread. Read
    exactly first, and through a norm over every head's channels by an isolating cotangent."""
    for isolate in (False, True):
        found = [lines_in_storage_order(torch.nonzero(fed), p.stride(), dim, op.channels) or {}
                 for (_, p), fed in zip(params, _entries_feeding(op, lead, params, isolate))]
        if any(found):
            return found
    return found


def _signature(entries: list[dict]) -> tuple:
    return tuple((i, c, tuple(ix[0].tolist())) for i, e in enumerate(entries) for c, ix in sorted(e.items()))


def _shared_heads(role: str, op: Operand, params, heads: int, dim: int) -> tuple[tuple[int, ...], list[list[dict]]]:
    """(kv_of, each key/value head's labelled entries) of a k or v operand: one per query head,
    or fewer shared by several (grouped-query attention), either as a product over fewer heads
    (``scaled_dot_product_attention(enable_gqa=True)``: head h reads h // (heads / n)) or as
    the same entries repeated across the query heads."""
    if len(op.lead_shape) >= 2:
        find_head(op, params)
    leads = op.lead_shape
    if len(leads) >= 2 and leads[-1] != heads:
        n = leads[-1]
        if heads % n:
            raise TraceError(f"its {heads} query heads do not share {n} key/value heads evenly")
        return tuple(h // (heads // n) for h in range(heads)), _read_role(role, op, params, head_leads(op, n), dim)
    per_lead = _read_role(role, op, params, head_leads(op, heads), dim)
    keys = [_signature(e) for e in per_lead]
    order = list(dict.fromkeys(keys))
    return tuple(order.index(key) for key in keys), [per_lead[keys.index(key)] for key in order]


# -- the softmax scale ---------------------------------------------------------------------------------

def _scale(adapter: TracedAdapter, tokens: torch.Tensor, product, sdpa_scale) -> float:
    """The factor between the adapter's q kᵀ and the logits the module forms: the least-squares
    factor between its product's output and ours, times the scalars applied after the product
    (or the scaled-dot-product call's scale)."""
    with torch.no_grad():
        q, k = adapter.qk_features(tokens.float())
        ours = (q @ k.transpose(-2, -1)).double()
        made, after = product
        made = made.detach().double()
        if made.numel() != ours.numel():
            raise TraceError(f"its logits have {made.numel()} entries, the projections' q kᵀ {ours.numel()}")
        made = made.reshape(ours.shape)
        factor, residual = _fit(made, ours)
        if residual > 1e-3:  # q and k rotated by position (RoPE): q_i·k_i, the diagonal, is what it was
            eye = torch.eye(ours.shape[-1], dtype=torch.bool, device=ours.device)
            factor, residual = _fit(made[..., eye], ours[..., eye])
    if not math.isfinite(factor) or residual > 1e-3:
        made = derived_weights(adapter.module)
        raise TraceError("its q kᵀ is not that of the projections the trace found (" + (f"it computes weights from "
            f"other parameters in its forward: {made}" if made else "tokens reordered or transformed between them, or "
            "a norm after a projection whose running statistics shift and scale its channels") + ")")
    return factor * (after if sdpa_scale is None else sdpa_scale)


def _fit(made: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """The least-squares factor of ``made`` on ``ours``, and the relative residual, whatever
    their scale (BLIP's towers are built with weights of 1e-10: logits of 1e-17, whose squares
    an absolute floor would swamp)."""
    top_made, top_ours = float(made.abs().max()), float(ours.abs().max())
    if not (top_made > 0 and top_ours > 0 and math.isfinite(top_made) and math.isfinite(top_ours)):
        return (0.0, 0.0) if top_made == 0 else (float("nan"), float("inf"))
    made, ours = made / top_made, ours / top_ours
    factor = float((made * ours).sum() / (ours * ours).sum())
    residual = float((made - factor * ours).norm() / made.norm())
    return factor * top_made / top_ours, residual


def describe(adapter: TracedAdapter) -> str:
    """One line naming where each role's weight was found, for messages and reports."""
    names = adapter.param_names
    return ", ".join(f"{role}: {names[role]}" for role in ("q", "k", "v", "o") if role in names)


__all__ = ["CallTokens", "TraceError", "TracedAdapter", "describe", "trace_attention"]
