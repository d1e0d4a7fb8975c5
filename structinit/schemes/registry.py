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
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from structinit.adapters import adapter_for, is_depthwise, is_ssm, is_token_mixing
from structinit.adapters.registry import attention_survey
from structinit.schemes.plan import Plan
from structinit.utils import OptionError, Registry, check_choice, check_int, check_options
from structinit.utils.checks import check_annotated, check_layers, is_number, show

# 'model': every layer of the model (framework defaults); the others: the layers of one kind.
TARGETS = ("model", "attention", "conv", "ssm", "token_mixing")


@dataclass(frozen=True)
class Scheme:
    name: str
    init: Callable[..., nn.Module]          # in place: init(model, **options) -> model
    plan: Callable[..., Plan] | None        # plan(model, **options) -> Plan, nothing written
    target: str


SCHEMES: Registry[Scheme] = Registry("scheme")
# A name registered again for another target (e.g. 'impulse' for attention and for conv): the
# first registration stays in SCHEMES (get_scheme(name), structinit.<name>_init_), the others
# are kept here under '<target>:<name>'; init_/plan_init choose by the layers the model has.
SCHEME_VARIANTS: Registry[Scheme] = Registry("scheme variant")


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
        commit_and_report(run_planner(planner, model, args, options, name), name)
        return model

    init.__name__ = init.__qualname__ = name
    init.__signature__ = inspect.signature(planner).replace(return_annotation=nn.Module)
    return init


def commit_and_report(plan: Plan, what: str) -> None:
    """``plan.commit()``, then a warning that lists the layers the scheme left alone on purpose
    (attention-pooling heads), if any: the caller must not believe they were initialised."""
    plan.commit()
    for note in plan.notes:
        warnings.warn(f"{what}: {note}", UserWarning, stacklevel=3)
    if plan.skipped:
        warnings.warn(f"{what} left alone: " + "; ".join(f"{n} ({why})" for n, why in plan.skipped)
                      + "; they are not self-attention over the tokens (structinit.get_record(model, 'init') "
                      "lists them)", UserWarning, stacklevel=3)


def register_scheme(name: str, fn: Callable[..., nn.Module] | None = None, *, target: str = "model",
                    plan: Callable[..., Plan] | None = None):
    """Register the in-place ``fn(model, **options) -> model`` under ``name`` (usable as a
    decorator). ``target`` says which modules it initialises (one of :data:`TARGETS`);
    ``plan``, if given, builds the same init as a :class:`Plan` without writing (used by
    :func:`plan_init`, e.g. to check a comparison's specs before it trains)."""
    check_choice("target", target, TARGETS)

    def deco(f):
        if name in SCHEMES and SCHEMES.get(name).target != target:  # the same name for another target
            key = f"{target}:{name}"
            if key not in SCHEME_VARIANTS or SCHEME_VARIANTS.get(key).init is not f:
                SCHEME_VARIANTS.register(key, Scheme(name, f, plan, target))
        elif name not in SCHEMES or SCHEMES.get(name).init is not f:  # registering f again is a no-op
            SCHEMES.register(name, Scheme(name, f, plan, target))
        return f

    return deco(fn) if fn is not None else deco


def register_planner(name: str, planner: Callable[..., Plan], *, target: str = "model",
                     function_name: str | None = None) -> Callable[..., nn.Module]:
    """Register a built-in scheme written as a planner; returns its in-place function
    ``function_name`` (default ``<name>_init_``). Both check their options first (:func:`check_call`)."""
    fn = in_place(planner, function_name or f"{name}_init_")
    return register_scheme(name, fn, target=target, plan=checked_planner(planner))


def scheme_entries(name: str) -> list[Scheme]:
    """Every registration of ``name``: the first one, then those for other targets."""
    first = SCHEMES.get(name)
    return [first, *(e for e in SCHEME_VARIANTS.values() if e.name == name)]


def schemes(target: str | None = None) -> list[str]:
    """Names accepted by :func:`init_` (those initialising ``target`` modules, if given)."""
    if target is not None:
        check_choice("target", target, TARGETS)
    entries = [*SCHEMES.values(), *SCHEME_VARIANTS.values()]
    return sorted({e.name for e in entries if target is None or e.target == target})


