"""RandAugment's image operations on uint8 batches, vectorised over the batch.

Every function takes ``x`` of shape (B, C, H, W), dtype uint8, C = 1 or 3, on any device, and
returns a new uint8 tensor of the same shape and device. Per-image arguments (``factor``,
``degrees``, ``bits``, …) are a number (same for every image) or a (B,) tensor (one per image).

Semantics follow PIL's ``ImageOps`` / ``ImageEnhance`` / ``Image.transform`` (what timm's
RandAugment calls), with two deliberate differences: blends and rescales round to the nearest
integer where PIL truncates (PIL's truncation darkens by half a grey level on average), and the
geometric ops sample with ``grid_sample(mode="nearest")`` whose ties can differ from PIL's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from structinit.augment._checks import check_batch, fill_values, per_sample
from structinit.utils import is_int, to_device

# PIL's ImageFilter.SMOOTH, the "degenerate" image that ImageEnhance.Sharpness blends with
_SMOOTH = ((1.0, 1.0, 1.0), (1.0, 5.0, 1.0), (1.0, 1.0, 1.0))
_SMOOTH_SUM = 13.0
# pixels; far above float64 rounding (~1e-13 here), far below any geometry that matters
_TIE_NUDGE = 1e-7


def _to_uint8(y: torch.Tensor) -> torch.Tensor:
    """Float image values → uint8, rounded to nearest and clamped to [0, 255]."""
    return y.round().clamp_(0, 255).to(torch.uint8)


def _col(v: torch.Tensor) -> torch.Tensor:
    """(B,) → (B, 1, 1, 1), to broadcast one value per image."""
    return v.view(-1, 1, 1, 1)


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """Luma of uint8 images as float, (B, C, H, W) → (B, 1, H, W), integer-valued in [0, 255].

    RGB uses PIL's ``convert("L")`` exactly: L = (19595 R + 38470 G + 7471 B + 2¹⁵) >> 16, i.e.
    0.299 R + 0.587 G + 0.114 B rounded; a 1-channel image is its own luma.
    """
    check_batch(x, "grayscale")
    if x.shape[1] == 1:
        return x.float()
    rgb = x.to(torch.int32)
    luma = (rgb[:, 0:1] * 19595 + rgb[:, 1:2] * 38470 + rgb[:, 2:3] * 7471 + 0x8000) >> 16
    return luma.float()


# --------------------------------------------------------------------------- pixel-value ops


def invert(x: torch.Tensor) -> torch.Tensor:
    """255 − x."""
    check_batch(x, "invert")
    return x.bitwise_not()  # for uint8, ~v == 255 − v


def posterize(x: torch.Tensor, bits: int | torch.Tensor) -> torch.Tensor:
    """Keep the ``bits`` (0 … 8) most significant bits of every value; 0 bits gives black."""
    check_batch(x, "posterize")
    bits = per_sample(bits, x, "bits", "posterize", 0, 8, torch.int32)
    mask = 256 - (1 << (8 - bits))  # 8 → 0xFF, 4 → 0xF0, 0 → 0x00
    return x & _col(mask.to(torch.uint8))


def solarize(x: torch.Tensor, threshold: int | torch.Tensor) -> torch.Tensor:
    """Invert the values ≥ ``threshold`` (0 … 256); 256 leaves the image unchanged, 0 inverts it."""
    check_batch(x, "solarize")
    threshold = per_sample(threshold, x, "threshold", "solarize", 0, 256, torch.int16)
    return torch.where(x.to(torch.int16) >= _col(threshold), x.bitwise_not(), x)


def solarize_add(x: torch.Tensor, add: int | torch.Tensor, threshold: int = 128) -> torch.Tensor:
    """Add ``add`` (0 … 255) to the values below ``threshold``, saturating at 255."""
    check_batch(x, "solarize_add")
    add = per_sample(add, x, "add", "solarize_add", 0, 255, torch.int16)
    if not is_int(threshold) or not 0 <= threshold <= 256:
        raise ValueError(f"solarize_add: threshold={threshold!r}: expected an integer in [0, 256]")
    wide = x.to(torch.int16)
    return torch.where(wide < threshold, (wide + _col(add)).clamp_(max=255), wide).to(torch.uint8)


def auto_contrast(x: torch.Tensor) -> torch.Tensor:
    """Per image and channel, stretch min … max linearly to 0 … 255; constant channels are unchanged."""
    check_batch(x, "auto_contrast")
    img = x.float()
    lo = img.amin(dim=(2, 3), keepdim=True)
    hi = img.amax(dim=(2, 3), keepdim=True)
    scale = 255.0 / (hi - lo).clamp(min=1.0)  # the clamp only avoids 0/0 on constant channels
    return torch.where(hi > lo, _to_uint8((img - lo) * scale), x)


def equalize(x: torch.Tensor) -> torch.Tensor:
    """Per image and channel histogram equalisation, PIL's ``ImageOps.equalize`` exactly.

    With h the 256-bin histogram and ``last`` the count of the brightest value present,
    step = (H·W − last) // 255 and lut[v] = (step // 2 + Σ_{u<v} h[u]) // step (clamped to 255).
    Channels with a single value, or step = 0, are unchanged. All B·C histograms come from one
    scatter-add on values offset by 256 per (image, channel).
    """
    check_batch(x, "equalize")
    b, c, h, w = x.shape
    rows = b * c
    flat = x.reshape(rows, h * w).long()
    offsets = torch.arange(rows, device=x.device).unsqueeze(1) * 256
    # a scatter-add, not bincount: on a GPU bincount reads its input's maximum back to the host
    bins = (flat + offsets).flatten()
    hist = torch.zeros(rows * 256, dtype=torch.long, device=x.device).scatter_add_(0, bins, torch.ones_like(bins))
    hist = hist.view(rows, 256)
    last = hist.gather(1, flat.amax(dim=1, keepdim=True))
    step = (h * w - last) // 255
    safe_step = step.clamp(min=1)
    below = hist.cumsum(dim=1) - hist  # pixels strictly darker than each value
    lut = ((safe_step // 2 + below) // safe_step).clamp_(max=255)
    lut = torch.where(step > 0, lut, torch.arange(256, device=x.device))
    return lut.gather(1, flat).to(torch.uint8).view(b, c, h, w)


# --------------------------------------------------------------------------- ImageEnhance blends


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """degenerate + factor · (x − degenerate): factor 0 gives ``degenerate``, 1 gives ``x``, > 1 extrapolates."""
    return _to_uint8(torch.lerp(degenerate, x.float(), _col(factor)))


def adjust_brightness(x: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """Blend with black (``ImageEnhance.Brightness``): factor 0 is black, 1 is the image."""
    check_batch(x, "adjust_brightness")
    factor = per_sample(factor, x, "factor", "adjust_brightness", 0.0)
    return _blend(torch.zeros((), device=x.device), x, factor)


def adjust_contrast(x: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """Blend with the image's mean luma (``ImageEnhance.Contrast``): factor 0 is flat grey, 1 is the image."""
    check_batch(x, "adjust_contrast")
    factor = per_sample(factor, x, "factor", "adjust_contrast", 0.0)
    # PIL rounds the mean to an integer grey level; float64 keeps the sum exact for large images
    mean = (grayscale(x).double().mean(dim=(1, 2, 3)) + 0.5).floor().float()
    return _blend(_col(mean), x, factor)


