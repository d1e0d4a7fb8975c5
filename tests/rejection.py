"""Checks that a rejected call names the problem and leaves the model bit-identical: no
partial writes, no changed requires_grad, no impulse record left behind."""

import pytest
import torch

RECORD = "structinit_impulse"


def snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "records": records(model),
    }


def records(model):
    """Impulse records by module name (copies)."""
    return {name: dict(getattr(m, RECORD)) for name, m in model.named_modules() if hasattr(m, RECORD)}


def bits(t):
    return t.reshape(-1).clone().view(torch.uint8) if t.is_floating_point() else t  # reshape: 0-d tensors too


def assert_untouched(model, snap):
    state = model.state_dict()
    assert list(state) == list(snap["state"])
    for k, v in state.items():
        old = snap["state"][k]
        assert v.dtype == old.dtype and v.shape == old.shape, k
        assert torch.equal(bits(v), bits(old)), f"{k} was modified"
    assert {k: p.requires_grad for k, p in model.named_parameters()} == snap["grad"]
    assert records(model) == snap["records"], "impulse records were set or cleared"


def check_rejected(model, call, exc, match):
    """``call(model)`` raises ``exc`` whose message matches ``match``, and the model is as it
    was. Returns the message."""
    snap = snapshot(model)
    with pytest.raises(exc, match=match) as info:
        call(model)
    assert_untouched(model, snap)
    return str(info.value)
