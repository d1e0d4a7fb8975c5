"""What an attention scheme checks against the model's own forward: before it writes, that every
chosen layer is attention it can set (:func:`check_settable`, from the probe of
:class:`structinit.adapters.survey.ModelSurvey`); after, as :meth:`structinit.Plan.commit`
runs the plan's checks and undoes the write when one fails, that the written layers make the maps
designed (:func:`impulse_check`, :func:`mimetic_check`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from structinit.adapters import TokenLayout
from structinit.adapters.attention import adapter_logits, head_mixers, in_matrix
from structinit.adapters.logit_transforms import POSITION_BIAS, TRANSFORMS, UNCALLED, added_term, order_kept, same_term
from structinit.adapters.observe import observe, real_maps
from structinit.adapters.probe import first_sample
from structinit.adapters.provenance_tokens import call_rows, map_rows
from structinit.adapters.registry import select_layers
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.token_order import PositionUnreached, TokensOffGrid, canonical, maps_on_grid
from structinit.adapters.verify import Verdict, computes_as_read
from structinit.functional.attention import MIN_DIAGONAL_TOKENS, diagonal_strength
from structinit.functional.targets import target_index, target_indices, target_pairs
from structinit.schemes.reservation import position_unkept, reached_maps
from structinit.utils.state import derived_advice, shares_memory

# What to do instead, by what differs (structinit.adapters.verify's codes).
_HINTS = {
    "no-output-projection": "Use impulse with value_init='keep', which sets q and k alone",
    "rotation": "Use 'mimetic', which sets only the projections",
    "qk-norm": "Use 'mimetic', or build the model without the q/k norm for the init",
    "head-mixing": "Build the model without head mixing, or use 'mimetic'",
    **dict.fromkeys(("head-scale", "logit-cap", "key-bias"), "Use 'mimetic', which sets only the projections"),
    "position-bias": "Use 'mimetic', or register an adapter that models the bias (structinit.register_adapter)",
    "self-mask": "Use 'mimetic', or build the model without the masked diagonal for the init",
    "layout": "Register an adapter that reads this layer's q, k, v and output (structinit.register_adapter)",
    "no-map": "Structinit's attention schemes need a softmax(q kᵀ) map; leave these layers to the model's own init",
    "value-path": "Register an adapter that models this layer's output (structinit.register_adapter)",
    "uncalled": "Initialise only the layers the forward uses (layers=)",
    "unlike-calls": "Leave the layer out with layers=, or give each use of it its own module",
}
HIT_SLACK = 0.02  # per head: how far the real hit rate may fall below the written q/k's (ties, float error)
# Per head, with a solver that promises the argmax: the share of grid rows whose argmax the written
# q/k must put on the head's target (and the model's own maps then within HIT_SLACK of them).
# bench/sweep.py calls a write whose own maps fall below it silent: one bar for both.
MIN_HEAD_HIT = 0.95
MIN_DIAGONAL_SHARE = 0.5  # mimetic: the real diagonal strength against the one the adapter wrote
MIN_DESIGNED_DIAGONAL = 1.0  # a head whose written diagonal is weaker (α ≫ β) has no structure to check
GROUPED = "grouped"  # a scheme that accepts it sets grouped-query layers (shared key/value heads)


def check_settable(survey: ModelSurvey, chosen, scheme: str, accept: frozenset[str] = frozenset(),
                   writes: str = "qkvo") -> list[Verdict]:
    """The probe's verdict on every chosen (name, adapter); ValueError naming the first layer
    whose verdict is 'refused' for a reason not in ``accept``, with what differs and what to do,
    or one of whose projections the scheme writes (``writes``, of q, k, v, o) shares its weights
    with another of the layer's (:func:`shared_roles`)."""
    verdicts = [survey.attention.verdict(name) for name, _ in chosen]
    for name, ad in chosen:
        if tied := shared_roles(ad.linear_views(), writes):
            raise ValueError(f"{scheme} cannot set the attention of layer {name!r} ({type(ad.module).__name__}): its "
                             f"{tied[0]} and {tied[1]} projections share their weights (one module or one Parameter "
                             f"serves both), so writing the {tied[0] if tied[0] in writes else tied[1]} projection "
                             "would change the other too and the layer would not compute what was designed; nothing "
                             "was written. Give each projection its own weights, or leave the layer out with layers=")
        rows = in_matrix(ad.linear_views()["q"][0]).shape[0]
        if rows != ad.num_heads * ad.head_dim:  # heads of r = rows // heads channels leave some rows out
            raise ValueError(f"{scheme} cannot set the attention of layer {name!r} ({type(ad.module).__name__}): its "
                             f"q projection has {rows} outputs, which its {ad.num_heads} heads do not split into "
                             f"heads of one width ({ad.head_dim} channels each leave "
                             f"{rows - ad.num_heads * ad.head_dim}); nothing was written. Build the model with a "
                             "width its head count divides")
        if getattr(ad, "grouped", False) and GROUPED not in accept:
            raise ValueError(f"{scheme} cannot set the attention of layer {name!r} ({type(ad.module).__name__}): "
                             f"its {ad.num_heads} query heads share {ad.kv_heads} key/value heads (grouped-query "
                             "attention), so one head's map cannot be set apart from its group's; nothing was "
                             "written. Use 'mimetic', which sets grouped heads")
    for (name, ad), verdict in zip(chosen, verdicts):
        if verdict is not None and verdict.kind == "refused" and verdict.code not in accept:
            raise ValueError(f"{scheme} cannot set the attention of layer {name!r} ({type(ad.module).__name__}): "
                             f"{verdict.reason}; nothing was written. {_HINTS.get(verdict.code, '')}".rstrip())
    return [v for v in verdicts if v is not None]


