"""Shared machinery of the schemes: seeding, layer selection, and the plan/commit split that
guarantees an error leaves the model bit-identical (everything is validated and computed
into a :class:`Plan` first; only :meth:`Plan.commit` touches the model)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from structinit.adapters import AttentionAdapter

RECORD_ATTR = "structinit_impulse"  # per attention module: offsets, grid, prefix count


def make_generator(generator: torch.Generator | None = None, seed: int | None = None) -> torch.Generator:
    """The CPU generator every random draw of a scheme goes through.

    ``seed`` wins; else ``generator``; else a seed drawn from torch's global RNG, so that
    ``torch.manual_seed(s)`` before a call also reproduces it.
    """
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r}: expected an int")
        return torch.Generator().manual_seed(seed)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator={generator!r}: expected a torch.Generator")
        if generator.device.type != "cpu":
            raise ValueError("generator must be a CPU torch.Generator (draws happen on the CPU)")
        return generator
    return torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))


def select_layers(found: list, layers: Iterable[int] | None) -> list:
    """``found`` restricted to the indices in ``layers`` (negative indices allowed)."""
    if layers is None:
        return list(found)
    if isinstance(layers, int):
        layers = [layers]
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not -len(found) <= i < len(found):
            raise ValueError(
                f"layers contains {i!r}, but the model has {len(found)} attention layers "
                f"(valid indices 0 … {len(found) - 1}, or negative from the end)"
            )
        out.append(found[i])
    return out


def check_finite(name: str, t: torch.Tensor | None) -> None:
    if t is not None and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"{name} contains {bad} NaN/Inf values and this scheme reads it; re-create the "
            "model or reset that tensor before initialising"
        )


def check_options(fn: Callable, options: dict, what: str) -> None:
    """Raise TypeError naming unknown keyword options and listing the valid ones."""
    params = inspect.signature(fn).parameters
    valid = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"{what} got unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")


@dataclass
class Plan:
    """Tensors to write and impulse records to set, applied all at once by :meth:`commit`."""

    writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    records: list[tuple[nn.Module, dict | None]] = field(default_factory=list)

    def add(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, value in pairs:
            if tuple(dst.shape) != tuple(value.shape):
                raise RuntimeError(f"internal shape mismatch {tuple(value.shape)} → {tuple(dst.shape)}")
            self.writes.append((dst, value))

    def add_qk(self, adapter: AttentionAdapter, wq, wk, bq=None, bk=None, record: dict | None = None):
        self.add(adapter.qk_writes(wq, wk, bq, bk))
        self.records.append((adapter.module, record))

    def commit(self) -> None:
        with torch.no_grad():
            for dst, value in self.writes:
                dst.copy_(value.to(device=dst.device, dtype=dst.dtype))
        for module, record in self.records:
            if record is None:
                module.__dict__.pop(RECORD_ATTR, None)
            else:
                module.__dict__[RECORD_ATTR] = record
