"""Which adapter understands which attention module, and the modules they claim in a model
(the survey then judges them: :mod:`structinit.adapters.survey`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from structinit.adapters.attention import AttentionAdapter, FusedQKVAdapter, MultiheadAttentionAdapter
from structinit.adapters.gated import GatedPositionalAdapter
from structinit.adapters.separate import SeparateQKVAdapter, sibling_output
from structinit.utils import Registry, is_int


@dataclass(frozen=True)
class AdapterEntry:
    """``match(module)`` says whether ``factory(module)`` can build an adapter for it."""

    match: Callable[[nn.Module], bool]
    factory: Callable[[nn.Module], AttentionAdapter]


ATTENTION_ADAPTERS: Registry[AdapterEntry] = Registry("attention adapter")
# Built-ins, in the order they are tried after any user adapter.
# Names are the fast path; attention no adapter claims is read from what it computes (provenance.py).
for _cls in (MultiheadAttentionAdapter, GatedPositionalAdapter, FusedQKVAdapter, SeparateQKVAdapter):
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


def _looks_like_attention(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    return ("attention" in name or name.endswith("attn")) and (
        any(True for _ in m.parameters(recurse=False)) or any(isinstance(c, nn.Linear) for c in m.modules()))


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
