"""Records of what an init wrote, kept on the module it wrote (e.g. each attention layer's
impulse offsets, which :func:`structinit.impulse_fidelity` reads).

A record is a plain dict stored as the attribute ``structinit_<kind>`` of the module. It lives
only in the process: it is not in the state dict, so a reloaded model has none (pass the
offsets explicitly there).
"""

from __future__ import annotations

from torch import nn


def record_attr(kind: str) -> str:
    """The attribute that holds a record of ``kind`` (``'impulse'`` → ``structinit_impulse``)."""
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ValueError(f"kind={kind!r}: expected an identifier such as 'impulse'")
    return "structinit_" + kind


def get_record(module: nn.Module, kind: str = "impulse") -> dict | None:
    """The record of ``kind`` on ``module``, or None if no init left one.

    Examples:
        >>> model = structinit.create_model("vit_micro_patch2_16")
        >>> _ = structinit.init_(model, "impulse", seed=0)
        >>> sorted(get_record(model.blocks[0].attn))
        ['grid', 'num_prefix_tokens', 'offsets', 'solver']
    """
    return module.__dict__.get(record_attr(kind))


def set_record(module: nn.Module, kind: str, record: dict | None) -> None:
    """Set (or with ``None`` clear) the record of ``kind`` on ``module``."""
    attr = record_attr(kind)
    if record is None:
        module.__dict__.pop(attr, None)
    else:
        module.__dict__[attr] = record
