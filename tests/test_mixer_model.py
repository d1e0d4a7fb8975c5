"""structinit's MLP-Mixer: timm's module names, the sizes the harness passes, and a token-mixing
MLP that carries the impulse shift of functional.mixer exactly as written."""

from __future__ import annotations

import torch

import structinit
from structinit.functional import impulse_matrix, token_mixing_impulse
from structinit.models import MlpMixer


def test_cpu_mixer_is_in_the_cpu_vit_size_class_and_takes_the_data_sizes():
    model = structinit.create_model("mixer_cpu_patch4_32")
    vit = structinit.create_model("vit_cpu_patch4_32")
    n_mixer, n_vit = (sum(p.numel() for p in m.parameters()) for m in (model, vit))
    assert 0.7 < n_mixer / n_vit < 1.5
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    mnist = structinit.create_model("mixer_cpu_patch4_32", num_classes=10, in_chans=1, img_size=28)
    assert mnist(torch.randn(2, 1, 28, 28)).shape == (2, 10) and mnist.blocks[0].mlp_tokens.fc1.in_features == 49


def test_state_dict_keys_are_timms():
    keys = set(MlpMixer(num_blocks=1).state_dict())
    assert keys == {"stem.proj.weight", "stem.proj.bias", "norm.weight", "norm.bias", "head.weight", "head.bias",
                    *(f"blocks.0.{m}.{p}" for m in ("norm1", "norm2") for p in ("weight", "bias")),
                    *(f"blocks.0.{m}.{fc}.{p}" for m in ("mlp_tokens", "mlp_channels") for fc in ("fc1", "fc2")
                      for p in ("weight", "bias"))}


def test_a_token_mixing_mlp_written_with_the_impulse_shifts_the_grid():
    model = MlpMixer(num_blocks=1, img_size=16, patch_size=4, embed_dim=32)  # 4×4 tokens, token MLP 16 wide
    block = model.blocks[0]
    with torch.no_grad():
        w1, b1, w2, b2 = token_mixing_impulse((4, 4), (1, -1), block.mlp_tokens.fc1.out_features)
        block.mlp_tokens.fc1.weight.copy_(w1), block.mlp_tokens.fc1.bias.copy_(b1)
        block.mlp_tokens.fc2.weight.copy_(w2), block.mlp_tokens.fc2.bias.copy_(b2)
        x = block.norm1(torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(0)))  # (B, N, D), LayerNorm'd
        mixed = block.mlp_tokens(x.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(mixed, impulse_matrix((4, 4), (1, -1)) @ x, rtol=0, atol=2e-4)
