"""Swin Transformer (Liu et al., 2021) with timm's module names and layout, so state dicts load
into ``timm.models.swin_transformer.SwinTransformer`` of the same configuration and back.

Attention runs inside non-overlapping Wh×Ww windows of an NHWC feature map; every second block
of a stage rolls the map by half a window first, so information crosses window borders. After
the roll, a window can hold tokens from up to four regions that are not neighbours in the
image: the shifted-window mask adds −100 to the logits between different regions. Position
lives in a learned relative bias per head, ``table[index[i, j], h]``, where ``index`` is
timm's ``relative_position_index`` (:func:`structinit.functional.relative_position_index`):

    patch_embed.proj, .norm   Conv2d(C, D, p, stride p), LayerNorm(D)   → (B, H, W, D)
    layers[i].downsample      Identity for stage 0; PatchMerging .norm(4D) .reduction(4D → 2D, no bias)
    layers[i].blocks[j]       .norm1 .attn.{qkv, proj, relative_position_bias_table} .norm2 .mlp.{fc1, fc2}
                              (buffers attn.relative_position_index and attn_mask are not saved)
    norm, head.fc             LayerNorm on the last stage's map, Linear on its mean over H, W

A window as large as the map is shrunk to the map and its block does not shift, as in timm.
The attention is timm's non-fused path written out (plain matmul and softmax), so the bias and
mask a layer adds can be read off its code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from structinit.functional.relative import relative_position_index
from structinit.models.registry import register_presets
from structinit.models.vit import Mlp, PatchEmbed, head_shape

__all__ = ["PatchMerging", "SwinTransformer", "SwinTransformerBlock", "SwinTransformerStage", "WindowAttention",
           "shifted_window_mask",
           "window_partition", "window_reverse"]

MASK_LOGIT = -100.0  # timm's (and the paper's) logit term between different regions of a shifted window


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


def window_partition(x: torch.Tensor, window_size: tuple[int, int]) -> torch.Tensor:
    """(B, H, W, C) → (B·windows, Wh, Ww, C), windows row-major over the map, then the images."""
    b, h, w, c = x.shape
    wh, ww = window_size
    x = x.view(b, h // wh, wh, w // ww, ww, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, wh, ww, c)


def window_reverse(windows: torch.Tensor, window_size: tuple[int, int], h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`window_partition`: (B·windows, Wh, Ww, C) → (B, H, W, C)."""
    wh, ww = window_size
    x = windows.view(-1, h // wh, w // ww, wh, ww, windows.shape[-1])
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, h, w, windows.shape[-1])


def shifted_window_mask(resolution: tuple[int, int], window_size: tuple[int, int], shift_size: tuple[int, int],
                        dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor | None:
    """(windows, N, N) logit terms of a shifted-window block, N = Wh·Ww: 0 between tokens of one
    region of the rolled (and padded) map, −100 across regions; None without a shift.

    The regions are timm's: the rolled map is cut at H − Wh and H − shift (and likewise along W),
    so tokens that wrapped around the border do not attend to those they now sit beside.
    """
    if not any(shift_size):
        return None
    (wh, ww), (sh, sw) = window_size, shift_size
    h, w = -(-resolution[0] // wh) * wh, -(-resolution[1] // ww) * ww  # padded to whole windows
    labels = torch.zeros(1, h, w, 1, dtype=dtype, device=device)
    count = 0
    # timm's slices, verbatim: with a zero shift on one axis the last slice covers it all (one band)
    for rows in (slice(0, -wh), slice(-wh, -sh), slice(-sh, None)):
        for cols in (slice(0, -ww), slice(-ww, -sw), slice(-sw, None)):
            labels[:, rows, cols, :] = count
            count += 1
    labels = window_partition(labels, window_size).view(-1, wh * ww)
    diff = labels.unsqueeze(1) - labels.unsqueeze(2)
    return diff.masked_fill(diff != 0, MASK_LOGIT).masked_fill(diff == 0, 0.0)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside one window, with a learned relative position bias.

    ``forward(x, mask)``: x (windows·B, Wh·Ww, D), mask (windows, N, N) or None; each head
    computes softmax(q·scale·kᵀ + table[index] + mask)·v.
    """

    def __init__(self, dim: int, num_heads: int, window_size: tuple[int, int], qkv_bias: bool = True):
        super().__init__()
        self.dim, self.num_heads = dim, num_heads
        self.head_dim, self.scale = head_shape(dim, num_heads)
        self.window_size = _pair(window_size)
        wh, ww = self.window_size
        self.window_area = wh * ww
        self.relative_position_bias_table = nn.Parameter(torch.empty((2 * wh - 1) * (2 * ww - 1), num_heads))
        # derived from window_size, so not saved (timm's is not either: strict loads need the same keys)
        self.register_buffer("relative_position_index", relative_position_index(wh, ww), persistent=False)
        self.qkv = nn.Linear(dim, 3 * num_heads * self.head_dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(num_heads * self.head_dim, dim)
        self.proj_drop = nn.Dropout(0.0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm's table init, trunc-normal std 0.02. Only the table: the ``pytorch`` scheme runs
        this after qkv's and proj's own resets, which it must not undo."""
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def relative_position_bias(self) -> torch.Tensor:
        """(1, heads, N, N): the logit term ``table[index[i, j], h]``."""
        n = self.window_area
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (windows·B, heads, N, head_dim)
        attn = (q * self.scale) @ k.transpose(-2, -1) + self.relative_position_bias()
        if mask is not None:  # the batch is image-major: windows repeat every mask.shape[0] rows
            nw = mask.shape[0]
            attn = (attn.view(-1, nw, self.num_heads, n, n) + mask[None, :, None]).view(-1, self.num_heads, n, n)
        x = self.attn_drop(attn.softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, -1)))