def adjust_color(x: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """Blend with the image's luma (``ImageEnhance.Color``, i.e. saturation): 0 is grayscale, 1 is the image.

    Grayscale (C = 1) images have no colour to change and come back unchanged.
    """
    check_batch(x, "adjust_color")
    factor = per_sample(factor, x, "factor", "adjust_color", 0.0)
    if x.shape[1] == 1:
        return x.clone()
    return _blend(grayscale(x), x, factor)


def adjust_sharpness(x: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """Blend with a 3×3 smoothed copy (``ImageEnhance.Sharpness``): 0 is smooth, 1 the image, 2 sharper.

    The smoothed copy uses PIL's SMOOTH kernel [[1,1,1],[1,5,1],[1,1,1]] / 13, rounded to integers,
    and keeps the one-pixel border of the original (as PIL's filter does), so borders never change.
    """
    check_batch(x, "adjust_sharpness")
    factor = per_sample(factor, x, "factor", "adjust_sharpness", 0.0)
    c, h, w = x.shape[1:]
    img = x.float()
    smooth = img.clone()
    if h >= 3 and w >= 3:
        kernel = to_device(torch.tensor(_SMOOTH), x.device).expand(c, 1, 3, 3)
        # integer weights keep the sums exact, so the rounding below matches PIL's
        inner = F.conv2d(img, kernel, groups=c) / _SMOOTH_SUM
        smooth[:, :, 1:-1, 1:-1] = inner.round()
    return _blend(smooth, x, factor)


# --------------------------------------------------------------------------- geometric ops


def affine(x: torch.Tensor, matrix: torch.Tensor, fill: int | Sequence[int] = 0) -> torch.Tensor:
    """Resample with an inverse affine map in pixel units (PIL's ``Image.transform(AFFINE)`` convention).

    ``matrix``, shape (2, 3) or (B, 2, 3): the output pixel whose centre is at (u, v) = (col + ½,
    row + ½) takes the input pixel containing ``matrix @ (u, v, 1)``. Nearest-neighbour sampling
    (``grid_sample``, ``align_corners=False``) keeps the values exact; output pixels that map outside
    the input get ``fill`` (one value, or one per channel).
    """
    check_batch(x, "affine")
    b, c, h, w = x.shape
    if not isinstance(matrix, torch.Tensor) or matrix.shape[-2:] != (2, 3) or matrix.ndim not in (2, 3):
        shape = tuple(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix).__name__
        raise ValueError(f"affine: matrix has shape {shape}: expected a (2, 3) or ({b}, 2, 3) tensor")
    matrix = to_device(matrix.to(torch.float64), x.device).expand(b, 2, 3)
    # grid_sample's nearest picks round-half-even(p − ½) where PIL picks floor(p): nudging p by a
    # hair makes exact ties (e.g. integer shifts, 90° turns of odd sizes) go PIL's way
    # (constants go through to_device: a plain copy to a GPU would wait for its queue to drain)
    matrix = matrix + to_device(torch.tensor([[0.0, 0.0, _TIE_NUDGE], [0.0, 0.0, _TIE_NUDGE]], dtype=torch.float64),
                                x.device)
    # affine_grid works in normalised coordinates n = 2·p / size − 1 (p in pixel units, align_corners=False):
    # theta = to_normalised · matrix · to_pixels
    to_norm = to_device(torch.tensor([[2 / w, 0, -1], [0, 2 / h, -1], [0, 0, 1]], dtype=torch.float64), x.device)
    to_pix = to_device(torch.tensor([[w / 2, 0, w / 2], [0, h / 2, h / 2], [0, 0, 1]], dtype=torch.float64), x.device)
    bottom = to_device(torch.tensor([[[0.0, 0.0, 1.0]]], dtype=torch.float64), x.device).expand(b, 1, 3)
    theta = to_norm @ torch.cat([matrix, bottom], dim=1) @ to_pix
    # float64 throughout: in float32 a sample point 5e-6 from a pixel edge can land on the wrong side
    grid = F.affine_grid(theta[:, :2], [b, c + 1, h, w], align_corners=False)
    # an extra all-ones channel marks which output pixels came from inside the image
    src = torch.cat([x.double(), torch.ones(b, 1, h, w, dtype=torch.float64, device=x.device)], dim=1)
    out = F.grid_sample(src, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    fill_t = to_device(torch.tensor(fill_values(fill, c, "affine"), dtype=torch.float64), x.device).view(1, c, 1, 1)
    return torch.where(out[:, c:] > 0.5, out[:, :c], fill_t).to(torch.uint8)


def _matrix(rows: list[list[torch.Tensor | float]], like: torch.Tensor) -> torch.Tensor:
    """Stack per-image entries (each a (B,) tensor or a number) into a (B, 2, 3) matrix."""
    entries = [e.to(like.dtype).expand_as(like) if isinstance(e, torch.Tensor) else torch.full_like(like, e)
               for r in rows for e in r]
    return torch.stack(entries, dim=1).view(-1, 2, 3)


def rotate(x: torch.Tensor, degrees: float | torch.Tensor, fill: int | Sequence[int] = 0) -> torch.Tensor:
    """Rotate counter-clockwise by ``degrees`` about the image centre (PIL's ``rotate``), corners get ``fill``."""
    check_batch(x, "rotate")
    theta = per_sample(degrees, x, "degrees", "rotate", dtype=torch.float64) * (math.pi / 180)
    cos, sin = theta.cos(), theta.sin()
    cx, cy = x.shape[3] / 2, x.shape[2] / 2
    # inverse map: input = R(−θ)·(output − centre) + centre, with y pointing down
    matrix = _matrix([[cos, -sin, cx - cx * cos + cy * sin], [sin, cos, cy - cx * sin - cy * cos]], theta)
    return affine(x, matrix, fill)


def shear_x(x: torch.Tensor, factor: float | torch.Tensor, fill: int | Sequence[int] = 0) -> torch.Tensor:
    """Horizontal shear about the top edge (PIL/timm): output (u, v) reads input (u + factor·v, v)."""
    check_batch(x, "shear_x")
    f = per_sample(factor, x, "factor", "shear_x", dtype=torch.float64)
    return affine(x, _matrix([[1.0, f, 0.0], [0.0, 1.0, 0.0]], f), fill)


def shear_y(x: torch.Tensor, factor: float | torch.Tensor, fill: int | Sequence[int] = 0) -> torch.Tensor:
    """Vertical shear about the left edge (PIL/timm): output (u, v) reads input (u, v + factor·u)."""
    check_batch(x, "shear_y")
    f = per_sample(factor, x, "factor", "shear_y", dtype=torch.float64)
    return affine(x, _matrix([[1.0, 0.0, 0.0], [f, 1.0, 0.0]], f), fill)


def translate_x(x: torch.Tensor, pixels: float | torch.Tensor, fill: int | Sequence[int] = 0) -> torch.Tensor:
    """Output column u reads input column u + ``pixels`` (PIL/timm), so positive values move content left."""
    check_batch(x, "translate_x")
    t = per_sample(pixels, x, "pixels", "translate_x", dtype=torch.float64)
    return affine(x, _matrix([[1.0, 0.0, t], [0.0, 1.0, 0.0]], t), fill)


def translate_y(x: torch.Tensor, pixels: float | torch.Tensor, fill: int | Sequence[int] = 0) -> torch.Tensor:
    """Output row v reads input row v + ``pixels`` (PIL/timm), so positive values move content up."""
    check_batch(x, "translate_y")
    t = per_sample(pixels, x, "pixels", "translate_y", dtype=torch.float64)
    return affine(x, _matrix([[1.0, 0.0, 0.0], [0.0, 1.0, t]], t), fill)
