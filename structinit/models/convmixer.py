"""ConvMixer (Trockman & Kolter, "Patches Are All You Need?", TMLR 2023), as published in
locuslab/convmixer::

    stem:    z ← BN(GELU(Conv2d(c→h, kernel=p, stride=p)))
    block:   z ← z + BN(GELU(DepthwiseConv2d(h→h, kernel=k, groups=h, padding='same')))
             z ← BN(GELU(Conv2d(h→h, kernel=1)))          # no residual around the pointwise conv
    head:    AdaptiveAvgPool2d(1) → flatten → Linear(h→n)

Module names (chosen so the depthwise convs are easy to find; timm's ``blocks.{i}.0.fn.0`` is
positional): ``stem``, ``stem_act``, ``stem_norm``; ``blocks.{i}.dw`` (depthwise conv),
``blocks.{i}.dw_act``, ``blocks.{i}.dw_norm``, ``blocks.{i}.pw`` (1×1 conv), ``blocks.{i}.pw_act``,
``blocks.{i}.pw_norm``; ``pool``, ``head``. Every conv has a bias (:func:`convmixer_num_params`).

With ``channels_last`` (default True) the conv weights are stored channels-last at
construction and ``forward`` converts its input, which is faster for depthwise convs on CPU;
the output is the same up to float round-off.
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.models.registry import register_presets
from structinit.utils.checks import check_sizes


class ConvMixerBlock(nn.Module):
    """x ← x + dw_norm(dw_act(dw(x))); x ← pw_norm(pw_act(pw(x))). Shape (B, h, H, W) kept."""

    def __init__(self, dim: int, kernel_size: int, act: type[nn.Module] = nn.GELU):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, kernel_size, groups=dim, padding="same")
        self.dw_act, self.dw_norm = act(), nn.BatchNorm2d(dim)
        self.pw = nn.Conv2d(dim, dim, 1)
        self.pw_act, self.pw_norm = act(), nn.BatchNorm2d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dw_norm(self.dw_act(self.dw(x)))
        return self.pw_norm(self.pw_act(self.pw(x)))


class ConvMixer(nn.Module):
    """ConvMixer-``dim``/``depth`` with kernel ``kernel_size`` and patch ``patch_size``: input
    (B, in_chans, H, W) → logits (B, num_classes); the blocks run at (H/p, W/p)."""

    def __init__(self, dim: int, depth: int, kernel_size: int, patch_size: int, num_classes: int = 1000,
                 in_chans: int = 3, act: type[nn.Module] = nn.GELU, channels_last: bool = True):
        super().__init__()
        check_sizes(dim=dim, depth=depth, kernel_size=kernel_size, patch_size=patch_size, num_classes=num_classes,
                    in_chans=in_chans)
        self.num_classes, self.embed_dim, self.depth = num_classes, dim, depth
        self.kernel_size, self.patch_size, self.channels_last = kernel_size, patch_size, bool(channels_last)
        self.stem = nn.Conv2d(in_chans, dim, patch_size, stride=patch_size)
        self.stem_act, self.stem_norm = act(), nn.BatchNorm2d(dim)
        self.blocks = nn.Sequential(*(ConvMixerBlock(dim, kernel_size, act) for _ in range(depth)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(dim, num_classes)
        if self.channels_last:
            self.to(memory_format=torch.channels_last)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.blocks(self.stem_norm(self.stem_act(self.stem(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.forward_features(x)).flatten(1))


def convmixer_num_params(dim: int, depth: int, kernel_size: int, patch_size: int, num_classes: int,
                         in_chans: int = 3) -> int:
    """The published count: c·h·p² + 3h (stem conv, bias, BN) + d·(hk² + h² + 6h) + hn + n."""
    h, k, p = dim, kernel_size, patch_size
    return in_chans * h * p * p + 3 * h + depth * (h * k * k + h * h + 6 * h) + h * num_classes + num_classes


# name → (settings, description); each becomes an entry point of the model registry.
PRESETS = {
    "convmixer_256_8": (dict(dim=256, depth=8, kernel_size=5, patch_size=2, num_classes=10),
                        "ConvMixer-256/8, k 5, p 2, 10 classes: the convmixer-cifar10 model (0.594 M params)."),
    "convmixer_cpu_128_6": (
        dict(dim=128, depth=6, kernel_size=5, patch_size=2, num_classes=10),
        "ConvMixer-128/6, k 5, p 2, 10 classes (0.125 M params), sized for 25-epoch runs on 5,000 32×32 images "
        "on a CPU."),
    "convmixer_1536_20": (dict(dim=1536, depth=20, kernel_size=9, patch_size=7, num_classes=1000),
                          "ConvMixer-1536/20, k 9, p 7, ImageNet (51.63 M params)."),
    "convmixer_768_32": (dict(dim=768, depth=32, kernel_size=7, patch_size=7, num_classes=1000, act=nn.ReLU),
                         "ConvMixer-768/32, k 7, p 7, ImageNet, ReLU as in the released checkpoint (21.11 M params)."),
    "convmixer_1024_20_ks9_p14": (dict(dim=1024, depth=20, kernel_size=9, patch_size=14, num_classes=1000),
                                  "ConvMixer-1024/20, k 9, p 14, ImageNet (24.38 M params)."),
}


def _build(img_size: int | None = None, **settings) -> ConvMixer:
    return ConvMixer(**settings)  # ConvMixer works at any resolution; create_model passes img_size


register_presets(globals(), _build, PRESETS)
