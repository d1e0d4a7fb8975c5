"""MLP-Mixer (Tolstikhin et al., 2021) with timm's module names, so state dicts load into
``timm.models.mlp_mixer.MlpMixer`` of the same configuration and back.

Each block mixes tokens, then channels, with pre-norm residual MLPs:

    x ← x + mlp_tokens(norm1(x)ᵀ)ᵀ      the token-mixing MLP: N → tokens_dim → N, shared by channels
    x ← x + mlp_channels(norm2(x))      the channel MLP: D → channels_dim → D

The token-mixing MLP is where position lives: it is the layer an impulse init writes a shift
of the token grid into (:func:`structinit.functional.token_mixing_impulse`).

    stem.proj          Conv2d(C, D, p, stride p)          patch embedding → (B, N, D)
    blocks[i]          .norm1 .mlp_tokens.{fc1, fc2} .norm2 .mlp_channels.{fc1, fc2}
    norm, head         LayerNorm(D), Linear(D, classes) on the mean over tokens
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.models.registry import register_presets
from structinit.models.vit import LayerNorm, Mlp, PatchEmbed

__all__ = ["MixerBlock", "MlpMixer"]


class MixerBlock(nn.Module):
    """Token mixing then channel mixing; ``mlp_ratio`` = (tokens_dim, channels_dim) / ``dim``."""

    def __init__(self, dim: int, seq_len: int, mlp_ratio: tuple[float, float] = (0.5, 4.0)):
        super().__init__()
        self.norm1 = LayerNorm(dim)
        self.mlp_tokens = Mlp(seq_len, int(mlp_ratio[0] * dim))
        self.norm2 = LayerNorm(dim)
        self.mlp_channels = Mlp(dim, int(mlp_ratio[1] * dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp_channels(self.norm2(x))


class MlpMixer(nn.Module):
    """(B, C, H, W) images → (B, num_classes) logits; global average pooling over tokens.

    Examples:
        >>> model = MlpMixer(num_classes=10, img_size=16, patch_size=4, num_blocks=2, embed_dim=32)
        >>> model(torch.zeros(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, img_size: int = 32, in_chans: int = 3, patch_size: int = 4,
                 num_blocks: int = 6, embed_dim: int = 128, mlp_ratio: tuple[float, float] = (0.5, 4.0)):
        super().__init__()
        self.num_classes, self.num_features = num_classes, embed_dim
        self.stem = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.blocks = nn.Sequential(*[MixerBlock(embed_dim, self.stem.num_patches, mlp_ratio)
                                      for _ in range(num_blocks)])
        self.norm = LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(self.stem(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x).mean(1))


register_presets(globals(), MlpMixer, {"mixer_cpu_patch4_32": (
    dict(num_classes=10, img_size=32, patch_size=4, num_blocks=6, embed_dim=128),
    "MLP-Mixer for 32×32 images at the ``cpu-cifar`` ViT's size class: patch 4 (8×8 = 64 tokens), D 128, 6 blocks, "
    "token MLP 64 wide, channel MLP 512 wide (≈ 0.9 M parameters)."),
})
