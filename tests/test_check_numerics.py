"""The checks' numerics: masks written as the dtype's lowest float are closed pairs (they once
overflowed a row's mean into NaN, and a tolerance built from it raised), and a mimetic write with
no diagonal to measure is still checked, against the maps of the q kᵀ written."""

import importlib

import torch

import structinit
from structinit.adapters.verify import _rows_centred


def test_rows_centred_treats_the_lowest_float_as_a_closed_pair():
    low = torch.finfo(torch.float32).min
    logits = torch.tensor([[1.0, 2.0, low, low], [3.0, low, 5.0, float("-inf")]])
    centred = _rows_centred(logits)
    assert torch.isfinite(centred).all()
    torch.testing.assert_close(centred, torch.tensor([[-0.5, 0.5, 0.0, 0.0], [-1.0, 0.0, 1.0, 0.0]]))


def test_a_mimetic_write_with_no_diagonal_to_measure_is_checked_against_the_written_maps(monkeypatch):
    checks = importlib.import_module("structinit.schemes.checks")
    seen = []
    same = checks._check_same_maps
    monkeypatch.setattr(checks, "_check_same_maps", lambda name, *a: (seen.append(name), same(name, *a)))
    model = structinit.create_model("vit_micro_patch2_16", depth=2)
    structinit.init_(model, "mimetic", seed=0, alpha=1.0, beta=0.0)  # β = 0: noise alone, no diagonal
    assert seen == ["blocks.0.attn", "blocks.1.attn"]
    seen.clear()
    structinit.init_(model, "mimetic", seed=0)  # the default β: a diagonal to measure, no fallback
    assert seen == []
