"""A plain Vision Transformer with timm's module names and fused-qkv layout.

timm cannot be imported on every machine we support, so this is our own implementation; its
parameter names, shapes and numerics follow ``timm.models.vision_transformer`` so that a
state_dict loads into ``timm.create_model('vit_*', ...)`` with ``strict=True`` and an init
written by :mod:`structinit` on one model is valid on the other:

    patch_embed.proj   Conv2d(C, D, p, stride=p)          tokens row-major on the h×w grid
    cls_token          (1, 1, D)                           optional
    pos_embed          (1, N [+1], D)                      learned, or fixed 2-D sin-cos
    blocks[i].norm1 / attn.qkv / attn.proj / norm2 / mlp.fc1 / mlp.fc2
    norm | fc_norm     final LayerNorm (fc_norm with average pooling, as in timm)
    head               Linear(D, classes)

``attn.qkv`` is ``Linear(D, 3D)`` whose output is [q; k; v], heads contiguous in each third.
With ``pos_embed='rope'`` there is no ``pos_embed``: position is a rotation of q and k in every
layer (:mod:`structinit.models.rope`), and timm's counterparts are its Eva models instead.
Attention maps of this (or any) model come from :func:`structinit.attention_maps`.

The named entry points at the end are registered for :func:`structinit.create_model`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from structinit.functional.posembed import sincos_2d
from structinit.models.registry import register_presets
from structinit.models.rope import Rotary2d

LayerNorm = partial(nn.LayerNorm, eps=1e-6)  # timm's ViT norm


class PatchEmbed(nn.Module):
    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(
                f"img_size={img_size} is not a multiple of patch_size={patch_size}; "
                "choose sizes whose ratio is an integer"
            )
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != self.img_size:
            raise ValueError(
                f"input of spatial size {tuple(x.shape[-2:])} does not match img_size "
                f"{self.img_size}; resize the images or build the model with that img_size"
            )
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))  # (B, N, D)


def head_shape(dim: int, num_heads: int) -> tuple[int, float]:
    """(head_dim, softmax scale head_dim^−½) of ``num_heads`` heads splitting width ``dim``."""
    if dim % num_heads:
        raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
    return dim // num_heads, (dim // num_heads) ** -0.5


class Attention(nn.Module):
    """timm's multi-head self-attention (fused qkv); ``causal=True`` masks every key after
    the query (``is_causal`` of ``F.scaled_dot_product_attention``), for sequence models;
    ``rope`` rotates q and k by position (:class:`~structinit.models.rope.Rotary2d`)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, causal: bool = False,
                 rope: nn.Module | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.causal = causal
        self.head_dim, self.scale = head_shape(dim, num_heads)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)
        self.rope = rope

    def _qkv(self, x: torch.Tensor):
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, heads, N, head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        return (q, k, v) if self.rope is None else (self.rope(q), self.rope(k), v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=self.causal)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(x.shape[0], -1, q.shape[1] * q.shape[3])))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, causal: bool = False,
                 rope: nn.Module | None = None):
        super().__init__()
        self.norm1 = LayerNorm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias, causal=causal, rope=rope)
        self.ls1 = nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(nn.Module):
    """ViT for image classification.

    Args:
        img_size, patch_size, in_chans: input geometry; the token grid is (img/patch)².
        num_classes: size of the classification head (0 gives an identity head).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: transformer size.
        class_token: prepend a learned class token (timm's ``cls_token``).
        global_pool: ``'token'`` (class token) or ``'avg'`` (mean over patch tokens; timm then
            uses ``fc_norm`` instead of ``norm``).
        pos_embed: ``'learn'`` (timm's ``randn · 0.02``), ``'sincos'`` (fixed 2-D sin-cos,
            a frozen Parameter so that it is saved and loads into timm's learned slot) or
            ``'rope'`` (no embedding added: every attention layer rotates q and k by position,
            2-D axial RoPE with base ``rope_theta``).
        pos_embed_scale: multiplies the initial position embedding.
        no_embed_class: class token gets no position embedding (its row is absent).
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        class_token: bool = True,
        global_pool: str = "token",
        pos_embed: str = "learn",
        pos_embed_scale: float = 1.0,
        no_embed_class: bool = False,
        rope_theta: float = 100.0,
    ):
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool={global_pool!r}: expected 'token' or 'avg'")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg'")
        if pos_embed not in ("learn", "sincos", "rope"):
            raise ValueError(f"pos_embed={pos_embed!r}: expected 'learn', 'sincos' or 'rope'")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.embed_dim = self.num_features = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.no_embed_class = no_embed_class
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        n_pe = self.patch_embed.num_patches + (0 if no_embed_class else self.num_prefix_tokens)
        if pos_embed == "rope":
            self.pos_embed = None
        elif pos_embed == "sincos":
            table = torch.zeros(1, n_pe, embed_dim)
            table[0, n_pe - self.patch_embed.num_patches :] = sincos_2d(self.patch_embed.grid_size, embed_dim)
            self.pos_embed = nn.Parameter(table * pos_embed_scale, requires_grad=False)
        else:
            self.pos_embed = nn.Parameter(torch.randn(1, n_pe, embed_dim) * 0.02 * pos_embed_scale)
        self.pos_drop = nn.Dropout(0.0)
        self.patch_drop = nn.Identity()
        self.norm_pre = nn.Identity()
        head_dim = head_shape(embed_dim, num_heads)[0]
        rope = Rotary2d(self.patch_embed.grid_size, head_dim, rope_theta, self.num_prefix_tokens) if (
            pos_embed == "rope") else None
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, mlp_ratio, qkv_bias, rope=rope)
                                      for _ in range(depth)])
        use_fc_norm = global_pool == "avg"
        self.norm = nn.Identity() if use_fc_norm else LayerNorm(embed_dim)
        self.fc_norm = LayerNorm(embed_dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW must not decay (timm's convention): the position embedding and
        the class token, whose scale is part of the init."""
        return {"pos_embed", "cls_token"}

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is None:  # RoPE: position enters in every attention layer instead
            return x if self.cls_token is None else torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.cls_token is None:
            return x + self.pos_embed
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        if self.no_embed_class:
            return torch.cat([cls, x + self.pos_embed], dim=1)
        return torch.cat([cls, x], dim=1) + self.pos_embed

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_pre(self.patch_drop(self.pos_drop(self._pos_embed(self.patch_embed(x)))))
        return self.norm(self.blocks(x))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, self.num_prefix_tokens :].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return self.head(self.head_drop(self.fc_norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# ----------------------------------------------------------------------------- entry points
# Small-data models follow the 2024 paper: no class token, average pooling, fixed sin-cos PE.
_SMALL_DATA = dict(class_token=False, global_pool="avg", pos_embed="sincos")
_CPU = dict(mlp_ratio=2.0, num_classes=10, **_SMALL_DATA)  # CPU-scale: the CPU recipes train them on a few cores

# name → (settings, description); each becomes an entry point of the model registry.
PRESETS = {
    "vit_tiny_patch2_32": (
        dict(img_size=32, patch_size=2, embed_dim=192, depth=12, num_heads=3, num_classes=10, **_SMALL_DATA),
        "ViT-Ti/2 on 32×32 images (the 2024 paper's CIFAR model): 16×16 tokens, D 192, depth 12, 3 heads."),
    "vit_tiny_patch4_32": (
        dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3, num_classes=10, **_SMALL_DATA),
        "ViT-Ti/4 on 32×32 images: 8×8 tokens, D 192, depth 12, 3 heads."),
    "vit_small_patch4_32": (
        dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6, num_classes=10, **_SMALL_DATA),
        "ViT-S/4 on 32×32 images: 8×8 tokens, D 384, depth 12, 6 heads."),
    "vit_tiny_patch16_224": (
        dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
        "timm's ViT-Ti/16 (224, class token, learned PE): 14×14 tokens, D 192, depth 12, 3 heads."),
    "vit_base_patch16_224": (
        dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
        "timm's ViT-B/16 (224, class token, learned PE): 14×14 tokens, D 768, depth 12, 12 heads."),
    "vit_cpu_patch4_32": (
        dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, **_CPU),
        "The ``cpu-cifar`` model: 32×32 images, 8×8 tokens, D 128, depth 6, 4 heads, MLP ×2."),
    "vit_cpu_rope_patch4_32": (
        dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, **{**_CPU, "pos_embed": "rope"}),
        "The ``cpu-cifar`` model with 2-D axial RoPE in place of its sin-cos position embedding."),
    "vit_cpu_patch2_8": (
        dict(img_size=8, patch_size=2, in_chans=1, embed_dim=64, depth=4, num_heads=4, **_CPU),
        "The ``digits`` model: 8×8 grayscale images, 4×4 tokens, D 64, depth 4, 4 heads, MLP ×2."),
    "vit_cpu_patch2_32": (
        dict(img_size=32, patch_size=2, embed_dim=96, depth=4, num_heads=3, **_CPU),
        "The ``cpu-cifar16`` model: 32×32 images, 16×16 tokens (the paper's grid), D 96, depth 4, 3 heads, MLP ×2 "
        "(sized for 5k-image, 25-epoch runs on a CPU)."),
    "vit_micro_patch2_16": (
        dict(img_size=16, patch_size=2, embed_dim=32, depth=2, num_heads=2, **_CPU),
        "A test-size ViT: 16×16 images, 8×8 tokens, D 32, depth 2, 2 heads, MLP ×2."),
}
register_presets(globals(), VisionTransformer, PRESETS)
