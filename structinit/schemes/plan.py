"""The plan/commit split that guarantees an error leaves the model bit-identical: a scheme
validates everything and computes every value into a :class:`Plan` first; only
:meth:`Plan.commit` touches the model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from structinit.adapters import AttentionAdapter
from structinit.schemes.records import get_record, set_record
from structinit.utils.state import ModuleState


@dataclass
class Plan:
    """What an init will do, applied all at once by :meth:`commit`, in this order:
    ``actions`` (callables that rewrite the model themselves, e.g. modules'
    ``reset_parameters``), then ``writes`` (destination tensor ← value), then ``records``
    (per-module notes of what was written; ``None`` clears one)."""

    writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    records: list[tuple[nn.Module, str, dict | None]] = field(default_factory=list)
    actions: list[Callable[[], None]] = field(default_factory=list)
    # The tensors the actions may write in place: saved before they run, restored if the commit fails.
    touched: list[torch.Tensor] = field(default_factory=list)
    # Run on the model as written; one that raises undoes the plan (commit; structinit.schemes.checks).
    checks: list[Callable[[], None]] = field(default_factory=list)
    # Layers the scheme left alone on purpose, (name, why), for the caller to report.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # What the scheme also set, in words, for the caller to report (e.g. talking-heads mixers).
    notes: list[str] = field(default_factory=list)
    # The model's buffers and tensor attributes before the plan: what the checks' forwards cache
    # is put back after the commit, written or undone (structinit.utils.state).
    state: ModuleState | None = None

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
        """Apply the plan; when an action or a check raises, restore every tensor written (the
        writes' destinations and ``touched``) and every record, and raise its error. An action
        that changes a module's structure (a parametrisation) is not undone."""
        saved = self._save() if self.checks or self.actions else None
        try:
            for action in self.actions:
                action()
            self._apply(self.writes, self.records)
            for check in self.checks:
                check()
        except BaseException:
            if saved is not None:
                self._apply(*saved)
            raise
        finally:
            if self.state is not None and self.checks:
                self.state.restore([*(dst for dst, _ in self.writes), *self.touched], drop_new=not self.actions)

    def _save(self):
        tensors, seen = [], set()
        for dst in [*(dst for dst, _ in self.writes), *self.touched]:
            key = (dst.data_ptr(), tuple(dst.shape), dst.stride())
            if key not in seen:
                seen.add(key)
                tensors.append((dst, dst.detach().clone()))
        records = [(module, kind, get_record(module, kind)) for module, kind, _ in self.records]
        return tensors, records[::-1]  # restored last-first, so the oldest state wins

    @staticmethod
    def _apply(writes, records) -> None:
        with torch.no_grad():
            for dst, value in writes:
                dst.copy_(value.to(device=dst.device, dtype=dst.dtype))
        for module, kind, record in records:
            set_record(module, kind, record)
