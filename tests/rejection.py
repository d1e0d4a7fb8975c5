"""Checks that a rejected call names the problem and leaves the model bit-identical: no
partial writes, no changed requires_grad, no impulse record left behind."""

import pytest
import torch

RECORD = "structinit_impulse"


def _copy(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return type(v)(_copy(x) for x in v) if isinstance(v, (tuple, list)) else v  # a quantised layer's packed weights


def snapshot(model):
    return {
        "state": {k: _copy(v) for k, v in model.state_dict().items()},
        "grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "records": records(model),
    }


def records(model):
    """Impulse records by module name (copies)."""
    return {name: dict(getattr(m, RECORD)) for name, m in model.named_modules() if hasattr(m, RECORD)}


def bits(t):
    return t.reshape(-1).clone().view(torch.uint8) if t.is_floating_point() else t  # reshape: 0-d tensors too


def _same(v, old) -> bool:
    if isinstance(v, torch.Tensor):
        if v.dtype != old.dtype or v.shape != old.shape:
            return False
        return torch.equal(v.int_repr(), old.int_repr()) if v.is_quantized else torch.equal(bits(v), bits(old))
    if isinstance(v, (tuple, list)):
        return len(v) == len(old) and all(_same(a, b) for a, b in zip(v, old))
    return v == old


def assert_untouched(model, snap):
    state = model.state_dict()
    assert list(state) == list(snap["state"])
    for k, v in state.items():
        assert _same(v, snap["state"][k]), f"{k} was modified"
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
