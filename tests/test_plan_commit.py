"""Plan.commit: the model holds exactly the planned writes while its checks run and after, a
failed check leaves it bit-identical, and the plan's values come out unchanged either way,
whatever the writes alias: slices of one fused weight, a destination written twice or inside
another, a value that is the model's own memory, one value written twice."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from structinit.schemes.plan import Plan
from structinit.utils.state import ModuleState


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 6), nn.LayerNorm(6))


def _writes(model: nn.Module, kinds: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Writes of each kind: 0 a fresh value, 1 a slice of a fused weight from a slice of one fresh
    tensor, 2 another parameter's memory as the value, 3 a whole weight after its slice was written,
    4 one value object written to two destinations, 5 a non-contiguous view as the value."""
    g = torch.Generator().manual_seed(seed)
    fused, second, norm = model[0].weight, model[1].weight, model[2].weight
    pool = torch.randn(24, 6, generator=g)  # one tensor that several values slice
    shared = torch.randn(6, generator=g)
    out = []
    for i, kind in enumerate(kinds):
        if kind == 0:
            out.append((model[0].bias, torch.randn(12, generator=g)))
        elif kind == 1:
            rows = slice(0, 4) if i % 2 else slice(4, 8)
            out.append((fused[rows], pool[rows]))
        elif kind == 2:
            out.append((model[1].bias, norm.detach()))
        elif kind == 3:
            out += [(fused[:4], pool[8:12]), (fused, torch.randn(12, 6, generator=g))]
        elif kind == 4:
            out += [(model[2].bias, shared), (model[1].bias, shared)]
        else:
            out.append((second, torch.randn(12, 6, generator=g).T))
    return out


def _expected(model: nn.Module, writes) -> dict[str, torch.Tensor]:
    """The model's tensors after applying ``writes`` one after another, on a copy."""
    copy = {n: t.detach().clone() for n, t in model.state_dict().items()}
    by_storage = {t.untyped_storage().data_ptr(): n for n, t in model.state_dict().items()}
    for dst, value in writes:
        name = by_storage[dst.untyped_storage().data_ptr()]
        base = copy[name]
        base.as_strided(dst.shape, dst.stride(), dst.storage_offset() - model.state_dict()[name].storage_offset()
                        ).copy_(value)
    return copy


def _planned(model: nn.Module, writes, check) -> Plan:
    plan = Plan(state=ModuleState(model))
    plan.add(writes)
    plan.checks.append(check)
    return plan


@settings(max_examples=60, deadline=None)
@given(kinds=st.lists(st.integers(0, 5), min_size=1, max_size=6), fail=st.booleans(), seed=st.integers(0, 99))
def test_the_model_holds_the_plan_during_its_checks_and_is_restored_bit_for_bit_when_one_fails(kinds, fail, seed):
    model = _model()
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    writes = _writes(model, kinds, seed)
    values = [value.clone() for _, value in writes]
    want = _expected(model, writes)
    seen = []

    def check():
        now = model.state_dict()
        seen.append(all(torch.equal(now[n], want[n]) for n in want))
        if fail:
            raise RuntimeError("the check failed")

    plan = _planned(model, writes, check)
    if fail:
        with pytest.raises(RuntimeError, match="the check failed"):
            plan.commit()
    else:
        plan.commit()
    assert seen == [True], "while the checks ran, the model did not hold exactly the planned writes"
    after = model.state_dict()
    assert all(torch.equal(after[n], (before if fail else want)[n]) for n in before)
    assert all(torch.equal(value, kept) for (_, value), kept in zip(plan.writes, values)), \
        "a commit changed the plan's own values"


def test_a_plan_commits_the_same_weights_twice():
    model = _model()
    writes = _writes(model, [0, 1, 1, 3, 4], 7)
    kept = [(dst, value.clone()) for dst, value in writes]
    plan = _planned(model, writes, lambda: None)
    plan.commit()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    want = _expected(model, kept)
    plan.commit()
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())
