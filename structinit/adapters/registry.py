"""Which adapter understands which attention module, finding every attention layer of a
model, and the relative position bias each one uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from structinit.adapters.attention import AttentionAdapter, FusedQKVAdapter, MultiheadAttentionAdapter
from structinit.adapters.fused import FusedLinearAdapter
from structinit.adapters.gated import GatedPositionalAdapter
from structinit.adapters.position_mlp import PositionMlpBias, held_position_mlp
from structinit.adapters.probe import probe_inputs
from structinit.adapters.relative import RelativeBias, find_relative_bias, holds_relative_bias
from structinit.adapters.separate import SeparateQKVAdapter, sibling_output
from structinit.adapters.verify import AttentionSurvey, survey_attention
from structinit.utils import Registry, is_int


@dataclass(frozen=True)
class AdapterEntry:
    """``match(module)`` says whether ``factory(module)`` can build an adapter for it."""

    match: Callable[[nn.Module], bool]
    factory: Callable[[nn.Module], AttentionAdapter]


ATTENTION_ADAPTERS: Registry[AdapterEntry] = Registry("attention adapter")
# Built-ins, in the order they are tried after any user adapter.
# Names are the fast path; FusedLinearAdapter recognises the rest by shapes and a traced forward.
for _cls in (MultiheadAttentionAdapter, GatedPositionalAdapter, FusedQKVAdapter, SeparateQKVAdapter,
             FusedLinearAdapter):
    ATTENTION_ADAPTERS.register(f"structinit.{_cls.__name__}", AdapterEntry(_cls.matches, _cls))


def _target_name(target) -> str:
    """Registry key of a user target: its qualified name, so that it never collides with a
    built-in entry or with a same-named class of another module."""
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def register_adapter(
    target: type[nn.Module] | Callable[[nn.Module], bool],
    factory: Callable[[nn.Module], AttentionAdapter],
) -> None:
    """Teach structinit a new attention class.

    ``target`` is a module class (matched with ``isinstance``) or a predicate on modules;
    ``factory(module)`` returns an :class:`AttentionAdapter`. User adapters are tried before
    the built-in ones, most recently registered first; registering the same target again
    replaces its factory.
    """
    match = target_matcher(target, factory, "AttentionAdapter")
    ATTENTION_ADAPTERS.register(_target_name(target), AdapterEntry(match, factory), replace=True, first=True)


def target_matcher(target, factory, adapter: str) -> Callable[[nn.Module], bool]:
    """The predicate of a user ``target`` (a module class, matched with ``isinstance``, or a
    predicate itself), after checking ``target`` and that ``factory`` (module → ``adapter``)
    is callable; shared by every kind of adapter registry."""
    if isinstance(target, type):
        cls = target
        match = lambda m: isinstance(m, cls)
    elif callable(target):
        match = target
    else:
        raise TypeError(f"target={target!r}: expected an nn.Module subclass or a predicate")
    if not callable(factory):
        raise TypeError(f"factory={factory!r}: expected a callable module → {adapter}")
    return match


def unregister_adapter(target) -> None:
    """Remove the adapter registered for ``target`` (the class or predicate given before)."""
    ATTENTION_ADAPTERS.remove(_target_name(target))


def adapter_for(module: nn.Module) -> AttentionAdapter | None:
    """The adapter of the first registered entry that matches ``module``, or None."""
    return first_match(ATTENTION_ADAPTERS, module)


def first_match(registry: Registry, module: object):
    """``entry.factory(module)`` of the first entry of ``registry`` whose ``entry.match``
    accepts ``module``, or None."""
    return next((entry.factory(module) for entry in registry.values() if entry.match(module)), None)


def candidate_layers(model: nn.Module) -> tuple[list[tuple[str, AttentionAdapter]], list[tuple[str, str]]]:
    """Every module an adapter claims, in definition order, as (name, adapter) (a claimed
    module's children are not searched further), and the (name, class) of modules whose class
    name says attention but that no adapter claims and no claimed module lies in."""
    found: list[tuple[str, AttentionAdapter]] = []
    inside: list[str] = []
    unknown: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        adapter = adapter_for(module)
        if adapter is None:  # q/k/v here, the output projection in a sibling module
            parent = model.get_submodule(name.rpartition(".")[0]) if name else None
            out = sibling_output(parent, module)
            adapter = None if out is None else SeparateQKVAdapter(module, out)
        if adapter is not None:
            found.append((name, adapter))
            inside.append(name)
        elif isinstance(module, nn.MultiheadAttention):  # kdim/vdim ≠ embed_dim: torch's cross-attention
            unknown.append((name, f"MultiheadAttention with kdim={module.kdim}, vdim={module.vdim} ≠ embed_dim="
                                  f"{module.embed_dim}: cross-attention, not self-attention"))
        elif _looks_like_attention(module):
            unknown.append((name, type(module).__name__))
    # An "attention block" that merely contains a supported attention module is fine.
    unknown = [(n, t) for n, t in unknown if not any(n == "" or f.startswith(n + ".") for f, _ in found)]
    return found, unknown


def attention_survey(model: nn.Module) -> AttentionSurvey:
    """Every claimed attention layer judged against the model's own forward on a probe
    (:mod:`structinit.adapters.verify`): self-attention, pooling heads, layers whose
    computation differs from their adapter's, and attention no adapter claims."""
    candidates, named_unknown = candidate_layers(model)
    survey = survey_attention(model, candidates, probe_inputs(model, candidates))
    # Without a probe the class names are all there is to go by; with one, the dataflow decides.
    extra = [] if survey.probed else [(n, t if ":" in t else f"{t}: its class name says attention")
                                      for n, t in named_unknown]
    if extra:
        survey = AttentionSurvey(survey.verdicts, [*survey.unknown, *extra], survey.pooling, survey.probed)
    return survey


def find_attention_layers(model: nn.Module, *, pooling: bool = False) -> list[tuple[str, AttentionAdapter]]:
    """The attention layers of ``model`` in definition order, as (name, adapter).

    Layers are found by their adapters (names first, then structure) and checked against one
    probe through the model's own forward (:func:`attention_survey`). Attention-pooling and
    class-attention heads (fewer queries than keys) are left out unless ``pooling=True``.
    Layers whose forward differs from their adapter's view are kept: each scheme decides
    whether it can set them. Raises ValueError if there is no attention layer, or if the model
    has attention that no adapter understands (found by its softmax map, or by a class name
    that says attention).
    """
    survey = attention_survey(model)
    if unknown := survey.unknown:
        raise ValueError(
            "found attention that no adapter understands: "
            + ", ".join(f"{n or '<root>'} ({what})" for n, what in unknown)
            + ". Supported: fused `qkv` + `proj` Linear with `num_heads`; separate q/k/v Linear "
            "projections with an output Linear and a head count; nn.MultiheadAttention; ConViT's gated "
            "positional attention (qk, v, proj, pos_proj, gating_param); any module "
            "whose forward is softmax(q kᵀ·scale)·v of one fused q/k/v Linear, then an output Linear. "
            "Register your class with structinit.register_adapter(YourAttention, factory)."
        )
    found = [(v.name, v.adapter) for v in survey.verdicts if v.kind != "pooling" or pooling]
    if not found:
        types = sorted({type(m).__name__ for m in model.modules()})
        skipped = survey.skipped()
        also = (f" (only attention-pooling heads: {', '.join(n for n, _ in skipped)}; pass pooling=True to "
                "include those an adapter understands)") if skipped else ""
        raise ValueError(
            f"no attention layer found in {type(model).__name__}{also} (module types: {', '.join(types)}). "
            "structinit initialises self-attention; register an adapter with "
            "structinit.register_adapter(YourAttention, factory) if your model has one."
        )
    return found


def _looks_like_attention(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    return ("attention" in name or name.endswith("attn")) and (
        any(True for _ in m.parameters(recurse=False)) or any(isinstance(c, nn.Linear) for c in m.children()))


def select_layers(found: list, layers: Iterable[int] | int | None, kind: str = "attention") -> list:
    """``found`` restricted to the indices in ``layers`` (negative indices allowed); ``kind``
    names the layers in the error ("attention", "SSM", …)."""
    if layers is None:
        return list(found)
    layers = [layers] if is_int(layers) else list(layers)
    for i in layers:
        if not is_int(i) or not -len(found) <= i < len(found):
            raise ValueError(
                f"layers contains {i!r}, but the model has {len(found)} {kind} layers "
                f"(valid indices 0 … {len(found) - 1}, or negative from the end)"
            )
    return [found[i] for i in layers]


def layer_relative_bias(model: nn.Module, name: str, adapter) -> RelativeBias | PositionMlpBias | None:
    """The relative position bias attention layer ``name`` of ``model`` uses: its own
    (``adapter.relative``), else one its block holds beside it and hands it with each call
    (Hugging Face's BEiT), else the only one the model holds outside its attention layers
    (timm's BEiT with ``use_shared_rel_pos_bias``, timm's relpos ViTs with ``shared_rel_pos``,
    whose bias an MLP generates); None if there is none."""
    if adapter.relative is not None:
        return adapter.relative
    parent = model.get_submodule(name.rpartition(".")[0]) if name else None
    siblings = [] if parent is None else [c for c in parent.children() if c is not adapter.module]
    for child in siblings:
        if (found := _received(child)) is not None:
            return found
    # a cheap test first: the bias itself is read only for the one holder outside the attention layers
    outside = [m for m in model.modules() if (holds_relative_bias(m) or held_position_mlp(m) is not None)
               and not _inside_attention(model, m)]
    return _received(outside[0]) if len(outside) == 1 else None


def _inside_attention(model: nn.Module, holder: nn.Module) -> bool:
    return any(holder in list(m.modules()) for m in model.modules() if adapter_for(m) is not None)


def _received(holder: nn.Module) -> RelativeBias | PositionMlpBias | None:
    """The bias ``holder`` itself holds, marked as handed to the layer with its call; None if none."""
    if not holds_relative_bias(holder):
        return held_position_mlp(holder)
    return dataclasses.replace(find_relative_bias(holder), received=True)
