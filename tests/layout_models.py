"""Models whose tokens reach their attention in layouts beyond one row per token of one image:
every image's patches packed into one sequence (a multimodal model's vision tower), a grid padded
and cut into windows before each windowed layer (SAM's ViT), and position the forward reads from
tables rather than adds (resized, gathered at position ids, a row and a column table summed).
Their attention is :mod:`attention_styles`'s, which records the maps its own forward formed."""

import math

import torch
import torch.nn.functional as F
from attention_styles import CutWindowsAttention, PackedAttention, RawLinearAttention
from torch import nn


class PackedTower(nn.Module):
    """A vision tower of a multimodal model: its forward takes every image's patches flattened and
    packed into one (ΣT, C·p·p) sequence, and ``grid_thw`` (images, 3), each image's (t, h, w)
    patch grid, from which it builds the position rows (a learned 8×8 table gathered per image)
    and the block-diagonal mask (:class:`PackedAttention`). No image size to build a probe from:
    only a caller knows how to call it."""

    def __init__(self, dim=48, heads=3, depth=2, patch=2):
        super().__init__()
        self.embed = nn.Linear(3 * patch * patch, dim)
        self.pos_embed = nn.Parameter(torch.randn(64, dim) * 0.02)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(PackedAttention(dim, heads) for _ in range(depth))

    def forward(self, hidden_states, grid_thw):
        sizes = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).tolist()
        rows = torch.cat([(torch.arange(h)[:, None] * 8 + torch.arange(w)).flatten().repeat(t)
                          for t, h, w in grid_thw.tolist()])
        x = (self.embed(hidden_states) + self.pos_embed[rows])[None]
        seqlens = torch.tensor([0, *sizes]).cumsum(0)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x), cu_seqlens=seqlens)
        return x[0]


