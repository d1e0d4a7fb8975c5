"""Impulse's claim, each head's argmax on its target, holds in the model's own forward or the
init is refused: a causal layer cannot attend to a target after its query, and q/k that do not
put a head's argmax on its target are undone, not reported as written."""

import importlib

import pytest

import structinit
from rejection import assert_untouched, check_rejected, snapshot


def _causal_vit():
    model = structinit.create_model("vit_micro_patch2_16", depth=2)
    for block in model.blocks:
        block.attn.causal = True  # each token attends to itself and the tokens before it
    return model


def test_a_causal_layer_is_refused_offsets_after_the_query_and_takes_those_before_it():
    message = check_rejected(_causal_vit(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                             r"layer 'blocks\.0\.attn' .* at offset \(\d+, -?\d+\): the layer is causal.*offsets=")
    assert "nothing was written" in message
    model = _causal_vit()
    heads = model.blocks[0].attn.num_heads
    structinit.init_(model, "impulse", seed=0, offsets=[(-1, -1), (-1, 0), (0, -1), (0, 0)][:heads])
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


def test_q_and_k_that_miss_a_heads_target_are_undone_not_reported_written(monkeypatch):
    """With the causal pre-check out of the way, the solver's q/k for a target after the query
    cannot put the argmax there (the model masks it): the check after the write names the head
    and undoes the write, where it once reported success."""
    impulse = importlib.import_module("structinit.schemes.impulse")

    monkeypatch.setattr(impulse, "_check_causal_targets", lambda placed: None)
    model = _causal_vit()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"put head \d's argmax on its target offset .* in only \d+%.*undone"):
        structinit.init_(model, "impulse", seed=0, offsets=[(1, 1)] * model.blocks[0].attn.num_heads)
    assert_untouched(model, before)
