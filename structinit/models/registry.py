"""Models by name, timm style: each architecture file registers entry points with
``@register_model`` and :func:`create_model` builds one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from structinit.models.timm_bridge import create_timm_model, is_timm_name
from structinit.utils import Registry

MODELS: Registry[Callable[..., nn.Module]] = Registry("model")


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Decorator: register the entry point ``fn(**overrides) -> model`` under its own name."""
    return MODELS.register(fn.__name__, fn)


def register_presets(namespace: dict, build: Callable[..., nn.Module], presets: dict[str, tuple[dict, str]]) -> None:
    """Register one entry point per preset, ``name(**overrides)`` → ``build(**{**settings, **overrides})``
    with the preset's description as its docstring, and bind it in ``namespace`` (the defining module's
    ``globals()``)."""

    def entry_point(name: str, settings: dict, doc: str) -> Callable[..., nn.Module]:
        def entry(**overrides: Any) -> nn.Module:
            return build(**{**settings, **overrides})

        entry.__name__ = entry.__qualname__ = name
        entry.__doc__, entry.__module__ = doc, namespace["__name__"]
        return register_model(entry)

    for name, (settings, doc) in presets.items():
        namespace[name] = entry_point(name, settings, doc)


def list_models() -> list[str]:
    """Names accepted by :func:`create_model`."""
    return MODELS.names()


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build the model ``name``; keyword arguments override its settings (for the ViTs, any
    :class:`~structinit.models.vit.VisionTransformer` argument). ``timm/<name>`` builds timm's
    model of that name, without pretrained weights (needs the ``timm`` extra; see
    :func:`~structinit.models.timm_bridge.create_timm_model`).

    Examples:
        >>> model = create_model("vit_tiny_patch2_32", num_classes=100)
    """
    if is_timm_name(name):
        return create_timm_model(name, **overrides)
    return MODELS.get(name)(**overrides)
