"""Attention figures (matplotlib PNG): the paper's N×N maps with a zoom on their top-left
block, attention of a few query tokens laid over the input image, and several inits side by
side. They draw what :func:`structinit.attention_maps` captures; nothing here computes
attention itself.

Every figure shares one colour scale across its panels (``vmax``: the largest value shown,
unless given) so that panels compare at a glance, and labels its axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from structinit.adapters import TokenLayout
from structinit.utils.optional_imports import require


def _pyplot():
    require("matplotlib", "attention figures").use("Agg")  # render to files; there may be no display
    return require("matplotlib.pyplot", "attention figures")


def save_figure(fig, path: str | Path | None):
    """``fig``, also saved to ``path`` (tight bounding box, its folder created) when one is given."""
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fig.savefig(path, bbox_inches="tight")
        except OSError as err:  # a full disk while the file is written says no file name: this one
            if err.filename is None and err.errno is not None:
                raise OSError(err.errno, err.strerror, str(path)) from err
            raise
    return fig


def grid_block(probs: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """The grid-to-grid block (…, N, N) of attention maps (…, T, T): prefix rows and columns
    dropped, T = P + N checked."""
    layout.check_tokens(probs.shape[-1], "the attention map")
    p = layout.num_prefix_tokens
    return probs[..., p:, p:]


def _per_map(layout, count: int, name: str = "layout") -> list[TokenLayout]:
    """One layout per map: ``layout`` itself for every map, or its entries (a model whose layers
    see different tokens, such as ConViT's class token joining after its GPSA layers)."""
    if isinstance(layout, TokenLayout):
        return [layout] * count
    layouts = list(layout) if isinstance(layout, (list, tuple)) else None
    if layouts is None or len(layouts) != count or not all(isinstance(x, TokenLayout) for x in layouts):
        got = f"a {type(layout).__name__}" + ("" if layouts is None else f" of {len(layouts)}")
        raise ValueError(f"{name}: expected one TokenLayout or a list of {count} (one per map), got {got}; "
                         "structinit.analysis.attention_layouts(model, layers) gives each layer's")
    return layouts


def _norm(top: float):
    """Square-root colour scale from 0 to ``top``: a sharp impulse (≈ 0.5) and the diffuse
    rest (≈ 1/N) both stay visible on one scale."""
    colors = require("matplotlib.colors", "attention figures")
    return colors.PowerNorm(0.5, vmin=0.0, vmax=max(top, 1e-12))


COLORBAR_LABEL = "attention probability (√ scale)"
# A token-mixing MLP's map (MLP-Mixer) is a Jacobian, not a softmax: signed, drawn by magnitude.
MIXING_LABEL = "|token-mixing weight| (√ scale)"


def _outline_diagonal_blocks(ax, size: int, width: int) -> None:
    """Outline the w×w diagonal blocks of a map zoomed to ``size`` tokens: on a row-major
    h×w grid, block (i, i) holds the attention of grid row i to itself, where a k×k impulse
    shows as a shifted diagonal and its off-diagonal blocks as the rows above and below."""
    patches = require("matplotlib.patches", "attention figures")
    for start in range(0, size, width):
        extent = min(width, size - start)
        ax.add_patch(patches.Rectangle((start - 0.5, start - 0.5), extent, extent, fill=False,
                                       edgecolor="white", linewidth=0.6))


def attention_figure(maps: Sequence[torch.Tensor], layout: TokenLayout | Sequence[TokenLayout], *,
                     layer_names: Sequence[str],
                     zoom: int = 48, title: str = "", vmax: float | None = None, path=None,
                     label: str = COLORBAR_LABEL):
    """One row per layer: for every head its full N×N grid map and a zoom on the top-left
    ``zoom``×``zoom`` block with the diagonal w×w blocks outlined (the paper's Figures 3–5).

    Args:
        maps: per layer, (heads, T, T) attention (batch already averaged or one image).
        layout: the token layout (prefix tokens are dropped from the picture), or one per layer
            where layers see different tokens (:func:`structinit.analysis.attention_layouts` reads them).
        layer_names: one label per layer.
        zoom: side of the zoomed block (clipped to N).
        vmax: top of the shared colour scale (default: the largest value shown).
        path: PNG written there when given.
        label: the colour bar's (``MIXING_LABEL`` for token-mixing maps).

    Returns the matplotlib Figure.
    """
    if len(maps) != len(layer_names):
        raise ValueError(f"layer_names has {len(layer_names)} entries for {len(maps)} layers")
    layouts = _per_map(layout, len(maps))
    blocks = [grid_block(m.detach().float().cpu(), lay) for m, lay in zip(maps, layouts)]
    heads = max(b.shape[0] for b in blocks)
    top = vmax if vmax is not None else max(float(b.max()) for b in blocks)
    rows = []
    for block, name, lay in zip(blocks, layer_names, layouts):
        z = min(zoom, lay.num_patches)
        panels = []
        for head in range(heads):
            present = head < block.shape[0]
            panels.append((f"head {head} (all N×N)", block[head] if present else None, False))
            panels.append((f"head {head} (top-left {z}×{z})", block[head, :z, :z] if present else None, True))
        rows.append((name, panels, lay.grid[1]))
    return _panel_figure(rows, top, title, path, width=2.0, label=label)


def comparison_figure(maps_by_init: dict[str, torch.Tensor], layout: TokenLayout | Sequence[TokenLayout], *,
                      zoom: int = 48, title: str = "", path=None, label: str = COLORBAR_LABEL):
    """Several inits side by side at one layer: one row per init, one column per head, each
    panel the top-left ``zoom``×``zoom`` block of the grid map with diagonal blocks outlined,
    on one colour scale (the paper's Figures 3–5 compare impulse, mimetic and random so).

    ``maps_by_init``: init label → (heads, T, T); ``layout``: one for every row, or one per
    row. Returns the Figure (saved to ``path``)."""
    if not maps_by_init:
        raise ValueError("maps_by_init is empty: give at least one init label → (heads, T, T) map")
    layouts = _per_map(layout, len(maps_by_init))
    blocks = [grid_block(v.detach().float().cpu(), lay) for v, lay in zip(maps_by_init.values(), layouts)]
    heads = max(b.shape[0] for b in blocks)
    zooms = [min(zoom, lay.num_patches) for lay in layouts]
    top = max(float(b[:, :z, :z].max()) for b, z in zip(blocks, zooms))
    rows = [(row, [(f"head {h}", block[h, :z, :z] if h < block.shape[0] else None, True) for h in range(heads)],
             lay.grid[1]) for row, block, z, lay in zip(maps_by_init, blocks, zooms, layouts)]
    return _panel_figure(rows, top, title, path, width=2.3, label=label)


def _panel_figure(rows, top: float, title: str, path, width: float, label: str):
    """Draw ``rows`` = [(row label, [(panel title, (n, n) map or None, outline diagonal blocks?)],
    grid width)] as one grid of panels on one square-root colour scale up to ``top``."""
    plt = _pyplot()
    cols = max(len(panels) for _, panels, _ in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(width * cols, 2.3 * len(rows) + 0.6), squeeze=False, dpi=110)
    image = None
    for r, (row_label, panels, grid_width) in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            panel = panels[c] if c < len(panels) else (None, None, False)
            if panel[1] is None:
                ax.axis("off")
                continue
            name, shown, outline = panel
            image = ax.imshow(shown.numpy(), cmap="viridis", norm=_norm(top), interpolation="nearest")
            if outline:
                _outline_diagonal_blocks(ax, shown.shape[-1], grid_width)
            ax.set_title(name, fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(f"{row_label}\nquery token", fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("key token", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label=label)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def overlay_figure(image: torch.Tensor, probs: torch.Tensor, layout: TokenLayout, queries: Sequence[int], *,
                   title: str = "", path=None, label: str = COLORBAR_LABEL):
    """For each query grid token (row-major index) and head, that token's attention over the
    grid, upsampled and laid over ``image`` as a heat map; the query patch is outlined.

    Args:
        image: (3, H, W) or (1, H, W) in [0, 1] (undo the normalisation first).
        probs: (heads, T, T) attention of this image at one layer.
        queries: grid token indices (0 … N−1).
    """
    n = layout.num_patches
    bad = [q for q in queries if not 0 <= int(q) < n]
    if bad:
        raise ValueError(f"queries={list(queries)}: grid token indices must lie in 0 … {n - 1}; got {bad}")
    plt = _pyplot()
    patches = require("matplotlib.patches", "attention figures")
    block = grid_block(probs.detach().float().cpu(), layout)
    h, w = layout.grid
    img = image.detach().float().cpu().clamp(0, 1)
    img = img.repeat(3, 1, 1) if img.shape[0] == 1 else img
    H, W = img.shape[-2:]
    heads = block.shape[0]
    fig, axes = plt.subplots(len(queries), heads, figsize=(2.2 * heads, 2.2 * len(queries) + 0.5), squeeze=False,
                             dpi=110)
    top = max(float(block[:, int(q)].max()) for q in queries)
    for row, q in enumerate(int(q) for q in queries):
        for head in range(heads):
            ax = axes[row][head]
            heat = block[head, q].reshape(1, 1, h, w)
            heat = torch.nn.functional.interpolate(heat, size=(H, W), mode="nearest")[0, 0]
            ax.imshow(img.permute(1, 2, 0).numpy())
            overlay = ax.imshow(heat.numpy(), cmap="magma", alpha=0.6, norm=_norm(top))
            ph, pw = H / h, W / w
            ax.add_patch(patches.Rectangle(((q % w) * pw - 0.5, (q // w) * ph - 0.5), pw, ph, fill=False,
                                           edgecolor="cyan", linewidth=1.2))
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"query {q} (row {q // w}, col {q % w}) · head {head}", fontsize=6)
    fig.colorbar(overlay, ax=axes, shrink=0.6, label=label)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def cka_figure(matrix: torch.Tensor, *, label_a: str, label_b: str, title: str = "", path=None):
    """Heat map of a (layers of A × layers of B) CKA matrix (:func:`structinit.cka_matrix`):
    rows are A's layers, columns B's, colour 0 … 1 with each value written in its cell."""
    if matrix.ndim != 2 or min(matrix.shape) == 0:
        raise ValueError(f"matrix has shape {tuple(matrix.shape)}; expected (layers of A, layers of B)")
    plt = _pyplot()
    m = matrix.detach().double().cpu()
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * m.shape[1], 0.8 + 0.6 * m.shape[0]), dpi=110)
    image = ax.imshow(m.numpy(), cmap="magma", vmin=0.0, vmax=1.0)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            value = float(m[i, j])
            ax.text(j, i, "–" if value != value else f"{value:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if value != value or value < 0.6 else "black")
    ax.set_xticks(range(m.shape[1]))
    ax.set_yticks(range(m.shape[0]))
    ax.set_xlabel(f"{label_b}: layer (input of its attention)")
    ax.set_ylabel(f"{label_a}: layer")
    fig.colorbar(image, ax=ax, shrink=0.8, label="linear CKA")
    if title:
        ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
