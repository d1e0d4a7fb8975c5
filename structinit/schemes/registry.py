"""The scheme registry: every initialisation is selectable by a string name.

A built-in scheme is written as a *planner* ``plan(model, **options) -> Plan`` that checks
everything and computes every value without touching the model; :func:`in_place` turns it
into the ``torch.nn.init``-style function ``scheme_init_(model, **options) -> model``. Each
scheme also says what kind of module it initialises (:data:`TARGETS`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from structinit.schemes.plan import Plan
from structinit.utils import Registry, check_choice, check_options

# 'model': every layer of the model (framework defaults); the others: the layers of one kind.
TARGETS = ("model", "attention", "conv", "ssm")


@dataclass(frozen=True)
class Scheme:
    name: str
    init: Callable[..., nn.Module]          # in place: init(model, **options) -> model
    plan: Callable[..., Plan] | None        # plan(model, **options) -> Plan, nothing written
    target: str


SCHEMES: Registry[Scheme] = Registry("scheme")


def in_place(planner: Callable[..., Plan], name: str) -> Callable[..., nn.Module]:
    """The in-place function of a planner: ``planner(model, …).commit()``, then the model.
    It keeps the planner's signature and docstring."""

    @functools.wraps(planner)
    def init(model: nn.Module, *args, **options) -> nn.Module:
        planner(model, *args, **options).commit()
        return model

    init.__name__ = init.__qualname__ = name
    init.__signature__ = inspect.signature(planner).replace(return_annotation=nn.Module)
    return init


def register_scheme(name: str, fn: Callable[..., nn.Module] | None = None, *, target: str = "model",
                    plan: Callable[..., Plan] | None = None):
    """Register the in-place ``fn(model, **options) -> model`` under ``name`` (usable as a
    decorator). ``target`` says which modules it initialises (one of :data:`TARGETS`);
    ``plan``, if given, builds the same init as a :class:`Plan` without writing (used by
    :func:`plan_init`, e.g. to check a comparison's specs before it trains)."""
    check_choice("target", target, TARGETS)

    def deco(f):
        if name not in SCHEMES or SCHEMES.get(name).init is not f:  # registering f again is a no-op
            SCHEMES.register(name, Scheme(name, f, plan, target))
        return f

    return deco(fn) if fn is not None else deco


def register_planner(name: str, planner: Callable[..., Plan], *, target: str = "model") -> Callable[..., nn.Module]:
    """Register a built-in scheme written as a planner; returns its in-place function
    ``<name>_init_``."""
    return register_scheme(name, in_place(planner, f"{name}_init_"), target=target, plan=planner)


def schemes(target: str | None = None) -> list[str]:
    """Names accepted by :func:`init_` (those initialising ``target`` modules, if given)."""
    if target is not None:
        check_choice("target", target, TARGETS)
    return [n for n in SCHEMES.names() if target is None or SCHEMES.get(n).target == target]


def get_scheme(name: str) -> Callable[..., nn.Module]:
    """The in-place function of scheme ``name``."""
    return SCHEMES.get(name).init


def plan_init(model: nn.Module, scheme: str, **options) -> Plan:
    """Everything ``init_(model, scheme, **options)`` would do, checked and computed but not
    written: ``plan_init(...).commit()`` is ``init_(...)``. A bad name, option or value raises
    here with the model untouched.

    A scheme registered without a planner is checked against its signature only, and its
    plan runs it at commit.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    entry = SCHEMES.get(scheme)
    fn = entry.plan or entry.init
    params = list(inspect.signature(fn).parameters.values())[1:]  # after the model
    if not any(p.kind is p.VAR_KEYWORD for p in params):  # a **options scheme checks its own
        check_options(fn, options, f"scheme {scheme!r}",
                      valid=[p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)])
    if entry.plan is not None:
        return entry.plan(model, **options)
    plan = Plan()
    plan.actions.append(lambda: entry.init(model, **options))
    return plan


def init_(model: nn.Module, scheme: str, **options) -> nn.Module:
    """Initialise ``model`` in place with the scheme called ``scheme`` and return it.

    ``options`` go to the scheme's function (e.g. :func:`structinit.impulse_init_`); every
    scheme takes ``generator=`` or ``seed=`` for bit-reproducible weights.

    Examples:
        >>> model = structinit.create_model("vit_tiny_patch2_32")
        >>> _ = structinit.init_(model, "impulse", kernel_size=3, seed=0)
    """
    plan_init(model, scheme, **options).commit()
    return model
