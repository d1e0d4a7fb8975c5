"""The checks' numerics: masks written as the dtype's lowest float are closed pairs (they once
overflowed a row's mean into NaN, and a tolerance built from it raised), and a mimetic write on
plain attention is checked against the maps of the q kᵀ written."""

import importlib

import torch

import structinit
from structinit.adapters import TokenLayout
from structinit.adapters.logit_transforms import _rows_centred
from structinit.schemes.checks import _hit_rates


def test_rows_centred_treats_the_lowest_float_as_a_closed_pair():
    low = torch.finfo(torch.float32).min
    logits = torch.tensor([[1.0, 2.0, low, low], [3.0, low, 5.0, float("-inf")]])
    centred = _rows_centred(logits)
    assert torch.isfinite(centred).all()
    torch.testing.assert_close(centred, torch.tensor([[-0.5, 0.5, 0.0, 0.0], [-1.0, 0.0, 1.0, 0.0]]))


def test_hit_rates_count_each_heads_open_rows_with_a_target():
    # A 2×2 grid after one class token; head 0 targets (0, 1), head 1 (1, 0).
    layout, offsets = TokenLayout((2, 2), num_prefix_tokens=1), [(0, 1), (1, 0)]
    probs = torch.zeros(1, 2, 5, 5)
    probs[0, 0, 1, 2] = probs[0, 0, 3, 4] = 1  # head 0: both rows with a target hit it
    probs[0, 1, 1, 3] = 1                       # head 1: grid token 0 hits grid token 2 ...
    probs[0, 1, 2, 0] = 1                       # ... grid token 1 puts its argmax on the class token
    assert _hit_rates(probs, None, layout, offsets) == [1.0, 0.5]
    open_pairs = torch.ones(1, 1, 5, 5, dtype=torch.bool)  # one mask for every head
    open_pairs[0, 0, 2, 4] = False  # the call masks grid token 1's target: no row to count
    assert _hit_rates(probs, open_pairs, layout, offsets) == [1.0, 1.0]
    open_pairs[0, 0, 1, 2] = open_pairs[0, 0, 3, 4] = open_pairs[0, 0, 1, 3] = False
    assert _hit_rates(probs, open_pairs, layout, offsets) == [1.0, 1.0]  # nothing left to count: no miss


def test_a_mimetic_write_on_plain_attention_is_checked_against_the_written_maps(monkeypatch):
    """Plain attention (its maps were those of the q kᵀ read before the write) must make the maps
    of the q kᵀ written, with a diagonal to measure or none (β = 0): a diagonal as strong as the
    one written would pass a layer that rescales q kᵀ behind the parameters written."""
    checks = importlib.import_module("structinit.schemes.checks")
    seen = []
    same = checks._check_same_maps
    monkeypatch.setattr(checks, "_check_same_maps", lambda name, *a: (seen.append(name), same(name, *a)))
    model = structinit.create_model("vit_micro_patch2_16", depth=2)
    structinit.init_(model, "mimetic", seed=0, alpha=1.0, beta=0.0)  # β = 0: noise alone, no diagonal
    assert seen == ["blocks.0.attn", "blocks.1.attn"]
    seen.clear()
    structinit.init_(model, "mimetic", seed=0)  # the default β: a diagonal, and still the maps written
    assert seen == ["blocks.0.attn", "blocks.1.attn"]
