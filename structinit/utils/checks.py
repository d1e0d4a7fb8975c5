"""Argument checks shared by every layer. Each error names the parameter, the value it got,
and what to pass instead; callers run them before they write any weight."""

from __future__ import annotations

import collections.abc
import inspect
import math
import numbers
import os
import types
import typing
import warnings
from collections.abc import Callable, Iterable

import torch


class OptionError(TypeError, ValueError):
    """An unknown keyword option, or an option value of the wrong type. It is a ``TypeError``
    (what Python raises for an unexpected keyword or type) and a ``ValueError`` (a bad entry
    in a spec such as ``impulse:target_mas=0.3``), so either ``except`` catches it."""


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for ``bool`` (an int subclass, never meant
    as a count or an index here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """True for real numbers (int, float, numpy scalars), False for ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite(value: object) -> bool:
    """True for a real number (not ``bool``) that is neither NaN nor ±inf (an int too large for
    a float counts as infinite)."""
    try:
        return is_number(value) and math.isfinite(float(value))
    except OverflowError:
        return False


def show(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, or its type (and shape) when that is too long."""
    text = repr(value)
    if len(text) <= limit and "\n" not in text:  # one line: a 2-D tensor's repr spans several
        return text
    shape = getattr(value, "shape", None)
    return f"<{type(value).__name__}{'' if shape is None else f' of shape {tuple(shape)}'}>"


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if not is_int(value):
        raise OptionError(f"{name}={show(value)}: expected an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}={value!r}: expected an int in [{'−∞' if low is None else low}, "
                         f"{'∞' if high is None else high}]")
    return int(value)


def check_sizes(**sizes: object) -> None:
    """:func:`check_int` with ``low=1`` on every ``name=value`` given (layer sizes and counts)."""
    for name, value in sizes.items():
        check_int(name, value, low=1)


def check_number(
    name: str, value: object, *, low: float | None = None, high: float | None = None,
    low_open: bool = False, high_open: bool = False, allow_none: bool = False,
) -> float | None:
    """``value`` as a finite float inside the interval; ``None`` passes if ``allow_none``.

    The bounds are closed unless ``low_open`` / ``high_open``.
    """
    if value is None and allow_none:
        return None
    lo = "(" if low_open or low is None else "["
    hi = ")" if high_open or high is None else "]"
    interval = f"{lo}{'−∞' if low is None else low}, {'∞' if high is None else high}{hi}"
    what = f"a number in {interval}" + (" or None" if allow_none else "")
    if not is_number(value):  # a str, a bool, a list, …: the wrong type
        raise OptionError(f"{name}={show(value)}: expected {what}, got {type(value).__name__}")
    if not is_finite(value):
        raise ValueError(f"{name}={show(value)}: expected {what}; NaN and ±inf are not allowed")
    v = float(value)
    below = low is not None and (v <= low if low_open else v < low)
    above = high is not None and (v >= high if high_open else v > high)
    if below or above:
        raise ValueError(f"{name}={value!r}: expected {what}")
    return v


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``; a ``ValueError`` listing them otherwise."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={show(value)}: valid names are {', '.join(choices)}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; an :class:`OptionError` otherwise (a truthy
    ``'no'`` or ``0`` is not silently taken for a flag)."""
    if not isinstance(value, bool):
        raise OptionError(f"{name}={show(value)}: expected True or False, got {type(value).__name__}")
    return value


def check_layers(name: str, value: object) -> None:
    """The type of a layer selection: ``None`` (all), one index, or a non-empty collection of
    indices. Each index is checked against the model where the layers are chosen."""
    if value is None or is_int(value):
        return
    if isinstance(value, (str, bytes, bool, torch.Tensor)) or not isinstance(value, collections.abc.Iterable):
        raise OptionError(f"{name}={show(value)}: expected an attention-layer index, a list of them such as "
                          "[0, 1], or None for every layer")
    if isinstance(value, collections.abc.Sized) and len(value) == 0:
        raise ValueError(f"{name}={show(value)}: selects no layer; give at least one index, or None for every layer")


def check_annotated(name: str, value: object, annotation: object) -> None:
    """Check ``value`` against a parameter's type ``annotation``: an :class:`OptionError` naming
    ``name``, the value and the expected type where it does not match, a ``ValueError`` for a
    NaN/inf where a ``float`` is expected.

    Understood: ``float`` (any real number but ``bool``, finite), ``int`` (not ``bool``),
    ``bool``, ``str``, ``None``, classes, ``Callable``, unions, ``tuple[A, B]`` (entry by entry;
    a list is accepted too) and collections such as ``Sequence[…]`` / ``Iterable[…]``, whose
    entries are left to the caller (which knows their range and names the bad one). A plain
    ``str`` (or ``str | None``) is left to the caller too: such an option is a name, and the
    caller's check lists the valid ones. Anything else passes.
    """
    if {m for m in _members(annotation) if m is not type(None)} == {str}:
        return
    if not matches_annotation(value, annotation):
        raise OptionError(f"{name}={show(value)}: expected {_describe(annotation)}, got {type(value).__name__}")
    if is_number(value) and not is_finite(value) and not (is_int(value) and int in _members(annotation)):
        raise ValueError(f"{name}={show(value)}: expected a finite number; NaN and ±inf are not allowed")


def _members(tp: object) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


_COLLECTIONS = (collections.abc.Iterable, collections.abc.Collection, collections.abc.Sequence,
                collections.abc.MutableSequence, collections.abc.Set, list, set, frozenset)


def matches_annotation(value: object, tp: object) -> bool:
    """Whether ``value`` has the type ``tp`` as :func:`check_annotated` reads it (no range, no
    NaN check): the test a caller needs to choose between two readings of one input."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches_annotation(value, m) for m in args)
    if tp is None or tp is type(None):
        return value is None
    if tp is float:  # a Fraction is a real number that tensors cannot multiply
        fraction = isinstance(value, numbers.Rational) and not isinstance(value, numbers.Integral)
        return is_number(value) and not fraction
    if tp is int:
        return is_int(value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is tuple or origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(matches_annotation(v, args[0]) for v in value)
        return not args or (len(value) == len(args) and all(matches_annotation(v, a) for v, a in zip(value, args)))
    if tp in _COLLECTIONS or origin in _COLLECTIONS:
        return isinstance(value, origin or tp) and not isinstance(value, (str, bytes))
    if tp is dict or origin is dict:  # its entries are left to the caller, as a collection's are
        return isinstance(value, dict)
    if tp is collections.abc.Callable or origin is collections.abc.Callable:
        return callable(value)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # a form not understood here (Any, a TypeVar, Literal, …): the caller checks it


def _describe(tp: object) -> str:
    members = _members(tp)
    if len(members) > 1:
        parts = [_describe(m) for m in members if m is not type(None)]
        parts += ["None"] if any(m is None or m is type(None) for m in members) else []
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    simple = {float: "a finite number", int: "an int", bool: "True or False", str: "a str", type(None): "None"}
    if tp in simple:
        return simple[tp]
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a tuple of {_plural(args[0])}"
        if len(set(args)) == 1:
            return f"a {'pair' if len(args) == 2 else f'{len(args)}-tuple'} of {_plural(args[0])}"
        return f"a tuple of {len(args)} values"
    if tp is dict or origin is dict:
        return "a dict"
    if origin in _COLLECTIONS:
        name = origin.__name__.lower()
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name} of {_plural(args[0])}" if args else f"a {name}"
    if tp is collections.abc.Callable or origin is collections.abc.Callable:
        return "a function"
    if isinstance(tp, type):
        if tp.__module__ == "builtins":
            return f"a {tp.__qualname__}"
        public = [f"torch.{ns}{tp.__name__}" for ns, mod in (("", torch), ("nn.", torch.nn))
                  if getattr(mod, tp.__name__, None) is tp]
        return f"a {public[0] if public else f'{tp.__module__}.{tp.__qualname__}'}"
    return str(tp)


