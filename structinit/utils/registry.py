"""One registry style for everything that is chosen by a string name: schemes, impulse
solvers, attention adapters, models, datasets and recipes (timm's ``register_model`` idea,
generalised)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """An ordered mapping name → entry for one ``kind`` of thing.

    Entries keep the order in which they were registered (``first=True`` puts one in front:
    adapters registered by users are tried before the built-in ones). An unknown name is a
    ``ValueError`` that lists the valid names.

    Examples:
        >>> solvers = Registry("solver")
        >>> @solvers.register("double")
        ... def double(x):
        ...     return 2 * x
        >>> solvers.get("double")(3)
        6
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str | None = None, entry: T | None = None, *, replace: bool = False,
                 first: bool = False) -> Callable[[T], T] | T:
        """Register ``entry`` under ``name`` (default: its ``__name__``); usable as a decorator.

        Registering a different entry under a taken name is an error unless ``replace=True``;
        registering the same entry again is a no-op (re-imports are harmless).
        """

        def add(obj: T) -> T:
            key = name if name is not None else getattr(obj, "__name__", None)
            if not isinstance(key, str) or not key:
                raise ValueError(f"{self.kind} registry: a name is required for {obj!r}")
            old = self._entries.get(key)
            if old is not None and old is not obj and not replace:
                raise ValueError(f"{self.kind} {key!r} is already registered; pick another name or pass replace=True")
            if first:
                self._entries = {key: obj, **{k: v for k, v in self._entries.items() if k != key}}
            else:
                self._entries[key] = obj
            return obj

        return add(entry) if entry is not None else add

    def remove(self, name: str) -> None:
        """Forget ``name`` (no error if it is not registered)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}")
        return self._entries[name]

    __getitem__ = get

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def values(self) -> list[T]:
        """Entries in registration order."""
        return list(self._entries.values())

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
