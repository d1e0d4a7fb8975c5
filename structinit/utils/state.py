"""What a probe's forward may change in a model besides its weights, saved to be put back: the
buffers and the plain tensor attributes of every module (a relative-index table a forward
rebuilds for a new token count, a cached bias, a call counter). An init that reads a model by
running it must leave no trace of those runs, and must read it in its own precision, whatever
autocast context it is called in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla")


@contextlib.contextmanager
def own_precision():
    """Autocast off, for every device type where the caller turned it on: structinit runs and
    recomputes a model in the dtype of its own parameters, so that its reading of a layer (and
    the check of a write) compares like with like; the caller's autocast is back after. Also a
    decorator.

    Examples:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), own_precision():
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    with contextlib.ExitStack() as stack:
        for kind in _AUTOCAST_DEVICES:
            if _autocast_on(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def _autocast_on(kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except TypeError:  # torch < 2.4 asks per device by name, CUDA's without an argument
        return bool({"cpu": torch.is_autocast_cpu_enabled, "cuda": torch.is_autocast_enabled}.get(kind, bool)())
    except RuntimeError:  # a device type this build of torch has no autocast for
        return False


def _is_state(value) -> bool:
    return value is None or isinstance(value, torch.Tensor)


class ModuleState:
    """The buffers and tensor attributes of ``module`` and its children as they are now, by
    identity and by value (and the parameters' values too with ``parameter_values=True``);
    :meth:`restore` puts them back."""

    def __init__(self, module: nn.Module, *, parameter_values: bool = False):
        self._saved = []
        for m in module.modules():
            buffers = dict(m._buffers)
            attributes = {k: v for k, v in vars(m).items() if not k.startswith("_") and _is_state(v)}
            tensors = [*(b for b in buffers.values() if b is not None),
                       *(v for v in attributes.values() if v is not None)]
            if parameter_values:
                tensors += [p for p in m._parameters.values() if p is not None]
            self._saved.append((m, buffers, attributes, [(t, t.detach().clone()) for t in tensors]))

    def storages(self) -> set[int]:
        """The storage addresses of every parameter, buffer and tensor attribute saved: the
        memory the model holds, which nothing but its own writes may touch."""
        held = set()
        for m, buffers, attributes, _ in self._saved:
            for t in [*m._parameters.values(), *buffers.values(), *attributes.values()]:
                if t is not None:
                    held.add(t.untyped_storage().data_ptr())
        return held

    def restore(self, spare: Iterable[torch.Tensor] = (), *, drop_new: bool = True) -> None:
        """Put every saved buffer and tensor attribute back, by identity and value, except the
        memory of ``spare`` (what an init writes on purpose). ``drop_new`` also removes the
        buffers and tensor attributes added since; without it, a buffer removed or added since
        (a parametrisation an init registered) is left as it is."""
        spared = {t.untyped_storage().data_ptr() for t in spare}
        with torch.no_grad():
            for m, buffers, attributes, values in self._saved:
                for key in list(m._buffers):
                    if key in buffers:
                        m._buffers[key] = buffers[key]
                    elif drop_new:
                        del m._buffers[key]
                for key, value in list(vars(m).items()):
                    if key in attributes:
                        object.__setattr__(m, key, attributes[key])
                    elif drop_new and isinstance(value, torch.Tensor) and not key.startswith("_"):
                        delattr(m, key)
                for t, value in values:
                    if t.untyped_storage().data_ptr() in spared or t.shape != value.shape:
                        continue
                    if not torch.equal(t, value):
                        t.copy_(value)


def in_parameters(module: nn.Module, t: torch.Tensor | None) -> bool:
    """Whether ``t`` is, or views, a parameter of ``module`` (an adapter's views slice them; a
    buffer, such as EVA's zero k bias, is not one)."""
    if t is None:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(p.untyped_storage().data_ptr() == ptr for p in module.parameters())


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether views ``a`` and ``b`` share an element of memory (not merely a storage)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.dtype != b.dtype or a.numel() == 0 or b.numel() == 0:
        return a.numel() > 0 and b.numel() > 0  # one storage read as two dtypes: shared, to be safe
    spans = [(t.storage_offset(), t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
             for t in (a, b)]
    if spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]:
        return False
    index = torch.arange(max(spans[0][1], spans[1][1]) + 1)
    held = torch.zeros(len(index), dtype=torch.bool)
    held[index.as_strided(a.shape, a.stride(), a.storage_offset())] = True
    return bool(held[index.as_strided(b.shape, b.stride(), b.storage_offset())].any())


_HOOKS = {WeightNorm: "weight_norm", SpectralNorm: "spectral_norm"}  # the hooks that remake a weight each forward


def derived_weights(module: nn.Module) -> str:
    """In words, the weights inside ``module`` that it computes from other parameters in its
    forward: a ``torch.nn.utils.parametrize`` parametrisation, a ``weight_norm`` or ``spectral_norm``
    hook; '' if none."""
    found = [f"{n + '.' if n else ''}{t} by {type(p).__name__}" for n, m in module.named_modules()
             if parametrize.is_parametrized(m) for t, ps in m.parametrizations.items() for p in ps]
    found += [f"{n + '.' if n else ''}{h.name} by {_HOOKS[type(h)]}" for n, m in module.named_modules()
              for h in m._forward_pre_hooks.values() if type(h) in _HOOKS]
    return ", ".join(found)


def derived_advice(module: nn.Module) -> str:
    """What to do about the weights :func:`derived_weights` finds in ``module``, in a sentence;
    '' if there are none."""
    made = derived_weights(module)
    return (f"The model computes weights from other parameters in its forward ({made}), so a write to those "
            "parameters is not the weight it uses: remove that for the init (torch.nn.utils.parametrize."
            "remove_parametrizations, torch.nn.utils.remove_weight_norm, remove_spectral_norm) and apply it again "
            "after") if made else ""


def remade_storages(model: nn.Module) -> set[int]:
    """The storage addresses of the weights a ``weight_norm`` or ``spectral_norm`` hook makes anew in every forward of
    ``model`` (plain tensor attributes, which :meth:`ModuleState.storages` counts as held)."""
    return {w.untyped_storage().data_ptr() for m in model.modules() for h in m._forward_pre_hooks.values()
            if type(h) in _HOOKS and isinstance(w := getattr(m, h.name, None), torch.Tensor)}
