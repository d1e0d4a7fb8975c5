"""Where attention looks: per-head summaries of attention maps on the token grid (mean
attention distance as in the ViT paper's Fig. 7, entropy, mass inside a k×k neighbourhood),
as tensor functions and, for a whole model, reduced on the fly over a set of images through
the one capture path (:mod:`structinit.analysis.capture`).

Prefix tokens. Tokens are P prefix (class / register) tokens followed by an h×w grid,
row-major (:class:`structinit.TokenLayout`). The grid metrics score grid queries over grid
keys only: with A a (T, T) map and G = A[P:, P:] its grid block, each grid row is
renormalised,

    p(k | q) = G[q, k] / Σ_k' G[q, k'],

the attention a query pays to the grid with its prefix mass spread over the grid in
proportion. A row with no mass on the grid at all (possible only after float underflow) has
no such distribution: it is left out of the average, and a head left with no row gets NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from structinit.adapters import TokenLayout, find_attention_layers, select_layers
from structinit.analysis.capture import check_all_called
from structinit.analysis.fidelity import grid_order_maps, layer_layouts
from structinit.utils import check_int, is_int
from structinit.utils.checks import show


def _pair(name: str, value) -> tuple[int, int]:
    """``value`` as (a, b) of positive ints; an int n means (n, n)."""
    if is_int(value) and value > 0:
        return int(value), int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    raise ValueError(f"{name}={show(value)}: expected a positive int or a pair of positive ints (h, w)")


def _check_probs(probs, num_prefix_tokens: int, grid=None) -> int:
    """Validate (..., heads, T, T) maps against the layout; return P."""
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.ndim < 3 \
            or probs.shape[-1] != probs.shape[-2]:
        what = f"shape {tuple(probs.shape)}, {probs.dtype}" if isinstance(probs, torch.Tensor) else show(probs)
        raise ValueError(f"probs: expected floating attention probabilities of shape (..., heads, T, T), got {what}")
    p, t = check_int("num_prefix_tokens", num_prefix_tokens, low=0), probs.shape[-1]
    if grid is None and p >= t:
        raise ValueError(f"num_prefix_tokens={p}, but probs has only T={t} tokens; pass the prefix-token count of "
                         "the model these maps came from")
    if grid is not None:
        h, w = _pair("grid", grid)
        if p + h * w != t:
            raise ValueError(f"probs has T={t} tokens, but num_prefix_tokens={p} + grid {h}×{w} = {p + h * w}; "
                             "pass the grid and num_prefix_tokens of the model these maps came from")
    if not torch.isfinite(probs).all():
        raise ValueError("probs contains NaN/Inf values; attention probabilities must be finite")
    return p


def _grid_rows(probs: torch.Tensor, num_prefix_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid block with each row renormalised (..., H, N, N), rows that had grid mass (..., H, N))."""
    g = probs[..., num_prefix_tokens:, num_prefix_tokens:]
    mass = g.sum(-1, keepdim=True)
    valid = mass > 0
    # Dividing by 1 where the row is empty keeps it all-zero (and out of the average) instead of NaN.
    return g / torch.where(valid, mass, torch.ones_like(mass)), valid.squeeze(-1)


