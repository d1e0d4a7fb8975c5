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


def test_timm_mixer_takes_mimetic_and_shows_its_maps():
    """mimetic with no hints: each token map is αZ + βI, read back through the channel-averaged
    Jacobian on real-sized input (timm's token MLP is 256 wide for 196 tokens: the margin route)."""
    from structinit.analysis.token_mixing import token_mixing_maps

    model = timm.create_model("mixer_s16_224", pretrained=False).eval()
    structinit.init_(model, "mimetic", seed=0)
    g = torch.Generator().manual_seed(0)
    expected = 0.7 * torch.randn(196, 196, generator=g, dtype=torch.float64) / 14 + 0.7 * torch.eye(196)
    (first,) = token_mixing_maps(model, torch.randn(1, 3, 224, 224), layers=[0])
    torch.testing.assert_close(first.double(), expected, rtol=0, atol=1e-4)