def shared_roles(views, writes: str) -> tuple[str, str] | None:
    """The first two of a layer's q, k, v, o projections (``views``, role → (weight, bias)) that
    share memory, one of them in ``writes``; None when none do. The slices of one fused weight
    (a qkv Linear, or heads packed together) are apart and pass."""
    roles = [r for r in "qkvo" if r in views]
    for i, a in enumerate(roles):
        for b in roles[i + 1:]:
            if (a in writes or b in writes) and any(
                    shares_memory(x, y) for x in views[a] if x is not None for y in views[b] if y is not None):
                return a, b
    return None


def plain_heads(plan, survey: ModelSurvey, chosen) -> list[str]:
    """Plan the identity into the talking-heads mixers of every chosen layer that the probe
    found plain self-attention once they are (:class:`~structinit.adapters.verify.Verdict`'s
    ``mixers``): each head then keeps its own map, the one the scheme designs. Returns their
    full names, which :func:`finish_plan` records and the caller is warned of."""
    names, layers, mixers = [], 0, []
    for name, ad in chosen:
        verdict = survey.attention.verdict(name)
        if verdict is None or not verdict.mixers:
            continue
        layers += 1
        for sub, tensor, value in head_mixers(ad.module, ad.num_heads):
            if sub in verdict.mixers:
                plan.add([(tensor, value)])
                names.append(f"{name}.{sub}")
                mixer = f"{name}.{sub.removesuffix('.weight').removesuffix('.bias')}"
                mixers += [] if mixer in mixers else [mixer]
    if names:
        shown = ", ".join(mixers[:4]) + (", …" if len(mixers) > 4 else "")
        plan.notes.append(f"set the talking-heads mixers of {layers} layer(s) to the identity ({shown}), so "
                          "that each head keeps its own map; they learn from there")
    return names


def finish_plan(plan, survey: ModelSurvey, scheme: str, chosen, skipped: list[tuple[str, str]]) -> None:
    """What every attention plan ends with: the talking-heads mixers of the chosen layers set
    to the identity (:func:`plain_heads`), and the record on the model of the layers ``scheme``
    wrote, those it left alone and why, and the mixers it set
    (``structinit.get_record(model, 'init')``); the caller warns of the skipped ones and the
    mixers."""
    plan.skipped = list(skipped)
    mixers = plain_heads(plan, survey, chosen)
    plan.records.append((survey.model, "init", {"scheme": scheme, "layers": [n for n, _ in chosen],
                                         "skipped": list(skipped), "head_mixers": mixers}))


def require_probe(survey: ModelSurvey, scheme: str) -> None:
    """Refuse a write that could not be checked in the model's own forward: a ValueError when
    structinit found no input the model's forward takes, naming what it tried and the fix."""
    if survey.attention.probed:
        return
    model = type(survey.model).__name__
    grid = "" if survey.grid is None else f", images of the {survey.grid[0]}×{survey.grid[1]} grid given"
    raise ValueError(
        f"{scheme} cannot check its write in {model}'s own forward: the forward takes none of the inputs structinit "
        f"can build (images of the size the model states or of common sizes{grid}, token ids); nothing was written. "
        "Pass example_inputs= what the forward takes (a tensor, a tuple of positional arguments or a dict of "
        "keyword arguments), or, for a model of images that states no image size, grid=(h, w)")


