"""init_(mixer, "impulse"): every token-mixing MLP becomes the shift of its recorded tap, from a
seed, bit-identically, and bad input changes nothing."""

from __future__ import annotations

import pytest
import torch

import structinit
from rejection import check_rejected
from structinit.functional import impulse_matrix
from structinit.models import MlpMixer


def _mixed(block, x):
    return block.mlp_tokens(x.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("mlp_ratio", [(0.5, 4.0), (1.0, 4.0)])  # hidden = N (margin route), hidden = 2N (exact)
def test_every_token_mlp_is_the_shift_of_its_recorded_tap(mlp_ratio):
    model = structinit.create_model("mixer_cpu_patch4_32", mlp_ratio=mlp_ratio)
    structinit.init_(model, "impulse", seed=3)
    x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0))
    offsets = []
    for block in model.blocks:
        record = block.mlp_tokens.structinit_impulse
        assert record["grid"] == (8, 8) and record["kernel_size"] == 3
        offsets.append(record["offset"])
        y = block.norm1(x)
        with torch.no_grad():
            torch.testing.assert_close(_mixed(block, y), impulse_matrix((8, 8), record["offset"]) @ y,
                                       rtol=0, atol=2e-4)
    assert len(set(offsets)) > 1  # random taps, one per layer


def test_enumerated_taps_and_bit_identical_seeds():
    a, b = (structinit.create_model("mixer_cpu_patch4_32") for _ in range(2))  # other channel-MLP weights
    structinit.init_(a, "impulse", seed=5)
    structinit.init_(b, "impulse", seed=5)
    tokens = [k for k in a.state_dict() if ".mlp_tokens." in k]
    assert len(tokens) == 24 and all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in tokens)
    structinit.init_(a, "impulse", offsets="enumerated")
    assert [blk.mlp_tokens.structinit_impulse["offset"] for blk in a.blocks] == [
        (0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1)]
    assert structinit.schemes("token_mixing") == ["impulse", "mimetic"]


@pytest.mark.parametrize("options, match", [
    (dict(offsets="spiral"), "offsets"),
    (dict(kernel_size=4), "kernel_size"),
    (dict(margin=0.0), "margin"),
])
def test_bad_options_change_nothing(options, match):
    check_rejected(structinit.create_model("mixer_cpu_patch4_32"),
                   lambda m: structinit.init_(m, "impulse", seed=0, **options), ValueError, match)


def test_a_token_mlp_narrower_than_the_grid_is_refused_before_writing():
    model = MlpMixer(img_size=16, patch_size=2, embed_dim=32, num_blocks=2)  # 64 tokens, token MLP 16 wide
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"hidden=16: .* at least N = 64")
