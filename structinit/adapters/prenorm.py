"""The norm in front of an attention layer (a pre-norm block's ``norm1``), found by what the
model computes: the affine LayerNorm whose output, in the model's own forward, is the very
tensor the layer's q and k are computed from.

Such a norm gives a layer a content-free channel even when q or k has no learned bias: with
weight γ_c = 0 and bias β_c = 1 its channel c is 1 for every token, so q and k read from that
channel alone are constants (:mod:`structinit.schemes.rope_impulse`). That is only safe when
nothing but the layer reads the norm's output, which is checked in the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from structinit.adapters.probe import run_forward

__all__ = ["InputNorm", "input_norms"]


@dataclass(frozen=True)
class InputNorm:
    """The affine norm ``module`` (named ``name``) whose output only the attention layer reads;
    ``readers`` lists the other modules that read it too (empty when the channel is safe)."""

    name: str
    module: nn.Module
    readers: tuple[str, ...] = ()


def _affine_norm(m: nn.Module) -> bool:
    weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
    return (isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("LayerNorm")) and isinstance(
        weight, nn.Parameter) and isinstance(bias, nn.Parameter) and weight.ndim == 1 and bias.shape == weight.shape


@torch.no_grad()
def input_norms(model: nn.Module, chosen: list, inputs: torch.Tensor) -> list[InputNorm | None]:
    """For each chosen (name, adapter), the affine LayerNorm whose output is the tokens the
    layer's :attr:`~structinit.adapters.AttentionAdapter.input_module` receives in its first
    call on ``inputs``, or None (the layer reads its input otherwise, or the norm has no bias)."""
    names = {m: n for n, m in model.named_modules()}
    produced: dict[int, tuple[nn.Module, torch.Tensor]] = {}  # id(output) → (norm, output), kept alive
    readers: dict[int, list[nn.Module]] = {}
    received: dict[int, torch.Tensor] = {}
    handles = []

    def after_norm(module, args, output):
        if isinstance(output, torch.Tensor):
            produced[id(output)] = (module, output)

    def before(module, args, kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and id(value) in produced:
                readers.setdefault(id(value), []).append(module)

    def grab(index):
        def hook(module, args, kwargs):
            x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            received.setdefault(index, x)
        return hook

    was = model.training
    try:
        for m in model.modules():
            if _affine_norm(m):
                handles.append(m.register_forward_hook(after_norm))
            handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
        for i, (_, ad) in enumerate(chosen):
            handles.append(ad.input_module.register_forward_pre_hook(grab(i), with_kwargs=True))
        model.eval()
        run_forward(model, inputs)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    out: list[InputNorm | None] = []
    for i, (_, ad) in enumerate(chosen):
        x = received.get(i)
        found = None if x is None else produced.get(id(x))
        if found is None:
            out.append(None)
            continue
        norm = found[0]
        inside = set(ad.module.modules())  # the layer itself and the modules that hand it the tokens pass
        others = [names.get(m, "?") for m in readers.get(id(x), [])
                  if m not in inside and m is not ad.input_module and not any(c is ad.module for c in m.modules())]
        out.append(InputNorm(names.get(norm, "?"), norm, tuple(dict.fromkeys(others))))
    return out