def layers_to_write(survey: ModelSurvey, layers) -> tuple[list, list[tuple[str, str]]]:
    """The (name, adapter) a scheme writes and the (name, why) it leaves alone. ``layers``
    given: those layers (indices into ``survey.layers()``), and a refusal later for any the
    forward does not call. ``layers=None``: every layer, but the attention-pooling heads and,
    when the forward called others, the layers it never called (a decoder's cross-attention
    with no encoder to attend to): a write there could not be checked in the model's forward."""
    found = survey.layers()
    if layers is not None:
        return select_layers(found, layers), []
    uncalled = {v.name for v in survey.attention.of("refused") if v.code == UNCALLED}
    called = [(name, ad) for name, ad in found if name not in uncalled]
    if not called:  # nothing the forward runs: the refusal names the first
        return found, survey.attention.skipped()
    unchecked = [(name, f"{type(ad.module).__name__}: not called in the model's forward, so a write could not be "
                        "checked; initialise it with layers= once the forward uses it") for name, ad in found
                 if name in uncalled]
    return called, survey.attention.skipped() + unchecked


def require_judged(survey: ModelSurvey, chosen, scheme: str) -> None:
    """Refuse, before any write, a chosen layer the probe ran through but could not compare with
    its adapter (no tokens of its maps to read, or NaN/inf in its input): the check after the
    write could not compare it either."""
    for name, ad in chosen:
        verdict = survey.attention.verdict(name)
        if verdict is not None and not verdict.checked and survey.attention.probed:
            raise ValueError(
                f"{scheme} cannot check its write to layer {name!r} ({type(ad.module).__name__}): the probe ran "
                "through it, but the tokens its maps are made of are neither the ones it receives nor the ones "
                "its q projection receives (or its input holds NaN/inf), so its own maps cannot be compared with "
                "the q kᵀ written; nothing was written. Register an adapter whose input_tokens returns those "
                "tokens, or leave the layer out with layers=")


def impulse_check(survey: ModelSurvey, chosen, offsets: list[list[tuple[int, int]]],
                  layouts: list[TokenLayout], pos_embed: torch.Tensor | None = None,
                  exact: bool = False, reserved: bool = True, held: tuple = (frozenset(), False)) -> Callable[[], None]:
    """The check after an impulse write (module doc): a probe runs through the model with the
    tokens each chosen layer receives replaced by what the impulse is designed for (the grid
    rows by LayerNorm(PE), of ``pos_embed`` when given, or zeros for a layer with a relative position bias;
    :func:`~structinit.schemes.reservation.reached_maps`), and each head's own softmax
    map must put its argmax on its target as often as the written q/k say it does (within
    :data:`HIT_SLACK`); with ``exact`` (a solver that promises the argmax), the written q/k must
    also put it there (:data:`MIN_HEAD_HIT`), and in each layer of ``held`` (layers, strict) on the
    probe image's own tokens (:func:`~structinit.schemes.reservation.position_unkept`). A ValueError
    when the model cannot be probed (:func:`require_probe`)."""
    require_probe(survey, "impulse")

    def check() -> None:
        try:
            maps, calls, order = reached_maps(survey, chosen, layouts, pos_embed)
        except PositionUnreached as err:  # the first chosen layer's tokens do not depend on the embedding
            raise ValueError(f"impulse: attention layer {chosen[0][0]!r}: {err}, so impulse "
                             "cannot shape its maps; the write was undone. Initialise only the layers the position "
                             "embedding reaches (layers=), or use 'mimetic', which needs no position") from None
        except TokensOffGrid as err:  # the layout's grid is not where the model's image puts the tokens
            raise ValueError(f"impulse: the write was undone: {err}") from None
        hits = [(n, _check_hits(n, ad, real, calls[ad.module], lay, offs, order, exact, reserved, n in held[0]))
                for (n, ad), real, lay, offs in zip(chosen, maps, layouts, offsets)]
        position_unkept([(n, *hit) for n, hit in hits if hit is not None and hit[0] < MIN_HEAD_HIT], *held[1:])
    return check


