"""What every scheme checks of the model itself before it plans: a module whose tensors hold
values it can read and write (not compiled by TorchScript, not on the meta device, not quantised)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parameter import is_lazy


def check_model(model: object) -> None:
    """``model`` is an ``nn.Module`` whose tensors hold values: one on the meta device (deferred
    initialisation) has none to read or write, and a write there would silently do nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    scripted = next((n for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None:
        raise ValueError(f"model: {scripted or '<root>'} is a TorchScript module (torch.jit.trace or "
                         "torch.jit.script), compiled code whose layers structinit cannot read or run one by one; "
                         "nothing was written. "
                         "Initialise the nn.Module first, then script or trace it")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"model: {len(meta)} tensors ({meta[0]}, …) are on the meta device and hold no values; "
                         "nothing was written. Materialise the model first, model.to_empty(device='cpu') (or your "
                         "device), then initialise it: a whole-model scheme such as 'timm' gives every weight a value, "
                         "and an attention or conv scheme after it reads them")
    lazy = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if is_lazy(t)]
    if lazy:
        raise ValueError(f"model: {len(lazy)} tensors ({lazy[0]}, …) belong to lazy modules not yet materialised and "
                         "hold no values; nothing was written. Run the model once on a batch of its input, so that "
                         "they take their shapes, then initialise it (structinit reads a model by running it, and a "
                         "run would materialise them, which cannot be undone)")
    quantised = [(n, f"{type(m).__module__}.{type(m).__name__}") for n, m in model.named_modules() if _quantised(m)]
    quantised = [(n, k) for n, k in quantised if not any(n.startswith(f"{o}.") for o, _ in quantised)]  # outermost
    if quantised:
        name, kind = quantised[0]
        raise ValueError(f"model: {len(quantised)} layers are quantised ({name or '<root>'}: {kind}, …): their "
                         "weights are packed integers that no init writes, and a scheme would leave them as they "
                         "are; nothing was written. Initialise the float model, then quantise it "
                         "(torch.ao.quantization.quantize_dynamic, or your quantiser)")


def _quantised(module: nn.Module) -> bool:
    """Whether ``module`` keeps its weights quantised: torch's quantised layers (packed
    parameters, or a class from a ``quantized`` package) or a weight that is not a float
    (bitsandbytes' int8 and 4-bit layers)."""
    weight = module._parameters.get("weight")  # not module.weight: a parametrised one computes (and may update)
    return (hasattr(module, "_packed_params") or ".quantized" in type(module).__module__
            or (isinstance(weight, torch.Tensor) and not weight.is_floating_point())
            or any(t.is_quantized for t in module.parameters(recurse=False)))


__all__ = ["check_model"]