def _row_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over the query axis of the valid rows; 0/0 = NaN for a head without one."""
    return (values * valid).sum(-1) / valid.sum(-1)


def _coords(grid: tuple[int, int], dtype, scale=(1, 1)) -> torch.Tensor:
    """(N, 2) (y, x) of the grid tokens, row-major, times ``scale`` per axis."""
    y, x = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    return torch.stack([y.reshape(-1) * scale[0], x.reshape(-1) * scale[1]], -1).to(dtype)


def _row_distance(p: torch.Tensor, grid, scale: tuple[float, float] = (1, 1)) -> torch.Tensor:
    """Per query: the attention-weighted distance to the keys, each axis in units of ``scale``."""
    c = _coords(grid, torch.float64, scale)
    dist = (c[:, None] - c[None]).square().sum(-1).sqrt().to(p.dtype)  # (N, N) Euclidean
    return (p * dist).sum(-1)


def _row_entropy(p: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(p, p).sum(-1)  # xlogy: 0·log 0 = 0


def _row_local(p: torch.Tensor, grid, kernel_size: int) -> torch.Tensor:
    c = _coords(grid, torch.long)
    near = (c[:, None] - c[None]).abs().amax(-1) <= kernel_size // 2  # (N, N) Chebyshev ≤ k//2
    return (p * near.to(p.dtype)).sum(-1)


def _check_kernel(kernel_size) -> int:
    k = check_int("kernel_size", kernel_size, low=1)
    if k % 2 == 0:
        raise ValueError(f"kernel_size={k}: expected an odd size (1, 3, 5, …) so that the window has a centre token")
    return k


def mean_attention_distance(probs: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 0,
                            patch_size: int | tuple[int, int] | None = None) -> torch.Tensor:
    r"""Mean attention distance per head: how far on the grid each query looks, on average.

    For a grid query q at (y_q, x_q) with renormalised grid attention p(k | q) (module doc),

        d(q) = Σ_k p(k | q) · √((y_k − y_q)² + (x_k − x_q)²),

    averaged over the grid queries. In patches; with ``patch_size`` (p, or (p_h, p_w)) in
    pixels, each axis scaled by its patch side, as in the ViT paper's analysis (Dosovitskiy
    et al. 2021, Fig. 7). A one-hot map at offset (dy, dx) has d = √(dy² + dx²).

    Args:
        probs: attention probabilities (..., heads, T, T), T = P + h·w.
        grid: (h, w) token grid.
        num_prefix_tokens: P; their rows and columns are excluded (module doc).
        patch_size: pixels per patch, to report pixels instead of patches.

    Returns:
        (..., heads): leading (batch) axes are kept; average them with ``.mean(0)``.

    Examples:
        >>> probs = torch.full((1, 4, 4), 0.25)  # one head, uniform on a 2×2 grid
        >>> mean_attention_distance(probs, (2, 2))  # (0 + 1 + 1 + √2) / 4
        tensor([0.8536])
        >>> shift = structinit.impulse_matrix((4, 4), (1, 1))[None]  # rows leaving the grid have no mass
        >>> mean_attention_distance(shift, (4, 4), patch_size=16)  # 16·√2 pixels
        tensor([22.6274])
    """
    p, valid = _grid_rows(probs, _check_probs(probs, num_prefix_tokens, grid))
    scale = (1, 1) if patch_size is None else _pair("patch_size", patch_size)
    return _row_mean(_row_distance(p, _pair("grid", grid), scale), valid)


def attention_entropy(probs: torch.Tensor, num_prefix_tokens: int = 0, include_prefix: bool = False) -> torch.Tensor:
    r"""Mean Shannon entropy (nats) of the attention rows, per head.

    H(q) = −Σ_k p(k | q) log p(k | q) (0·log 0 = 0), averaged over the query rows: 0 for a
    one-hot row, log n for a uniform one over n keys.

    By default the rows are the grid queries over the grid keys, renormalised (module doc),
    so H ∈ [0, log N] with N = h·w and prefix tokens change nothing. With
    ``include_prefix=True`` every row (prefix queries too) is scored over all T keys as the
    layer applies it, H ∈ [0, log T].

    Args:
        probs: attention probabilities (..., heads, T, T).
        num_prefix_tokens: P, the prefix tokens in front of the grid.
        include_prefix: score every row over every key instead of the grid block.

    Returns:
        (..., heads).

    Examples:
        >>> attention_entropy(torch.full((1, 4, 4), 0.25))  # uniform over 4 keys: log 4
        tensor([1.3863])
        >>> attention_entropy(torch.eye(5)[None], num_prefix_tokens=1)  # one-hot rows
        tensor([0.])
    """
    prefix = _check_probs(probs, num_prefix_tokens)
    p, valid = _grid_rows(probs, 0 if include_prefix else prefix)
    return _row_mean(_row_entropy(p), valid)


def local_attention_mass(probs: torch.Tensor, grid: tuple[int, int], kernel_size: int = 3,
                         num_prefix_tokens: int = 0) -> torch.Tensor:
    r"""Share of each grid query's attention inside its k×k neighbourhood, per head.

    m(q) = Σ_{k : max(|y_k − y_q|, |x_k − x_q|) ≤ ⌊k/2⌋} p(k | q) ∈ [0, 1] with the renormalised
    grid attention p (module doc), averaged over the grid queries. A head that is exactly a
    k×k convolution (an impulse inside the kernel) has m = 1; uniform attention has about
    k²/N. Neighbourhoods are clipped at the grid border (no padding tokens).

    Args:
        probs: attention probabilities (..., heads, T, T), T = P + h·w.
        grid: (h, w) token grid.
        kernel_size: odd k, the side of the neighbourhood.
        num_prefix_tokens: P; their rows and columns are excluded (module doc).

    Returns:
        (..., heads).

    Examples:
        >>> shift = structinit.impulse_matrix((4, 4), (0, 2))[None]
        >>> local_attention_mass(shift, (4, 4), kernel_size=3), local_attention_mass(shift, (4, 4), kernel_size=5)
        (tensor([0.]), tensor([1.]))
    """
    p, valid = _grid_rows(probs, _check_probs(probs, num_prefix_tokens, grid))
    return _row_mean(_row_local(p, _pair("grid", grid), _check_kernel(kernel_size)), valid)


def _model_patch_size(model: nn.Module) -> tuple[int, int] | None:
    """(p_h, p_w) pixels per token of ``model``'s patch embedding, or None if none is found:
    ``patch_embed.patch_size`` / ``patch_embed.proj.kernel_size`` (timm, structinit),
    ``patch_embeddings.patch_size`` (Hugging Face), or ``config.patch_size``."""
    for module in model.modules():
        for attr in ("patch_embed", "patch_embeddings"):
            embed = getattr(module, attr, None)
            if not isinstance(embed, nn.Module):
                continue
            convs = (getattr(embed, "proj", None), getattr(embed, "projection", None))
            for size in (getattr(embed, "patch_size", None), *(getattr(c, "kernel_size", None) for c in convs)):
                if size is not None:
                    return _pair(f"{type(model).__name__}'s patch size", size)
    size = getattr(getattr(model, "config", None), "patch_size", None)
    return None if size is None else _pair(f"{type(model).__name__}'s config.patch_size", size)


METRICS = ("distance", "distance_px", "entropy", "local_mass")


def _token_side(images: torch.Tensor, tokens_per_image: float,
                patch: tuple[int, int] | None) -> tuple[float, float]:
    """(h, w) pixels a token spans when an image holds ``tokens_per_image`` square tokens.

    With the patch size known, a token of a stage after k patch mergings spans patch·2^k
    pixels: the nearest such size is taken, because windows padded to whole ones (a 14×14 map
    in 4×4 windows is computed as 16×16) make the count overstate the image's tokens."""
    side = (images.shape[-2] * images.shape[-1] / tokens_per_image) ** 0.5
    if patch is None:
        return side, side
    merges = max(0, round(math.log2(side / ((patch[0] * patch[1]) ** 0.5))))
    return patch[0] * 2 ** merges, patch[1] * 2 ** merges


