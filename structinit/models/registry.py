"""Named model presets, built by :func:`create_model` (timm-style names)."""

from __future__ import annotations

from typing import Any

from structinit.models.vit import VisionTransformer

# Small-data presets follow the 2024 paper: no class token, average pooling, fixed sin-cos PE.
_SMALL_DATA = dict(class_token=False, global_pool="avg", pos_embed="sincos")

PRESETS: dict[str, dict[str, Any]] = {
    "vit_tiny_patch2_32": dict(img_size=32, patch_size=2, embed_dim=192, depth=12, num_heads=3,
                               num_classes=10, **_SMALL_DATA),
    "vit_tiny_patch4_32": dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3,
                               num_classes=10, **_SMALL_DATA),
    "vit_small_patch4_32": dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6,
                                num_classes=10, **_SMALL_DATA),
    "vit_tiny_patch16_224": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_base_patch16_224": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # CPU-scale presets for this project's 2-core machines.
    "vit_cpu_patch4_32": dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4,
                              mlp_ratio=2.0, num_classes=10, **_SMALL_DATA),
    "vit_cpu_patch2_8": dict(img_size=8, patch_size=2, in_chans=1, embed_dim=64, depth=4,
                             num_heads=4, mlp_ratio=2.0, num_classes=10, **_SMALL_DATA),
    "vit_micro_patch2_16": dict(img_size=16, patch_size=2, embed_dim=32, depth=2, num_heads=2,
                                mlp_ratio=2.0, num_classes=10, **_SMALL_DATA),
}


def list_models() -> list[str]:
    """Names accepted by :func:`create_model`."""
    return sorted(PRESETS)


def create_model(name: str, **overrides: Any) -> VisionTransformer:
    """Build the preset ``name``; keyword arguments override its settings (any
    :class:`~structinit.models.vit.VisionTransformer` argument)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(list_models())}")
    return VisionTransformer(**{**PRESETS[name], **overrides})