class SwinTransformerBlock(nn.Module):
    """Pre-norm (shifted-)window attention then MLP on a (B, H, W, D) map of ``input_resolution``."""

    def __init__(self, dim: int, input_resolution: tuple[int, int], num_heads: int,
                 window_size: int | tuple[int, int] = 7, shift_size: int | tuple[int, int] = 0,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True):
        super().__init__()
        self.dim, self.input_resolution = dim, _pair(input_resolution)
        window, shift = _pair(window_size), _pair(shift_size)
        if not all(0 <= s < w for s, w in zip(shift, window)):
            raise ValueError(f"shift_size={shift_size} must lie in [0, window_size) for window_size={window_size}")
        # as timm: a window at least as large as the map shrinks to it, and there is nothing to roll
        self.window_size = tuple(min(r, w) for r, w in zip(self.input_resolution, window))
        self.shift_size = tuple(0 if r <= w else s for r, w, s in zip(self.input_resolution, window, shift))
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, self.window_size, qkv_bias)
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.drop_path2 = nn.Identity()
        # a buffer so it follows .to(device, dtype); not saved, as in timm
        self.register_buffer("attn_mask", shifted_window_mask(self.input_resolution, self.window_size,
                                                              self.shift_size), persistent=False)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        _, h, w, c = x.shape
        shifted = any(self.shift_size)
        if shifted:
            x = torch.roll(x, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2))
        wh, ww = self.window_size
        x = F.pad(x, (0, 0, 0, (ww - w % ww) % ww, 0, (wh - h % wh) % wh))  # whole windows (timm pads zeros)
        hp, wp = x.shape[1:3]
        windows = self.attn(window_partition(x, self.window_size).view(-1, wh * ww, c), mask=self.attn_mask)
        x = window_reverse(windows.view(-1, wh, ww, c), self.window_size, hp, wp)[:, :h, :w, :].contiguous()
        return torch.roll(x, shifts=self.shift_size, dims=(1, 2)) if shifted else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = x + self.drop_path1(self._attn(self.norm1(x)))
        x = x.reshape(b, -1, c)
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x.reshape(b, h, w, c)