class PaddedWindowViT(nn.Module):
    """SAM's image encoder in small: a learned (1, 8, 8, D) position embedding on an 8×8 grid of
    channels-last tokens; each block's tokens normalised, padded with zeros to whole
    ``window``×``window`` windows, cut into them before the attention call (:class:`CutWindowsAttention`)
    and put back after; the blocks in ``global_blocks`` attend over the whole grid instead."""

    def __init__(self, dim=48, heads=3, depth=3, window=3, global_blocks=(1,)):
        super().__init__()
        self.window, self.global_blocks = window, set(global_blocks)
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 8, 8, dim) * 0.02)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(CutWindowsAttention(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def windows(self, x):
        """(B, 8, 8, D) → (B·windows, w, w, D), the grid padded with zeros to whole windows."""
        b, h, _, d = x.shape
        s, pad = self.window, (-h) % self.window
        x = F.pad(x, (0, 0, 0, pad, 0, pad))
        n = (h + pad) // s
        return x.reshape(b, n, s, n, s, d).permute(0, 1, 3, 2, 4, 5).reshape(b * n * n, s, s, d)

    def unwindows(self, x, b):
        s, d = self.window, x.shape[-1]
        n = math.isqrt(x.shape[0] // b)
        return x.reshape(b, n, n, s, s, d).permute(0, 1, 3, 2, 4, 5).reshape(b, n * s, n * s, d)[:, :8, :8]

    def forward(self, images):
        x = self.patch(images).permute(0, 2, 3, 1) + self.pos_embed
        for i, (norm, attn) in enumerate(zip(self.norms, self.attns)):
            y = norm(x)
            x = x + (attn(y) if i in self.global_blocks else self.unwindows(attn(self.windows(y)), x.shape[0]))
        return self.head(x.mean((1, 2)))


class TableEmbedding(nn.Module):
    """Patches plus position rows the forward reads from a learned table, not one row per token:
    ``resize``, a side×side ``nn.Embedding`` resized (bilinear, antialiased) to the image's grid,
    as SigLIP-2's; ``gather``, rows of a flat table gathered at position ids 1 + y·side + x, as
    Hunyuan-VL's; ``clamped``, those ids with the column clamped, so the grid's last two columns
    read one row; ``rows-and-columns``, a row table's row and a column table's summed, as
    Pix2Struct's."""

    def __init__(self, dim, read, side=16, patch=2):
        super().__init__()
        self.read, self.side = read, side
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.table = nn.Embedding(side + 1 if read == "rows-and-columns" else side * side + (read != "resize"), dim)
        self.columns = nn.Embedding(side + 1, dim) if read == "rows-and-columns" else None

    def positions(self, h, w):
        """(h·w, D): the rows the tokens of an h×w grid get."""
        if self.columns is not None:
            return (self.table(1 + torch.arange(h))[:, None] + self.columns(1 + torch.arange(w))).flatten(0, 1)
        if self.read == "resize":
            table = self.table.weight.reshape(self.side, self.side, -1).permute(2, 0, 1)[None]
            return F.interpolate(table, size=(h, w), mode="bilinear", antialias=True).flatten(2)[0].T
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        xs = xs.clamp(max=w - 2) if self.read == "clamped" else xs
        return self.table(1 + (ys * self.side + xs).flatten())

    def forward(self, images):
        x = self.patch(images)
        return x.flatten(2).transpose(1, 2) + self.positions(*x.shape[-2:])


class TableViT(nn.Module):
    """A pre-norm ViT on 16×16 images (an 8×8 grid) whose position comes from a table it reads
    (:class:`TableEmbedding`), with attention no adapter names (:class:`RawLinearAttention`)."""

    def __init__(self, read="resize", dim=48, heads=3, depth=2, side=16):
        super().__init__()
        self.image_size = 16
        self.embeddings = TableEmbedding(dim, read, side=side)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(RawLinearAttention(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, images):
        x = self.embeddings(images)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return self.head(x.mean(1))


class _PatchEmbed(nn.Conv2d):
    grid_size = (16, 16)  # the grid of the embedding's own table, as timm states it


class ResizedTableViT(nn.Module):
    """timm's layout (``pos_embed``, ``patch_embed.grid_size``) for a 16×16 table that the forward
    resizes to each image's grid (NaFlexViT's, timm's ``dynamic_img_size``); the model states 16 px
    images, an 8×8 grid, so its layers receive 64 tokens where the named layout says 256."""

    def __init__(self, dim=48, heads=3, depth=2):
        super().__init__()
        self.image_size = 16
        self.patch_embed = _PatchEmbed(3, dim, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 256, dim) * 0.02)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(RawLinearAttention(dim, heads) for _ in range(depth))

    def positions(self, h, w):
        table = self.pos_embed.reshape(1, 16, 16, -1).permute(0, 3, 1, 2)
        return F.interpolate(table, size=(h, w), mode="bilinear", antialias=True).flatten(2)[0].T

    def forward(self, images):
        x = self.patch_embed(images)
        x = x.flatten(2).transpose(1, 2) + self.positions(*x.shape[-2:])
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return x.mean(1)


class StagedViT(nn.Module):
    """A two-stage ViT on 2·``side``-pixel images: side×side tokens of width 48 with a learned PE,
    two blocks; a 2×2 strided convolution merges them into (side/2)² tokens of width 96, to which
    the stage adds its own learned PE, kept channels first (1, 96, side/2, side/2) as Visformer's;
    two blocks more. Without ``stage_pe`` the second stage's tokens carry no position of their own.
    With ``maps_pe`` the first PE is kept channels first too, under a name no finder knows, and
    added to the patch map (TNT's pixel PE)."""

    def __init__(self, stage_pe=True, heads=3, side=8, maps_pe=False):
        super().__init__()
        self.side, self.maps_pe = side, maps_pe
        self.patch = nn.Conv2d(3, 48, 2, stride=2)
        if maps_pe:
            self.grid_pos = nn.Parameter(torch.randn(1, 48, side, side) * 0.02)
        else:
            self.pos_embed = nn.Parameter(torch.randn(1, side * side, 48) * 0.02)
        self.merge = nn.Conv2d(48, 96, 2, stride=2)
        self.stage_pos = nn.Parameter(torch.randn(1, 96, side // 2, side // 2) * 0.02) if stage_pe else None
        widths = (48, 48, 96, 96)
        self.norms = nn.ModuleList(nn.LayerNorm(w) for w in widths)
        self.attns = nn.ModuleList(RawLinearAttention(w, heads) for w in widths)
        self.head = nn.Linear(96, 10)

    def first_rows(self) -> torch.Tensor:
        """The (side², 48) rows of the first stage's position embedding, row-major."""
        return self.grid_pos[0].flatten(1).T if self.maps_pe else self.pos_embed[0]

    def forward(self, images):
        x = self.patch(images)
        if self.maps_pe:
            x = (x + self.grid_pos).flatten(2).transpose(1, 2)
        else:
            x = x.flatten(2).transpose(1, 2) + self.pos_embed
        for i in (0, 1):
            x = x + self.attns[i](self.norms[i](x))
        x = self.merge(x.transpose(1, 2).reshape(x.shape[0], 48, self.side, self.side))
        if self.stage_pos is not None:
            x = x + self.stage_pos
        x = x.flatten(2).transpose(1, 2)
        for i in (2, 3):
            x = x + self.attns[i](self.norms[i](x))
        return self.head(x.mean(1))
