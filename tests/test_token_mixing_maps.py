"""The token-mixing map of a Mixer block: the channel-averaged Jacobian of its token MLP, which
for the impulse init is the shift matrix of the layer's tap."""

import pytest
import torch

import structinit
from structinit.analysis.token_mixing import token_mixing_fidelity, token_mixing_maps
from structinit.models import MlpMixer


def images(n=2, size=32):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def test_the_map_is_the_jacobian_averaged_over_every_channel_and_image():
    torch.manual_seed(0)
    model = structinit.init_(MlpMixer(img_size=8, patch_size=2, num_blocks=2, embed_dim=8), "timm", seed=0).eval()
    mlp, seen = model.blocks[1].mlp_tokens, {}
    hook = mlp.register_forward_pre_hook(lambda m, a: seen.update(x=a[0].detach()))
    (ours,) = token_mixing_maps(model, images(2, 8), layers=[1])
    hook.remove()
    rows = seen["x"].reshape(-1, seen["x"].shape[-1])  # (images · channels, N) = (16, 16)
    jacobians = torch.stack([torch.autograd.functional.jacobian(mlp, row) for row in rows])
    torch.testing.assert_close(ours, jacobians.mean(0), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens_ratio, route", [(0.5, "margin: hidden = N"), (1.0, "exact: hidden = 2N")])
def test_impulse_maps_are_the_shift_matrix_on_any_input(tokens_ratio, route):
    torch.manual_seed(0)
    model = structinit.create_model("mixer_cpu_patch4_32", mlp_ratio=(tokens_ratio, 4.0))
    structinit.init_(model, "impulse", seed=0)
    for maps in (token_mixing_maps(model), token_mixing_maps(model, images())):
        for block, m in zip(model.blocks, maps):
            record = structinit.get_record(block.mlp_tokens)
            s = structinit.impulse_matrix(record["grid"], record["offset"])
            torch.testing.assert_close(m, s, atol=1e-5, rtol=0, msg=route)
    fid = token_mixing_fidelity(model, images())
    assert torch.equal(fid["hit"], torch.ones(6)) and torch.allclose(fid["mass"], torch.ones(6), atol=1e-5)


def test_fidelity_without_a_record_names_the_layer():
    model = structinit.init_(structinit.create_model("mixer_cpu_patch4_32"), "timm", seed=0)
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp_tokens.*no impulse record"):
        token_mixing_fidelity(model)


@pytest.mark.parametrize("tokens_ratio", [0.5, 1.0], ids=["margin: hidden = N", "exact: hidden = 2N"])
def test_mimetic_token_maps_equal_their_formula(tokens_ratio):
    """Layer i holds A_i = αZ_i + βI, Z_i the i-th N(0, 1/N) draw of the seed's generator, to 1e-5."""
    torch.manual_seed(0)
    model = structinit.create_model("mixer_cpu_patch4_32", mlp_ratio=(tokens_ratio, 4.0))
    structinit.init_(model, "impulse", seed=0)  # its records must not survive mimetic
    structinit.init_(model, "mimetic", seed=3, alpha=0.5, beta=0.9)
    g = torch.Generator().manual_seed(3)
    # on images the margin route is within GELU's tail (≈ 1e-5 on noise images), the exact one exact
    on_images = 1e-5 if tokens_ratio == 1.0 else 1e-4
    for block, m, seen in zip(model.blocks, token_mixing_maps(model), token_mixing_maps(model, images())):
        a = 0.5 * torch.randn(64, 64, generator=g, dtype=torch.float64) / 8 + 0.9 * torch.eye(64)
        torch.testing.assert_close(m.double(), a, rtol=0, atol=1e-5)
        torch.testing.assert_close(seen.double(), a, rtol=0, atol=on_images)
        assert structinit.get_record(block.mlp_tokens) is None
    with pytest.raises(ValueError, match="alpha"):
        structinit.init_(model, "mimetic", alpha=float("nan"))


def test_impulse_fidelity_on_a_mixer_points_to_the_token_mixing_measure():
    mixer = MlpMixer(img_size=16, patch_size=4, num_blocks=2, embed_dim=16)
    with pytest.raises(ValueError, match=r"MlpMixer has no attention layer: it mixes its tokens with MLPs .*"
                                         r"token_mixing_fidelity\(model, images\)"):
        structinit.impulse_fidelity(mixer, torch.randn(2, 3, 16, 16))
