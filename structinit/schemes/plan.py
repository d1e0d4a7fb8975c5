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
from structinit.utils.state import ModuleState, derived_advice, own_precision, remade_storages


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

    def revise(self, dst: torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Plan ``change(value)`` for ``dst``, of the value last planned for it (the same tensor, or
        a view of the same memory with the same shape and strides), which it replaces, or of what
        ``dst`` holds: a later stage that reworks what an earlier one planned (the position
        reservation projects a mimetic value/output write)."""
        for i in range(len(self.writes) - 1, -1, -1):
            t, value = self.writes[i]
            if t is dst or (t.data_ptr() == dst.data_ptr() and t.shape == dst.shape and t.stride() == dst.stride()):
                self.writes[i] = (t, change(value))
                return
        self.add([(dst, change(dst))])

    def overwritten(self) -> int | None:
        """The index of a write that a later write of the plan changes, or None: one parameter that
        several layers share (one module in two blocks), each planning its own value for it, of
        which only the last would hold. Only writes whose memory overlaps another's are compared,
        applied in order to a scratch copy of that memory."""
        groups = _overlapping([_span(dst) for dst, _ in self.writes])
        scratch: dict[tuple, torch.Tensor] = {}

        def view(dst: torch.Tensor) -> torch.Tensor:
            key = (dst.untyped_storage().data_ptr(), dst.dtype)
            if key not in scratch:
                scratch[key] = torch.empty(0, dtype=dst.dtype, device=dst.device).set_(dst.untyped_storage()).clone()
            return scratch[key].as_strided(dst.shape, dst.stride(), dst.storage_offset())

        with torch.no_grad():
            for group in groups:
                for i in group:
                    view(self.writes[i][0]).copy_(self.writes[i][1])
                for i in group:
                    dst, value = self.writes[i]
                    if not torch.equal(view(dst), value.to(device=dst.device, dtype=dst.dtype)):
                        return i
        return None

    def add_qk(self, adapter: AttentionAdapter, wq, wk, bq=None, bk=None, record: dict | None = None) -> None:
        """Write a layer's q/k factors (see :meth:`AttentionAdapter.qk_writes`) and set or
        clear its impulse record: q/k written by anything but impulse make the old one stale."""
        self.add(adapter.qk_writes(wq, wk, bq, bk))
        self.records.append((adapter.module, "impulse", record))

    def check_held(self, model: nn.Module, what: str, held: set[int]) -> None:
        """ValueError, before anything is written, when a write goes to memory that is not ``held``
        (the storages of ``model``'s parameters, buffers and tensor attributes:
        :meth:`~structinit.utils.state.ModuleState.storages`) or that its forward makes anew (a weight
        computed from other parameters, as ``weight_norm`` does): the write would not last."""
        held = held - remade_storages(model)
        loose = next((dst for dst, _ in self.writes if dst.untyped_storage().data_ptr() not in held), None)
        if loose is None:
            return
        raise ValueError(
            f"{what} would write a {tuple(loose.shape)} tensor that is none of the model's parameters or buffers, or "
            "one its forward makes anew, so the write would not last; nothing was written. " + (derived_advice(model)
            or "An adapter reads the layer from a copy of its weights: register one that returns views of its "
            "parameters (structinit.register_adapter)"))

    @own_precision()
    def commit(self) -> None:
        """Apply the plan; when an action or a check raises, restore every tensor written (the
        writes' destinations and ``touched``) and every record, and raise its error. An action
        that changes a module's structure (a parametrisation) is not undone. The checks run in
        the model's own precision, whatever autocast the caller runs under."""
        guarded = bool(self.checks or self.actions)
        touched = _clones(self.touched) if guarded else []
        records = [(module, kind, get_record(module, kind)) for module, kind, _ in self.records][::-1]
        done: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (destination, what it held, exchanged)
        try:
            for action in self.actions:
                action()
            self._write(done if guarded else None)
            for module, kind, record in self.records:
                set_record(module, kind, record)
            for check in self.checks:
                check()
        except BaseException:
            if guarded:
                with torch.no_grad():
                    for dst, held, exchanged in reversed(done):
                        _exchange(dst, held) if exchanged else dst.copy_(held)
                    for dst, old in touched:
                        dst.copy_(old)
                for module, kind, record in records:  # last-first, so the oldest state wins
                    set_record(module, kind, record)
            raise
        else:
            with torch.no_grad():
                for dst, held, exchanged in done:
                    if exchanged:  # the plan's value back in the tensor that held the model's old one
                        held.copy_(dst)
        finally:
            if self.state is not None and self.checks:
                self.state.restore([*(dst for dst, _ in self.writes), *self.touched], drop_new=not self.actions)

    def _write(self, done: list | None) -> None:
        """Copy every value to its destination; with ``done``, keep what each destination held
        there first. A value that is the plan's own memory (not the model's, not any other write's)
        and a destination no other write overlaps are exchanged, element for element, instead of
        cloned: the value then keeps the old weights until the commit succeeds, and a large model
        is spared allocating (and faulting in) a second copy of every tensor it writes."""
        exchangeable = self._exchangeable() if done is not None else set()
        with torch.no_grad():
            for i, (dst, value) in enumerate(self.writes):
                if i in exchangeable:
                    _exchange(dst, value)
                    done.append((dst, value, True))
                    continue
                if done is not None:
                    done.append((dst, dst.detach().clone(), False))
                dst.copy_(value.to(device=dst.device, dtype=dst.dtype))

    def _exchangeable(self) -> set[int]:
        """Indices of the writes whose value and destination may be exchanged (see :meth:`_write`)."""
        if self.state is None:  # the model's memory is unknown: no value can be shown not to be the model's
            return set()
        model = self.state.storages()
        spans = [_span(dst) for dst, _ in self.writes] + [_span(value) for _, value in self.writes]
        crossed = {i for group in _overlapping(spans) for i in group}
        n = len(self.writes)
        return {i for i, (dst, value) in enumerate(self.writes)
                if i not in crossed and i + n not in crossed and spans[i + n][0] not in model
                and value.dtype == dst.dtype and value.device == dst.device and value.is_contiguous()
                and not value.requires_grad and value.numel() > 0}


def _clones(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, seen = [], set()
    for t in tensors:
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            out.append((t, t.detach().clone()))
    return out


def _overlapping(spans: list[tuple[int, int, int]]) -> list[list[int]]:
    """The indices of ``spans`` in chains of overlapping extents (two or more each), each chain
    in index order."""
    groups, group, reach = [], [], (-1, -1)
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        storage, first, last = spans[i]
        if (storage, first) > reach:
            groups.append(group := [])
            reach = (storage, last)
        group.append(i)
        reach = (storage, max(reach[1], last))
    return [sorted(g) for g in groups if len(g) > 1]


def check_no_overwrite(plan: Plan, model: nn.Module, what: str) -> None:
    """ValueError, before anything is written, when a write of ``plan`` would undo another
    (:meth:`Plan.overwritten`), naming the parameter and every name the model gives it."""
    i = plan.overwritten()
    if i is None:
        return
    ptr = plan.writes[i][0].untyped_storage().data_ptr()
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.untyped_storage().data_ptr() == ptr]
    said = (f"{names[0]!r}" + (f" (one parameter with {', '.join(map(repr, names[1:]))})" if names[1:] else "")
            if names else f"a {tuple(plan.writes[i][0].shape)} tensor")
    raise ValueError(f"{what} would write {said} twice with different values: layers that share a projection "
                     "each need their own, and only the last write would hold; "
                     "nothing was written. Give each layer its own copy of the shared module, or choose one of "
                     "them with layers=")


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, last byte) that ``t``'s elements can reach."""
    size = t.element_size()
    first = t.storage_offset() * size
    reach = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    return t.untyped_storage().data_ptr(), first, first + (reach + 1) * size - 1


_CHUNK = 1 << 18  # elements exchanged at a time, through one small buffer


def _exchange(a: torch.Tensor, b: torch.Tensor) -> None:
    """Swap the contents of ``a`` and ``b`` (same shape and dtype, no shared memory) in place,
    a slab of leading rows at a time."""
    if a.ndim == 0:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
    row = max(1, a[0].numel()) if len(a) else 1
    step = max(1, _CHUNK // row)
    scratch = torch.empty(min(len(a), step) * row, dtype=a.dtype, device=a.device)
    for i in range(0, len(a), step):
        x, y = a[i:i + step], b[i:i + step]
        held = scratch[: x.numel()].view(x.shape)
        held.copy_(x)
        x.copy_(y)
        y.copy_(held)
