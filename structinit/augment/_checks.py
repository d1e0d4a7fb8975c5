"""Argument checks and small conversions shared by the augmentation functions (the generator
check is :func:`structinit.utils.check_generator`, shared with the init schemes)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from structinit.utils import is_int, is_number, to_device

__all__ = ["check_batch", "check_int", "check_probability", "fill_values", "per_sample"]


def check_batch(x: torch.Tensor, fn: str) -> None:
    """Raise unless ``x`` is a uint8 (B, C, H, W) tensor with C in {1, 3}."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor of uint8 images (B, C, H, W), got {type(x).__name__}")
    if x.dtype != torch.uint8:
        raise TypeError(
            f"{fn}: x.dtype={x.dtype}: augmentation works on uint8 images (0 … 255); "
            "augment before converting to float, or convert with (x * 255).round().to(torch.uint8)"
        )
    if x.ndim != 4:
        raise ValueError(
            f"{fn}: x.shape={tuple(x.shape)}: expected a batch (B, C, H, W); add a batch dimension with x[None]"
        )
    if x.shape[1] not in (1, 3):
        raise ValueError(
            f"{fn}: x.shape={tuple(x.shape)} has C={x.shape[1]} channels: expected 1 (grayscale) or 3 (RGB) "
            "in dimension 1; channels-last batches need x.permute(0, 3, 1, 2)"
        )


def check_probability(p: float, name: str, fn: str) -> None:
    if not is_number(p) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{fn}: {name}={p!r}: a probability must be a number in [0, 1]")


def check_int(value: int, name: str, fn: str, low: int = 0) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{fn}: {name}={value!r}: expected an integer ≥ {low}")


def per_sample(
    value: float | torch.Tensor,
    x: torch.Tensor,
    name: str,
    fn: str,
    low: float = -math.inf,
    high: float = math.inf,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``value`` (a number, a 0-d or a (B,) tensor) as a (B,) tensor of ``dtype`` on ``x.device``.

    A number outside [low, high] is an error; tensor values are clamped into it instead, because
    checking them would cost a device-to-host sync on every call.
    """
    batch = x.shape[0]
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            value = value.expand(batch)
        if value.shape != (batch,):
            raise ValueError(
                f"{fn}: {name} has shape {tuple(value.shape)}: pass a number or one value per sample, shape ({batch},)"
            )
        return to_device(value.to(torch.float64), x.device).clamp(low, high).to(dtype)
    if not is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{fn}: {name}={value!r}: expected a finite number in [{low}, {high}] or a ({batch},) tensor")
    return torch.full((batch,), value, dtype=dtype, device=x.device)


def fill_values(fill: int | Sequence[int], channels: int, fn: str) -> tuple[int, ...]:
    """``fill`` as one uint8 value per channel.

    A single number fills every channel. An RGB triple used on grayscale images becomes its
    luma (ITU-R 601-2, as PIL's ``convert("L")``), so the default (128, 128, 128) works for both.
    """
    values = (fill,) * channels if isinstance(fill, numbers.Real) else tuple(fill)
    if any(not is_number(v) or not 0 <= v <= 255 for v in values):
        raise ValueError(f"{fn}: fill={fill!r}: expected a value in [0, 255] or one such value per channel")
    if len(values) == 3 and channels == 1:
        values = (0.299 * values[0] + 0.587 * values[1] + 0.114 * values[2],)
    if len(values) != channels:
        raise ValueError(
            f"{fn}: fill={fill!r} has {len(values)} values for {channels}-channel images: "
            f"pass a single value or {channels} values"
        )
    return tuple(round(v) for v in values)
