"""The scheme registry: every initialisation is selectable by a string name."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_SCHEMES: dict[str, Callable[..., nn.Module]] = {}


def register_scheme(name: str, fn: Callable[..., nn.Module] | None = None):
    """Register ``fn(model, **options) -> model`` under ``name`` (usable as a decorator)."""

    def deco(f):
        if name in _SCHEMES and _SCHEMES[name] is not f:
            raise ValueError(f"scheme {name!r} is already registered")
        _SCHEMES[name] = f
        return f

    return deco(fn) if fn is not None else deco


def schemes() -> list[str]:
    """Names accepted by :func:`init_`."""
    return sorted(_SCHEMES)


def get_scheme(name: str) -> Callable[..., nn.Module]:
    if name not in _SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; valid names: {', '.join(schemes())}")
    return _SCHEMES[name]


def init_(model: nn.Module, scheme: str, **options) -> nn.Module:
    """Initialise ``model`` in place with the scheme called ``scheme`` and return it.

    ``options`` go to the scheme's function (e.g. :func:`structinit.impulse_init_`); every
    scheme takes ``generator=`` or ``seed=`` for bit-reproducible weights.

    Example::

        model = structinit.create_model("vit_tiny_patch2_32")
        structinit.init_(model, "impulse", kernel_size=3, seed=0)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return get_scheme(scheme)(model, **options)
