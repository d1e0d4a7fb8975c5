r"""ConViT's gated positional self-attention (GPSA; d'Ascoli et al., 2021): the architectural
peer that an init-only locality bias should approach.

A GPSA head mixes a content softmax with a purely positional one
(:mod:`structinit.functional.gated` has the formula and computes it). The local init (its
``reset_parameters``) centres head h's positional Gaussian −α‖δ − c_h‖² + const on lattice point
c_h of a √H×√H grid (only ⌊√H⌋² heads get one when H is not a square, as in the published
code), starts the gate at g = 1 (σ(1) ≈ 0.73 of the weight on position) and the value
projection at the identity.

:class:`ConViT` is the structinit ViT with GPSA in its first ``local_up_to_layer`` blocks;
everything else (patch embedding, PE, MLPs, pooling, names) is the ViT's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from structinit.functional.gated import gated_mixture, gaussian_positional_weight, relative_positions
from structinit.models.registry import register_presets
from structinit.models.vit import PRESETS as VIT_PRESETS
from structinit.models.vit import VisionTransformer, head_shape
from structinit.utils import check_int, check_number


def head_centres(num_heads: int) -> list[tuple[float, float] | None]:
    """Per head, the (c_x, c_y) of its positional Gaussian, or None for heads beyond the
    ⌊√H⌋² lattice (ConViT leaves those at their default weights)."""
    k = math.isqrt(num_heads)
    centre = (k - 1) / 2 if k % 2 == 0 else k // 2
    out: list[tuple[float, float] | None] = [None] * num_heads
    for h1 in range(k):
        for h2 in range(k):
            out[h1 + k * h2] = (h2 - centre, h1 - centre)
    return out


class GPSA(nn.Module):
    """Gated positional self-attention on an h×w token grid (no prefix tokens)."""

    def __init__(self, dim: int, num_heads: int, grid: tuple[int, int], qkv_bias: bool = True,
                 locality_strength: float = 1.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim, self.scale = head_shape(dim, num_heads)
        self.grid = tuple(grid)
        self.locality_strength = check_number("locality_strength", locality_strength)
        self.qk = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.pos_proj = nn.Linear(3, num_heads)
        self.gating_param = nn.Parameter(torch.ones(num_heads))
        self.register_buffer("rel_indices", relative_positions(self.grid), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """ConViT's local init: V = I (zero bias), one Gaussian centre per head at strength α,
        gate 1. Runs after the children's own init (at construction, and in the ``pytorch``
        scheme, which resets children before parents)."""
        self.v.weight.copy_(torch.eye(self.v.in_features))
        if self.v.bias is not None:
            self.v.bias.zero_()
        self.pos_proj.bias.zero_()
        centres = head_centres(self.num_heads)
        centred = [h for h, centre in enumerate(centres) if centre is not None]
        w = self.pos_proj.weight
        w[centred] = gaussian_positional_weight([centres[h] for h in centred], device=w.device).to(w.dtype)
        self.pos_proj.weight.mul_(self.locality_strength)  # heads without a centre too, as published
        self.gating_param.fill_(1.0)

    def positional_probs(self) -> torch.Tensor:
        """(heads, N, N) softmax of the positional scores."""
        return self.pos_proj(self.rel_indices).permute(2, 0, 1).softmax(dim=-1)

    def mix(self, content: torch.Tensor) -> torch.Tensor:
        """The gated mixture of content probabilities (…, heads, N, N) with the positional
        ones, each row renormalised to sum to one."""
        return gated_mixture(content, self.positional_probs().to(content.dtype), self.gating_param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.rel_indices.shape[0]:
            raise ValueError(f"GPSA on a {self.grid[0]}×{self.grid[1]} grid got {x.shape[1]} tokens; "
                             "GPSA blocks take the grid tokens only (no class token)")
        b, n, _ = x.shape
        q, k = self.qk(x).reshape(b, n, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, heads, N, r)
        attn = self.mix((q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1))
        v = self.v(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        out = (attn @ v).transpose(1, 2).reshape(x.shape)
        return self.proj(out)


class ConViT(VisionTransformer):
    """The structinit ViT with GPSA in blocks ``0 … local_up_to_layer − 1`` (ConViT puts it in
    10 of 12). Takes every :class:`VisionTransformer` argument, plus ``local_up_to_layer`` and
    ``locality_strength``; GPSA blocks see grid tokens only, so there is no class token."""

    def __init__(self, *, local_up_to_layer: int = 10, locality_strength: float = 1.0, **kwargs):
        if kwargs.get("class_token", True) or kwargs.get("global_pool", "token") != "avg":
            raise ValueError("ConViT here pools by average (class_token=False, global_pool='avg'): "
                             "its GPSA blocks take the grid tokens only")
        super().__init__(**kwargs)
        check_int("local_up_to_layer", local_up_to_layer, low=0, high=len(self.blocks))
        qkv_bias = self.blocks[0].attn.qkv.bias is not None
        for blk in self.blocks[:local_up_to_layer]:
            blk.attn = GPSA(self.embed_dim, blk.attn.num_heads, self.patch_embed.grid_size, qkv_bias,
                            locality_strength)
        self.local_up_to_layer = local_up_to_layer


register_presets(globals(), ConViT, {
    "convit_cpu_patch4_32": ({**VIT_PRESETS["vit_cpu_patch4_32"][0], "local_up_to_layer": 5},
                             "The ``cpu-cifar`` ViT (D 128, depth 6, 4 heads, 8×8 tokens) with GPSA in its first 5 "
                             "blocks."),
    "convit_cpu_patch2_32": ({**VIT_PRESETS["vit_cpu_patch2_32"][0], "local_up_to_layer": 3},
                             "The ``cpu-cifar16`` ViT (D 96, depth 4, 3 heads, 16×16 tokens) with GPSA in its first 3 "
                             "blocks. With 3 heads only one gets a positional centre (⌊√3⌋² = 1), as in the published "
                             "code."),
})