class PatchMerging(nn.Module):
    """(B, H, W, D) → (B, ⌈H/2⌉, ⌈W/2⌉, out_dim): each 2×2 group concatenated (timm's order), normed, projected."""

    def __init__(self, dim: int, out_dim: int | None = None):
        super().__init__()
        self.dim, self.out_dim = dim, out_dim or 2 * dim
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, self.out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        h, w = x.shape[1:3]
        # channel order (column offset, row offset, C), as timm: its checkpoints depend on it
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class SwinTransformerStage(nn.Module):
    """Optional PatchMerging, then ``depth`` blocks alternating plain and shifted windows."""

    def __init__(self, dim: int, out_dim: int, input_resolution: tuple[int, int], depth: int, downsample: bool,
                 num_heads: int, window_size: tuple[int, int], mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        self.input_resolution = input_resolution
        self.output_resolution = tuple((r + 1) // 2 for r in input_resolution) if downsample else input_resolution
        if not downsample and dim != out_dim:
            raise ValueError(f"a stage without downsampling keeps its width: dim={dim} != out_dim={out_dim}")
        self.downsample = PatchMerging(dim, out_dim) if downsample else nn.Identity()
        shift = tuple(w // 2 for w in window_size)
        self.blocks = nn.Sequential(*[
            SwinTransformerBlock(out_dim, self.output_resolution, num_heads, window_size,
                                 0 if i % 2 == 0 else shift, mlp_ratio, qkv_bias) for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ClassifierHead(nn.Module):
    """timm's ``ClassifierHead`` with average pooling over an NHWC map: ``fc(mean over H, W)``."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.in_features = in_features
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(in_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(x.mean(dim=(1, 2))))


class SwinTransformer(nn.Module):
    """(B, C, H, W) images → (B, num_classes) logits; stage i works at width embed_dim·2^i on a
    map halved i times (stage 0 keeps the patch grid).

    Args:
        img_size, patch_size, in_chans: input geometry; the patch grid is (img/patch)².
        num_classes: size of the head (0 gives an identity ``head.fc``).
        embed_dim: width of stage 0.
        depths, num_heads: blocks and heads per stage.
        window_size: attention window (int or (Wh, Ww)), shrunk to any stage map smaller than it.
        mlp_ratio, qkv_bias: block size.
        weight_init: how the Linear weights start: ``"timm"`` (default) trunc-normal std 0.02
            with zero biases, timm's init of this model and its authors'; ``"pytorch"``
            PyTorch's Linear defaults, as this package's ViT and Mixer are built. Either way the
            relative bias tables start trunc-normal 0.02 and norms 1/0. A structured init
            writes only its own layers and keeps the rest as built, so this decides what it
            is added to.

    Examples:
        >>> model = SwinTransformer(img_size=16, patch_size=2, embed_dim=16, depths=(2, 2), num_heads=(1, 2),
        ...                         window_size=4, num_classes=10)
        >>> model(torch.zeros(2, 3, 16, 16)).shape
        torch.Size([2, 10])
        >>> [block.shift_size for block in model.layers[1].blocks]  # 4×4 map, one window: no shift
        [(0, 0), (0, 0)]
    """

    def __init__(self, img_size: int = 224, patch_size: int = 4, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 96, depths: tuple[int, ...] = (2, 2, 6, 2),
                 num_heads: tuple[int, ...] = (3, 6, 12, 24), window_size: int | tuple[int, int] = 7,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, weight_init: str = "timm"):
        super().__init__()
        if weight_init not in ("timm", "pytorch"):
            raise ValueError(f"weight_init={weight_init!r}: expected 'timm' (trunc-normal 0.02) or 'pytorch' "
                             "(PyTorch's Linear defaults)")
        if len(depths) != len(num_heads):
            raise ValueError(f"depths={tuple(depths)} and num_heads={tuple(num_heads)}: give one head count per stage")
        self.num_classes, self.global_pool = num_classes, "avg"
        self.num_layers, self.embed_dim = len(depths), embed_dim
        self.num_features = embed_dim * 2 ** (self.num_layers - 1)
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.patch_embed.norm = nn.LayerNorm(embed_dim)  # Swin normalises the patch embedding; ViT does not
        window, resolution, dim = _pair(window_size), self.patch_embed.grid_size, embed_dim
        stages = []
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            out_dim = embed_dim * 2 ** i
            stages.append(SwinTransformerStage(dim, out_dim, resolution, depth, i > 0, heads, window, mlp_ratio,
                                               qkv_bias))
            dim, resolution = out_dim, stages[-1].output_resolution
        self.layers = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(self.num_features)
        self.head = ClassifierHead(self.num_features, num_classes)
        if weight_init == "timm":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """timm's init (``init_weights_vit_timm``): every Linear trunc-normal std 0.02, zero bias.
        Not ``reset_parameters``: the ``pytorch`` scheme calls that on every module and must get
        PyTorch's Linear defaults."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW must not decay (timm's convention): the relative position bias tables."""
        return {name for name, _ in self.named_parameters() if name.endswith("relative_position_bias_table")}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) → the normed last-stage map (B, h, w, num_features)."""
        x = self.patch_embed(x).unflatten(1, self.patch_embed.grid_size)  # (B, N, D) → NHWC
        return self.norm(self.layers(x))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


register_presets(globals(), SwinTransformer, {"swin_cpu_patch2_32": (
    dict(num_classes=10, img_size=32, patch_size=2, embed_dim=48, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=4,
         mlp_ratio=2.0),
    "Swin for 32×32 images at the ``cpu-cifar`` ViT's size class: patch 2 (16×16 tokens), window 4, three stages of 2 "
    "blocks at D 48 / 96 / 192 on 16×16 / 8×8 / 4×4 maps with 2 / 4 / 8 heads (head dim 24), MLP ×2 (≈ 0.88 M "
    "parameters). The last stage's window covers its map, so neither of its blocks shifts."),
})
