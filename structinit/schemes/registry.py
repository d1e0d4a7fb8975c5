"""The scheme registry: every initialisation is selectable by a string name.

A built-in scheme is written as a *planner* ``plan(model, **options) -> Plan`` that checks
everything and computes every value without touching the model; :func:`in_place` turns it
into the ``torch.nn.init``-style function ``scheme_init_(model, **options) -> model``. Each
scheme also says what kind of module it initialises (:data:`TARGETS`).

Every call of a planner, of its in-place function and of :func:`plan_init` checks the options
first (:func:`check_call`): an unknown name lists the valid ones, and each value is checked
against the planner's type annotation (a ``float`` must be a finite number, a ``bool`` True or
False, …). The planner then checks ranges and everything that depends on the model.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from structinit.schemes.plan import Plan
from structinit.utils import OptionError, Registry, check_choice, check_int, check_options
from structinit.utils.checks import check_annotated, check_layers, is_number, show

# 'model': every layer of the model (framework defaults); the others: the layers of one kind.
TARGETS = ("model", "attention", "conv", "ssm")


@dataclass(frozen=True)
class Scheme:
    name: str
    init: Callable[..., nn.Module]          # in place: init(model, **options) -> model
    plan: Callable[..., Plan] | None        # plan(model, **options) -> Plan, nothing written
    target: str


SCHEMES: Registry[Scheme] = Registry("scheme")


def _check_seed(name: str, value: object) -> None:
    if value is not None:  # the range torch.Generator.manual_seed takes
        check_int(name, value, low=-(2**63), high=2**64 - 1)


# Options every scheme reads the same way, checked so whatever their annotation says: ``layers``
# is an index or several (as select_layers takes it), ``seed`` what a torch.Generator takes.
SHARED_OPTIONS: dict[str, Callable[[str, object], None]] = {"layers": check_layers, "seed": _check_seed}


@functools.cache
def _hints(fn: Callable) -> dict[str, object]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: nothing is checked against it
        return {}


def check_call(fn: Callable, model: object, args: tuple, options: dict, what: str, *, types: bool = True) -> None:
    """Check the call ``fn(model, *args, **options)`` of a scheme before it runs: ``model`` is an
    ``nn.Module``; an unknown option is an :class:`OptionError` listing the valid ones (unless
    ``fn`` takes ``**options`` and checks them itself); with ``types``, each option given is
    checked against ``fn``'s annotation (:func:`~structinit.utils.checks.check_annotated`), and
    the :data:`SHARED_OPTIONS` by their own checks."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]  # after the model
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        check_options(fn, options, what, valid=named)
    try:
        bound = sig.bind(model, *args, **options)
    except TypeError as err:
        raise OptionError(f"{what}: {err}; pass the model, then options by name: {', '.join(named)}") from None
    if not types:
        return
    hints = _hints(fn)
    for name in named:
        if name in bound.arguments:
            value = bound.arguments[name]
            if name in SHARED_OPTIONS:
                SHARED_OPTIONS[name](name, value)
            elif name in hints:
                check_annotated(name, value, hints[name])


# What an option far outside float range makes the maths raise (an SVD of inf, a float overflow).
_NUMERIC_FAILURES = (torch.linalg.LinAlgError, ZeroDivisionError, OverflowError, FloatingPointError)


def _numbers(options: dict) -> str:
    return ", ".join(f"{k}={show(v)}" for k, v in options.items() if is_number(v) and k != "seed")


def run_planner(planner: Callable[..., Plan], model: nn.Module, args: tuple, options: dict, what: str) -> Plan:
    """``planner(model, *args, **options)``, its options already checked, with its plan checked
    too: every planned value must be finite in the dtype of the tensor it goes to. A finite but
    huge (or tiny) option can still overflow the maths or the model's dtype; that is a
    ``ValueError`` naming the numeric options given, raised before anything is written."""
    try:
        plan = planner(model, *args, **options)
    except _NUMERIC_FAILURES as err:
        if not _numbers(options):
            raise
        raise ValueError(f"{what} failed on out-of-range numbers ({type(err).__name__}: {err}); check the "
                         f"numeric options given, one may be far too large or too small: {_numbers(options)}") from err
    if isinstance(plan, Plan):
        _check_writes(plan, model, what, options)
    return plan


def _check_writes(plan: Plan, model: nn.Module, what: str, options: dict) -> None:
    names = None
    for dst, value in plan.writes:
        if not (value.is_floating_point() and dst.is_floating_point()) or value.numel() == 0:
            continue
        lo, hi = torch.aminmax(value)  # NaN if any entry is NaN; then no comparison holds
        top = torch.finfo(dst.dtype).max
        if -top <= lo and hi <= top:
            continue
        if names is None:
            tensors = [*model.named_parameters(), *model.named_buffers()]
            names = {t.untyped_storage().data_ptr(): n for n, t in tensors}
        where = names.get(dst.untyped_storage().data_ptr(), f"a {tuple(dst.shape)} tensor")
        numbers = _numbers(options)
        given = f"the numeric options given: {numbers}" if numbers else "no numeric option was given"
        raise ValueError(f"{what} would write NaN/inf into {where} ({dst.dtype}); nothing was written. Either an "
                         f"option is too large or too small for the model ({given}), or a tensor it reads already "
                         "holds NaN/inf")


def _unchecked(fn: Callable) -> Callable:
    return getattr(fn, "__structinit_unchecked__", fn)


def checked_planner(planner: Callable[..., Plan]) -> Callable[..., Plan]:
    """``planner`` with its options checked (:func:`check_call`) before it runs, so that a call
    of the planner itself rejects what :func:`plan_init` would. Usable as a decorator."""
    if _unchecked(planner) is not planner:
        return planner

    @functools.wraps(planner)
    def plan(model: nn.Module, *args, **options) -> Plan:
        check_call(planner, model, args, options, planner.__name__)
        return run_planner(planner, model, args, options, planner.__name__)

    plan.__structinit_unchecked__ = planner
    return plan


def in_place(planner: Callable[..., Plan], name: str) -> Callable[..., nn.Module]:
    """The in-place function of a planner: its options checked (:func:`check_call`), then
    ``planner(model, …).commit()``, then the model. It keeps the planner's signature and docstring."""
    planner = _unchecked(planner)

    @functools.wraps(planner)
    def init(model: nn.Module, *args, **options) -> nn.Module:
        check_call(planner, model, args, options, name)
        run_planner(planner, model, args, options, name).commit()
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
    ``<name>_init_``. Both check their options first (:func:`check_call`)."""
    return register_scheme(name, in_place(planner, f"{name}_init_"), target=target, plan=checked_planner(planner))


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

    A scheme registered without a planner is checked against its signature only (names, not
    types), and its plan runs it at commit.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    entry = SCHEMES.get(scheme)
    if entry.plan is not None:
        planner = _unchecked(entry.plan)
        check_call(planner, model, (), options, f"scheme {scheme!r}")
        return run_planner(planner, model, (), options, f"scheme {scheme!r}")
    check_call(entry.init, model, (), options, f"scheme {scheme!r}", types=False)
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