def _hit_rates(probs: torch.Tensor, open_pairs, layout: TokenLayout, offsets) -> list[float]:
    """Per head, the share of grid rows (open in the call) whose argmax is the head's target,
    for maps (B, H, T, T): over every key, as :func:`structinit.impulse_fidelity` counts it (a
    class token that takes a row's argmax leaves that row without its convolution)."""
    heads, n = len(offsets), layout.num_patches
    prefix = probs.shape[-1] - n
    target = target_indices(layout.grid, offsets).to(probs.device)  # (heads, N), −1 off the grid
    hits = probs[:, :heads, prefix:].argmax(-1) == target + prefix  # (B, heads, N)
    counted = (target >= 0).expand(hits.shape)
    if open_pairs is not None:  # a pair the call masks is no target (its mask may be one for all heads)
        shared = open_pairs[:, [min(h, open_pairs.shape[1] - 1) for h in range(heads)], prefix:]
        at_target = target.clamp_min(0)[None, :, :, None] + prefix
        counted = counted & shared.gather(-1, at_target.expand(shared.shape[0], -1, -1, 1)).squeeze(-1)
    total = counted.sum(dim=(0, 2))
    rates = (hits & counted).sum(dim=(0, 2)).double() / total.clamp_min(1)
    return [float(r) if t else 1.0 for r, t in zip(rates, total)]


def _check_hits(name: str, ad, real, call, layout: TokenLayout, offsets, order: torch.Tensor | None = None,
                exact: bool = False, reserved: bool = True, images: bool = False) -> tuple[float, float] | None:
    """The real maps of one layer on its design input hit each head's target as often as the
    adapter's maps of the same tokens say they should; with ``exact`` (a solver that promises
    the argmax), those, put in grid order (``order``, None when the model keeps it), must also
    put it there in at least :data:`MIN_HEAD_HIT` of the rows: a head whose offset the solver
    cannot realise from the model's position input is not a silent success. Returns, with ``images``, the smallest
    head's hit rate of the written q/k on the probe image's tokens (before the swap), and their maps' peak."""
    x, on_images = call_rows(call, real.probs.shape[-1], real.probs.shape[0]), None
    probs, open_pairs = maps_on_grid(real.probs, real.open_pairs, layout)  # windows: their tokens by grid position
    order = None if layout.windows is not None else order
    if probs.shape[-1] < layout.num_patches:
        raise ValueError(f"impulse: layer {name!r} attends over {probs.shape[-1]} tokens, fewer than its "
                         f"{layout.grid[0]}×{layout.grid[1]} grid; the write was undone")
    got = _hit_rates(probs, open_pairs, layout, offsets)
    if x is not None:
        with torch.no_grad():
            ours = ad.attention_probs(x.float(), ad.call_terms(call.args, call.kwargs, x))
        ours = maps_on_grid(ours, None, layout)[0]
        want = _hit_rates(ours, open_pairs, layout, offsets)
        reordered = order is not None and tuple(order.shape) == (ours.shape[0], ours.shape[-1])
        in_grid = canonical(ours, order) if reordered else ours
        # the pairs the call masks (Swin's shifted windows, segments) are no target, put in grid order as the maps are
        closed = canonical(open_pairs.expand(ours.shape).float(), order) > 0.5 if reordered and open_pairs is not None \
            else open_pairs
        designed_rates = _hit_rates(in_grid, closed, layout, offsets) if exact else []
        source = map_rows(call.source, x.shape[-2], x.shape[0]) if images and call.source is not None else None
        if source is not None:
            with torch.no_grad():
                mine = ad.attention_probs(source.float(), ad.call_terms(call.args, call.kwargs, source))
            mine = maps_on_grid(mine, None, layout)[0]
            on_images = (min(_hit_rates(canonical(mine, order) if reordered else mine, closed, layout, offsets)),
                         float(mine.amax(-1).mean()) * mine.shape[-1])  # × uniform: 1 where flat
    else:  # a layer that cuts its own windows: the design is a clean hit
        want = designed_rates = [1.0] * len(offsets)
    missed = [h for h, designed in enumerate(designed_rates) if designed < MIN_HEAD_HIT]
    if missed:
        h = missed[0]
        off_grid = ("a padding token of its window (zero, so its logit is the key bias's)" if layout.windows is not None
                    else "a prefix token (a class or register token)")
        why = (f"in most rows it missed, {off_grid} took the argmax: the written q/k give it a logit above the "
               "target's (" + ("keep the default reserve and pe_scale, which keep it below" if reserved else
                               "no reservation, which keeps it below, was applied: reserve='residual' or 'patch' "
                               "where the model allows it, a warning says why 'auto' could not") + "; or use 'mimetic')"
               if _prefix_share(in_grid, layout, offsets[h], h) > 0.5 else
               "the layer cannot attend those targets from its position input (it masks them, or its position input "
               "cannot tell them apart); pass offsets= targets it can attend, or use 'mimetic'")
        raise ValueError(
            f"impulse: the q/k written to layer {name!r} ({type(ad.module).__name__}) put head {h}'s argmax on its "
            f"target offset {tuple(offsets[h])} in only {designed_rates[h]:.0%} of the grid rows of the position-only "
            f"input (heads missing theirs: {', '.join(map(str, missed))}); the write was undone. {why[0].upper()}"
            f"{why[1:]}")
    for h, (rate, designed) in enumerate(zip(got, want)):
        if rate < designed - HIT_SLACK:
            raise ValueError(
                f"impulse: after the write, head {h} of layer {name!r} ({type(ad.module).__name__}) puts its argmax "
                f"on its target offset {tuple(offsets[h])} in {rate:.0%} of the grid rows of its own forward on the "
                f"position-only input, where the written q/k give {designed:.0%}; the write was undone. "
                + (derived_advice(ad.module) or "The layer computes its attention in a way the adapter does not "
                   "model; register an adapter for it (structinit.register_adapter) or use 'mimetic'"))
    return on_images


