"""timm's models by name, for the harness: ``create_model("timm/<name>")`` builds timm's
``<name>`` from code (no pretrained weights), sized for the data, so ``structinit train`` and
``compare`` take any timm model with ``--model timm/<name>``. timm is an optional extra
(``pip install -e ".[timm]"`` in a clone); nothing here imports it until a ``timm/`` name is asked for."""

from __future__ import annotations

import difflib
from typing import Any

from torch import nn

PREFIX = "timm/"


def is_timm_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def create_timm_model(name: str, **overrides: Any) -> nn.Module:
    """timm's model ``timm/<name>`` without pretrained weights; ``overrides`` go to
    ``timm.create_model`` (``num_classes``, ``in_chans``, ``img_size``, ``drop_path_rate`` …).

    ``img_size`` reaches the models whose class takes it (ViTs and their kin); a model that
    rejects it (a CNN, which takes any image size) is built without it.

    Raises ``ImportError`` naming the extra when timm is missing, and ``ValueError`` listing
    close names when timm has no such model.

    Examples:
        >>> model = create_timm_model("timm/vit_tiny_patch16_224", num_classes=10, img_size=32)  # doctest: +SKIP
    """
    try:
        import timm
    except ImportError as err:
        raise ImportError(
            f"model={name!r} needs timm, which is not installed: pip install -e \".[timm]\" in a clone of structinit "
            "(timm needs torchvision built for the same torch)") from err
    arch = name[len(PREFIX):]
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; similar names: {', '.join(close)}" if close else ""
        raise ValueError(f"model={name!r}: timm has no model {arch!r} (timm.list_models() lists them){hint}")
    try:
        return timm.create_model(arch, pretrained=False, **overrides)
    except TypeError as err:  # raised by the constructor's signature, before any weight is made
        if "img_size" not in overrides or "img_size" not in str(err):
            raise
    return timm.create_model(arch, pretrained=False, **{k: v for k, v in overrides.items() if k != "img_size"})
