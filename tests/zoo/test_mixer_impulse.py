"""impulse on timm's own MLP-Mixer, with no hints: each token-mixing MLP is the shift of its tap."""

import pytest
import torch

import structinit
from structinit.functional import impulse_matrix

timm = pytest.importorskip("timm")


def test_timm_mixer_token_mlps_become_shifts():
    model = timm.create_model("mixer_s16_224", pretrained=False).eval()
    structinit.init_(model, "impulse", seed=0)
    x = torch.randn(1, 196, 512, generator=torch.Generator().manual_seed(0))
    for block in model.blocks:
        record = block.mlp_tokens.structinit_impulse
        assert record["grid"] == (14, 14)
        y = block.norm1(x)
        with torch.no_grad():
            mixed = block.mlp_tokens(y.transpose(1, 2)).transpose(1, 2)
        torch.testing.assert_close(mixed, impulse_matrix((14, 14), record["offset"]) @ y, rtol=0, atol=2e-3)