def _prefix_share(probs: torch.Tensor, layout: TokenLayout, offset, h: int) -> float:
    """Of head ``h``'s grid rows whose target exists and whose argmax misses it, the share whose
    argmax is a prefix token (maps (B, H, T, T), the prefix tokens first)."""
    prefix = probs.shape[-1] - layout.num_patches
    rows, cols = target_pairs(target_index(layout.grid, offset).to(probs.device), prefix)
    arg = probs[:, h, rows].argmax(-1)
    miss = arg != cols
    return float((arg[miss] < prefix).double().mean()) if bool(miss.any()) else 0.0


def mimetic_check(survey: ModelSurvey, chosen) -> Callable[[], None]:
    """The check after a mimetic write, on a probe through the model: a layer whose maps were those of
    the q kᵀ read must make those of the q kᵀ written (a weight made from the parameters written fails).
    One that transforms its logits (a temperature, a soft-cap) must show in its own logits at least
    :data:`MIN_DIAGONAL_SHARE` of the written diagonal strength in every head where that is at least
    :data:`MIN_DESIGNED_DIAGONAL`, or with none the maps written. ValueError if it cannot be probed."""
    require_probe(survey, "mimetic")
    model, inputs = survey.model, first_sample(survey.probe)

    def check() -> None:
        calls, _ = observe(model, inputs, [(ad.module, ad.input_module, ad) for _, ad in chosen])
        for (name, ad), real in zip(chosen, real_maps(model, inputs, chosen, calls)):
            x = call_rows(calls[ad.module], real.probs.shape[-1], real.probs.shape[0])
            if x is None:  # judged on these tokens before the write (require_judged): one that changed is not passed
                raise ValueError(f"mimetic: after the write, layer {name!r} ({type(ad.module).__name__}) no longer "
                                 "shows maps of the tokens it was judged on; the write was undone")
            terms = ad.call_terms(calls[ad.module].args, calls[ad.module].kwargs, x)
            verdict = survey.attention.verdict(name)
            # Plain before the write, a masked diagonal, or too few tokens for one: the maps of the q kᵀ written; but a
            # transform mimetic accepts that small logits hid before (Gemma-2's soft-cap) is judged by the diagonal.
            plain = verdict is not None and verdict.kind == "self" and verdict.checked
            measurable = not ad.masks_self and real.probs.shape[-1] >= MIN_DIAGONAL_TOKENS
            # A position bias of its own: the maps are those of the q kᵀ written plus the term it added before
            biased = verdict is not None and verdict.code == POSITION_BIAS and _kept_term(name, ad, real, x, terms)
            if not biased and (plain or not measurable) and _check_same_maps(name, ad, real, x, terms,
                                                                              plain and measurable):
                continue
            wrote, got = diagonals(ad, real, x, terms) if measurable else (torch.zeros(0), None)
            if not bool((wrote >= MIN_DESIGNED_DIAGONAL).any()):  # no head's diagonal to measure: the maps then
                if not biased:                                      # must be those of the q kᵀ written
                    _check_same_maps(name, ad, real, x, terms)
                continue
            weak = [h for h in range(len(wrote)) if wrote[h] >= MIN_DESIGNED_DIAGONAL
                    and not got[h] >= MIN_DIAGONAL_SHARE * wrote[h]]  # NaN is no diagonal: it fails
            if weak:
                h = weak[0]
                raise ValueError(
                    f"mimetic: after the write, head {h} of layer {name!r} ({type(ad.module).__name__}) shows a "
                    f"diagonal of strength {float(got[h]):.2f} in the model's own attention logits, against "
                    f"{float(wrote[h]):.2f} in the q kᵀ written; the write was undone: "
                    f"{verdict.reason if verdict is not None and verdict.reason else 'it mixes or transforms q kᵀ'}"
                    ", which hides the structure (register an adapter that models it)")
    return check