@torch.no_grad()
def attention_metrics(
    model: nn.Module,
    images: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int | None = None,
    patch_size: int | tuple[int, int] | None = None,
    kernel_size: int = 3,
    batch_size: int = 64,
) -> dict[str, torch.Tensor]:
    """Where each head of a model looks on ``images``: per layer and head, the grid metrics
    of this module averaged over every grid query of every image.

    Returns a dict of (layers × heads) float tensors (NaN for the missing heads of narrower
    layers):

    - ``'distance'``: :func:`mean_attention_distance` in patches;
    - ``'distance_px'``: the same in pixels, present only when a patch size is known
      (``patch_size``, else the model's patch embedding, ``patch_embed.patch_size``,
      ``patch_embed.proj.kernel_size``, Hugging Face's ``patch_embeddings.patch_size`` or
      ``config.patch_size``);
    - ``'entropy'``: :func:`attention_entropy` over the grid block (nats);
    - ``'local_mass'``: :func:`local_attention_mass` with ``kernel_size``.

    The model runs in eval mode once per batch of ``batch_size`` images, and each layer's
    maps are the ones the model itself computes (its own softmax, whatever it does to q and k
    on the way: :func:`structinit.adapters.observe.real_maps`), read in grid order when the
    model reorders its tokens, and reduced at once (never all held). The token layout is the
    one the impulse init recorded on the layers, else :func:`structinit.infer_layout` (``grid``
    / ``num_prefix_tokens`` where it cannot read them); every layer's token count is checked
    against prefix + grid. A layer with a relative position bias (Swin, BEiT) is measured on
    its window, with the mask of its call; its ``distance_px`` counts the pixels its tokens
    span at that stage (after patch merging).

    Examples:
        >>> model = structinit.create_model("vit_micro_patch2_16")
        >>> _ = structinit.init_(model, "impulse", seed=0, target_mass=0.99, pe_scale=4.0)
        >>> m = attention_metrics(model, torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
        >>> sorted(m), tuple(m["distance"].shape), bool((m["local_mass"] > 0.8).all())
        (['distance', 'distance_px', 'entropy', 'local_mass'], (2, 2), True)
    """
    if not isinstance(images, torch.Tensor) or images.ndim < 1 or images.shape[0] < 1:
        raise ValueError(f"images={show(images)}: expected a tensor with at least one image along dim 0")
    batch_size = check_int("batch_size", batch_size, low=1)
    kernel_size = _check_kernel(kernel_size)
    patch = _pair("patch_size", patch_size) if patch_size is not None else _model_patch_size(model)
    chosen = select_layers(find_attention_layers(model), layers)
    layouts: list[TokenLayout] = layer_layouts(model, chosen, grid, num_prefix_tokens)
    heads = max(ad.num_heads for _, ad in chosen)
    windowed = all(ad.relative is not None for _, ad in chosen)
    names = [m for m in METRICS if m != "distance_px" or patch is not None or windowed]
    sums = torch.zeros(len(chosen), heads, len(names), dtype=torch.float64)
    counts = torch.zeros(len(chosen), heads, dtype=torch.float64)
    called = [False] * len(chosen)

    for i, count, real in grid_order_maps(model, images, chosen, layouts, batch_size):  # count: images in the batch
        ad, layout = chosen[i][1], layouts[i]
        p, valid = _grid_rows(real.probs.float(), layout.num_prefix_tokens)  # (B, H, N, N), (B, H, N)
        # A window layer's token spans more pixels after patch merging: read its size off the
        # token count per image (windows per image × window area).
        size = (patch if ad.relative is None
                else _token_side(images, real.probs.shape[0] * layout.num_patches / count, patch))
        rows = {"distance": lambda: _row_distance(p, layout.grid),
                "distance_px": lambda: _row_distance(p, layout.grid, size),
                "entropy": lambda: _row_entropy(p),
                "local_mass": lambda: _row_local(p, layout.grid, kernel_size)}
        for j, metric in enumerate(names):
            sums[i, : ad.num_heads, j] += (rows[metric]() * valid).double().sum((0, 2))
        counts[i, : ad.num_heads] += valid.double().sum((0, 2))
        called[i] = True
    check_all_called(chosen, called)
    # Every image has the same grid queries, so the mean over all rows is the mean of per-image means.
    means = (sums / counts[..., None]).float()
    return {metric: means[..., j] for j, metric in enumerate(names)}
