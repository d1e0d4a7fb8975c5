"""An init written as text: ``'impulse:target_mass=0.3,layers=(0,1)'``, a scheme's name and its
options, as the command line takes it and :func:`structinit.init_` does too."""

from __future__ import annotations

import ast
from typing import Any

__all__ = ["parse_init_spec", "parse_literal"]


def parse_literal(text: str) -> Any:
    """``text`` as a Python literal where it parses as one (numbers, None, True, tuples, lists,
    quoted strings), else the text itself: ``'0.3'`` → 0.3, ``'(0,1)'`` → (0, 1), ``'gd'`` → 'gd'."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def parse_init_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``'impulse:target_mass=0.3,solver=analytic'`` → ``('impulse', {...})``; values go
    through :func:`parse_literal`. Only the syntax is checked here; whether the scheme takes
    those options is checked by :func:`structinit.plan_init`."""
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, _split_top_level(rest)):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"init spec {spec!r}: expected name:key=value,key=value, got {item!r}")
        if key.strip() in options:  # the last would silently win
            raise ValueError(f"init spec {spec!r}: option {key.strip()!r} is given twice; give it once")
        options[key.strip()] = parse_literal(value.strip())
    return name.strip(), options


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, so ``layers=(0,1),pe_scale=1`` gives two items."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]