@torch.no_grad()
def diagonals(ad, real, x: torch.Tensor, terms) -> tuple[torch.Tensor, torch.Tensor]:
    """(written, own): per head, the :func:`diagonal_strength` of the q kᵀ the adapter reads on
    the tokens ``x`` of one layer's recorded call, and of the layer's own maps ``real`` on them.
    Like with like: logits against the softmax's own input where that was seen, else the log of
    both maps (a mixture, as ConViT's, has no logits); pairs the call masks are left out of both."""
    if real.logits is not None:
        written, own = adapter_logits(ad, x.float(), terms), real.logits
    else:
        written = ad.attention_probs(x.float(), terms).clamp_min(1e-30).log()
        own = real.probs.clamp_min(1e-30).log()
    pairs = real.open_pairs  # the pairs the call masks (a mask built inside, whose −100 is no logit) at −∞
    close = lambda t: t if pairs is None or pairs.shape[0] != t.shape[0] else t.masked_fill(~pairs, float("-inf"))
    return diagonal_strength(close(written.float())), diagonal_strength(close(own.float()))


@torch.no_grad()
def _kept_term(name: str, ad, real, x: torch.Tensor, terms) -> bool:
    """True when the layer adds to the q kᵀ written the term it added to the q kᵀ read before the
    write (a position bias that does not depend on content: :attr:`AttentionAdapter.added_term`);
    False when none was kept; else ValueError (the term depends on the parameters written)."""
    if ad.added_term is None:
        return False
    if same_term(ad.added_term, added_term(ad, real, x, terms)):
        return True
    raise ValueError(
        f"mimetic: after the write, layer {name!r} ({type(ad.module).__name__}) adds to the q kᵀ written another "
        "logit term than the one it added to the q kᵀ read before (a position bias that depends on the parameters "
        "written); the write was undone (register an adapter that models the term)")


@torch.no_grad()
def _check_same_maps(name: str, ad, real, x: torch.Tensor, terms, transformed: bool = False) -> bool:
    """True when the model computes the maps of the q kᵀ written (:func:`computes_as_read`); with
    ``transformed``, False when each head's logits are an order-keeping function of those; else ValueError."""
    ours = ad.attention_probs(x.float(), terms)
    if real.probs.numel() == ours.numel() and computes_as_read(
            ad, real.probs.reshape(ours.shape).float(), ours, [real], x, terms, x.dtype):
        return True
    raw = adapter_logits(ad, x.float(), terms) if transformed and real.logits is not None else None
    if raw is not None and real.logits.numel() == raw.numel() and all(  # each head's logits, order kept
            order_kept(raw[:, h], real.logits.reshape(raw.shape)[:, h].float()) for h in range(raw.shape[1])):
        return False
    raise ValueError(
        f"mimetic: after the write, the attention maps of layer {name!r} ({type(ad.module).__name__}) are not "
        "those of the q kᵀ written; the write was undone. " + (derived_advice(ad.module) or "The layer computes its "
        "attention in a way the adapter does not model (register an adapter that models it)"))


__all__ = ["GROUPED", "TRANSFORMS", "check_settable", "diagonal_strength", "impulse_check", "mimetic_check",
           "layers_to_write", "require_judged"]
