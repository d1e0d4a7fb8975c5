"""Argument checks shared by every layer. Each error names the parameter, the value it got,
and what to pass instead; callers run them before they write any weight."""

from __future__ import annotations

import inspect
import math
import numbers
import os
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


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if not is_int(value):
        raise OptionError(f"{name}={value!r}: expected an int")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}={value!r}: expected an int in [{'−∞' if low is None else low}, "
                         f"{'∞' if high is None else high}]")
    return int(value)


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
    if not is_number(value) or not math.isfinite(float(value)):
        raise ValueError(f"{name}={value!r}: expected {what}")
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
        raise ValueError(f"{name}={value!r}: valid names are {', '.join(choices)}")
    return value


def check_finite(name: str, t: torch.Tensor | None) -> None:
    """Raise if ``t`` holds NaN or Inf (a scheme that reads it would spread them)."""
    if t is not None and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"{name} contains {bad} NaN/Inf values and this scheme reads it; re-create the "
            "model or reset that tensor before initialising"
        )


def keyword_options(fn: Callable) -> list[str]:
    """The keyword-only parameter names of ``fn`` (a function or a class)."""
    params = inspect.signature(fn).parameters
    return [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]


def check_options(fn: Callable, options: dict, what: str, valid: Iterable[str] | None = None,
                  hint: str = "") -> None:
    """Raise :class:`OptionError` naming unknown keyword options and listing the valid ones
    (``valid``, default the keyword-only parameters of ``fn``), then ``hint``."""
    valid = list(valid) if valid is not None else keyword_options(fn)
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