def get_scheme(name: str, target: str | None = None) -> Callable[..., nn.Module]:
    """The in-place function of scheme ``name`` (for a name registered for several targets, the
    one for ``target``; default the first registered)."""
    entries = scheme_entries(name)
    if target is None:
        return entries[0].init
    check_choice("target", target, [e.target for e in entries])
    return next(e for e in entries if e.target == target).init


_PRESENT: dict[str, Callable[[nn.Module], bool]] = {
    "attention": lambda model: any(adapter_for(m) is not None for m in model.modules()),
    "conv": lambda model: any(is_depthwise(m) for m in model.modules()),
    "ssm": lambda model: any(is_ssm(m) for m in model.modules()),
    "token_mixing": lambda model: any(is_token_mixing(m) for m in model.modules()),
}


def resolve_scheme(model: nn.Module, name: str, options: dict) -> tuple[Scheme, dict]:
    """The registration of ``name`` that fits ``model``, and the options without ``target``.

    A name registered once is that entry (``target`` is then an unknown option, as before).
    For a name registered for several targets, ``target=`` picks one; otherwise the entry whose
    layers the model has (attention layers → 'attention', depthwise convs → 'conv', SSM layers →
    'ssm', MLP-Mixer token mixing → 'token_mixing'); a model
    with both needs ``target=``; a model with neither gets the first entry (and its error).
    """
    entries = scheme_entries(name)
    if len(entries) == 1:
        return entries[0], options
    targets = [e.target for e in entries]
    options = dict(options)
    target = options.pop("target", None)
    if target is not None:
        check_choice("target", target, targets)
        return next(e for e in entries if e.target == target), options
    present = [e for e in entries if _PRESENT.get(e.target, lambda m: False)(model)]
    kinds = [e.target for e in present]
    if "attention" in targets and "attention" not in kinds and kinds:
        # Attention no adapter claims, beside layers of another kind: the plain call must not quietly
        # initialise the other kind instead. find_attention_layers names the attention it cannot read.
        unknown = attention_survey(model).unknown
        if unknown:
            raise ValueError(
                f"scheme {name!r} initialises attention, and {type(model).__name__} has attention that no adapter "
                f"understands: {', '.join(f'{n} ({what})' for n, what in unknown)}; nothing was written. Register "
                f"an adapter for it (structinit.register_adapter), or pass target={kinds[0]!r} to initialise only "
                f"its {kinds[0]} layers")
    if len(present) > 1 and "attention" in kinds:
        chosen = next(e for e in present if e.target == "attention")
        others = [t for t in kinds if t != "attention"]
        warnings.warn(f"scheme {name!r}: {type(model).__name__} has attention and {', '.join(others)} layers; the "
                      f"attention is initialised and the {', '.join(others)} layers are left as they are (pass "
                      f"target={others[0]!r} to initialise those)", UserWarning, stacklevel=4)
        return chosen, options
    if len(present) > 1:
        raise OptionError(f"target=None: scheme {name!r} exists for targets {', '.join(targets)} and "
                          f"{type(model).__name__} has layers of each ({', '.join(kinds)}); "
                          f"pass target= one of {', '.join(repr(t) for t in targets)}")
    return (present or entries)[0], options


def plan_init(model: nn.Module, scheme: str, **options) -> Plan:
    """Everything ``init_(model, scheme, **options)`` would do, checked and computed but not
    written: ``plan_init(...).commit()`` is ``init_(...)``. A bad name, option or value raises
    here with the model untouched.

    A scheme registered without a planner is checked against its signature only (names, not
    types), and its plan runs it at commit.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    entry, options = resolve_scheme(model, scheme, options)
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
    scheme takes ``generator=`` or ``seed=`` for bit-reproducible weights. A name registered
    for several targets ('impulse': attention and conv) picks the one whose layers the model
    has, or the one named by ``target=`` (:func:`resolve_scheme`).

    Examples:
        >>> model = structinit.create_model("vit_tiny_patch2_32")
        >>> _ = structinit.init_(model, "impulse", kernel_size=3, seed=0)
    """
    commit_and_report(plan_init(model, scheme, **options), f"scheme {scheme!r}")
    return model
