"""Answers kept per model: what a probe of the model's forward found depends on its code and
its tensors' identities, not on their values, so an init that asks several times pays once."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def kept(cache: weakref.WeakKeyDictionary, owner: object, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, kept in ``cache`` for ``owner`` while ``key`` is the same (a model gone is
    forgotten with it)."""
    found = cache.get(owner)
    if found is not None and found[0] == key:
        return found[1]
    value = compute()
    cache[owner] = (key, value)
    return value