def _plural(tp: object) -> str:
    simple = {float: "numbers", int: "ints", bool: "flags", str: "strs"}
    if tp in simple:
        return simple[tp]
    text = _describe(tp)
    for article in ("a ", "an "):
        if text.startswith(article):  # "a pair of ints" → "pairs of ints"
            head, _, rest = text[len(article):].partition(" ")
            return f"{head}s{' ' + rest if rest else ''}"
    return f"values ({text})"


def check_finite(name: str, t: torch.Tensor | None) -> None:
    """Raise if ``t`` holds NaN or Inf (a scheme that reads it would spread them)."""
    if t is not None and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"{name} contains {bad} NaN/Inf values and this scheme reads it; re-create the "
            "model or reset that tensor before initialising"
        )


def check_options(fn: Callable, options: dict, what: str, valid: Iterable[str] | None = None,
                  hint: str = "") -> None:
    """Raise :class:`OptionError` naming unknown keyword options and listing the valid ones
    (``valid``, default the keyword-only parameters of ``fn``), then ``hint``."""
    valid = list(valid) if valid is not None else [
        n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise OptionError(f"{what} got unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}{hint}")


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside the ``structinit`` package, so
    the warning names the user's line whichever public entry point they called."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    level, frame = 2, inspect.currentframe().f_back  # level 2 is our caller
    while frame is not None and frame.f_code.co_filename.startswith(package):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
