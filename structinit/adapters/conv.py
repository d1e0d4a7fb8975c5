"""Finding depthwise convolutions: the layers the conv-filter schemes initialise.

A depthwise conv here is an ``nn.Conv2d`` with ``groups == in_channels == out_channels`` and a
square kernel (odd or even side), i.e. a weight of shape (C, 1, k, k) that filters each channel
on its own, as in ConvMixer and ConvNeXt.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def is_depthwise(module: object) -> bool:
    """True for an ``nn.Conv2d`` with groups == in_channels == out_channels and a square kernel."""
    return (isinstance(module, nn.Conv2d) and module.groups == module.in_channels == module.out_channels
            and module.kernel_size[0] == module.kernel_size[1])


def _describe(name: str, module: nn.Module) -> str:
    if isinstance(module, nn.Conv2d):
        return (f"{name!r} is Conv2d({module.in_channels}, {module.out_channels}, kernel_size={module.kernel_size}, "
                f"groups={module.groups})")
    return f"{name!r} is a {type(module).__name__}"


def find_depthwise_convs(model: nn.Module, names: Sequence[str] | None = None) -> list[tuple[str, nn.Conv2d]]:
    """The depthwise convs of ``model`` as (qualified name, module), in module order; with
    ``names``, exactly those modules, each of which must be a depthwise conv.

    Raises ``ValueError`` if the model has none, or if a name given is missing or names a
    module that is not depthwise (the message names it and says why).

    Examples:
        >>> m = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.Conv2d(4, 8, 1))
        >>> [n for n, _ in find_depthwise_convs(m)]
        ['0']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if names is not None:
        names = [names] if isinstance(names, str) else list(names)
        modules = dict(model.named_modules())
        for name in names:
            if name not in modules:
                raise ValueError(f"names: {name!r} is not a module of {type(model).__name__}; "
                                 "pass qualified names as model.named_modules() lists them")
            if not is_depthwise(modules[name]):
                raise ValueError(f"names: {_describe(name, modules[name])}, not a depthwise conv (needs an nn.Conv2d "
                                 "with groups == in_channels == out_channels and a square kernel); leave it out")
        return [(name, modules[name]) for name in names]
    found = [(n, m) for n, m in model.named_modules() if is_depthwise(m)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no depthwise conv (an nn.Conv2d with groups == in_channels == "
                         "out_channels and a square kernel); the conv-filter schemes initialise ConvMixer/ConvNeXt-"
                         "style depthwise layers; use a model-wide scheme such as 'pytorch' instead")
    return found
