"""The plan/commit split that guarantees an error leaves the model bit-identical: a scheme
validates everything and computes every value into a :class:`Plan` first; only
:meth:`Plan.commit` touches the model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from structinit.adapters import AttentionAdapter
from structinit.schemes.records import set_record


@dataclass
class Plan:
    """What an init will do, applied all at once by :meth:`commit`, in this order:
    ``actions`` (callables that rewrite the model themselves, e.g. modules'
    ``reset_parameters``), then ``writes`` (destination tensor ← value), then ``records``
    (per-module notes of what was written; ``None`` clears one)."""

    writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    records: list[tuple[nn.Module, str, dict | None]] = field(default_factory=list)
    actions: list[Callable[[], None]] = field(default_factory=list)

    def add(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, value in pairs:
            if tuple(dst.shape) != tuple(value.shape):
                raise RuntimeError(f"internal shape mismatch {tuple(value.shape)} → {tuple(dst.shape)}")
            self.writes.append((dst, value))

    def pending(self, dst: torch.Tensor) -> torch.Tensor | None:
        """The last value planned for ``dst`` (the same tensor, or a view of the same memory with
        the same shape and strides), or None."""
        for t, value in reversed(self.writes):
            if t is dst or (t.data_ptr() == dst.data_ptr() and t.shape == dst.shape and t.stride() == dst.stride()):
                return value
        return None

    def add_qk(self, adapter: AttentionAdapter, wq, wk, bq=None, bk=None, record: dict | None = None) -> None:
        """Write a layer's q/k factors (see :meth:`AttentionAdapter.qk_writes`) and set or
        clear its impulse record: q/k written by anything but impulse make the old one stale."""
        self.add(adapter.qk_writes(wq, wk, bq, bk))
        self.records.append((adapter.module, "impulse", record))

    def commit(self) -> None:
        for action in self.actions:
            action()
        with torch.no_grad():
            for dst, value in self.writes:
                dst.copy_(value.to(device=dst.device, dtype=dst.dtype))
        for module, kind, record in self.records:
            set_record(module, kind, record)
