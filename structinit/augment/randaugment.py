"""RandAugment on uint8 batches, per-image random ops like timm's ``rand-m9-mstd0.5-inc1``.

For each of ``num_ops`` rounds every image independently draws an op (uniformly, with
replacement across rounds), whether to apply it (probability ``prob``, timm's 0.5), a magnitude
m ~ N(magnitude, magnitude_std) clipped to [0, 10], and a sign for the signed ops. timm draws m
again for every op it applies; so does this (one draw per image and round). The ops and their
magnitude → argument maps are timm's (``_LEVEL_DENOM`` = 10).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from structinit.augment import ops
from structinit.augment._checks import check_batch, check_int, check_probability, fill_values
from structinit.utils import check_generator, is_number, to_device

MAX_MAGNITUDE = 10.0

# timm's _RAND_INCREASING_TRANSFORMS: severity grows with the magnitude for every op
RAND_INCREASING_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd",
    "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
    "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)  # fmt: skip
# timm's _RAND_TRANSFORMS (the original RandAugment paper's maps; some ops get milder as m grows)
RAND_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
    "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)  # fmt: skip

# Magnitude → op arguments. m and sign are float64 (B,) tensors on the CPU, m in [0, 10], sign ±1;
# float64 makes the int() truncations agree with timm's Python-float arithmetic.
_Level = Callable[[torch.Tensor, torch.Tensor, tuple[int, int]], tuple]


def _frac(m: torch.Tensor) -> torch.Tensor:
    return m / MAX_MAGNITUDE


def _enhance(m, _s, _hw):
    return (_frac(m) * 1.8 + 0.1,)  # [0.1, 1.9], grows with m: not a severity


def _enhance_increasing(m, s, _hw):
    return ((1.0 + s * _frac(m) * 0.9).clamp(min=0.1),)  # 1 ± 0.9·m/10: farther from 1 = stronger


_OPS: dict[str, tuple[Callable[..., torch.Tensor], _Level | None]] = {
    "AutoContrast": (ops.auto_contrast, None),
    "Equalize": (ops.equalize, None),
    "Invert": (ops.invert, None),
    "Rotate": (ops.rotate, lambda m, s, hw: (s * _frac(m) * 30.0,)),
    "Posterize": (ops.posterize, lambda m, s, hw: ((_frac(m) * 4).floor(),)),
    "PosterizeIncreasing": (ops.posterize, lambda m, s, hw: (4 - (_frac(m) * 4).floor(),)),
    "Solarize": (ops.solarize, lambda m, s, hw: ((_frac(m) * 256).floor(),)),
    "SolarizeIncreasing": (ops.solarize, lambda m, s, hw: (256 - (_frac(m) * 256).floor(),)),
    "SolarizeAdd": (ops.solarize_add, lambda m, s, hw: ((_frac(m) * 110).floor(),)),
    "Color": (ops.adjust_color, _enhance),
    "ColorIncreasing": (ops.adjust_color, _enhance_increasing),
    "Contrast": (ops.adjust_contrast, _enhance),
    "ContrastIncreasing": (ops.adjust_contrast, _enhance_increasing),
    "Brightness": (ops.adjust_brightness, _enhance),
    "BrightnessIncreasing": (ops.adjust_brightness, _enhance_increasing),
    "Sharpness": (ops.adjust_sharpness, _enhance),
    "SharpnessIncreasing": (ops.adjust_sharpness, _enhance_increasing),
    "ShearX": (ops.shear_x, lambda m, s, hw: (s * _frac(m) * 0.3,)),
    "ShearY": (ops.shear_y, lambda m, s, hw: (s * _frac(m) * 0.3,)),
    # timm: pixels = 0.45·m/10 · image width (x) or height (y)
    "TranslateXRel": (ops.translate_x, lambda m, s, hw: (s * _frac(m) * 0.45 * hw[1],)),
    "TranslateYRel": (ops.translate_y, lambda m, s, hw: (s * _frac(m) * 0.45 * hw[0],)),
}
_GEOMETRIC = {"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"}


def op_names() -> tuple[str, ...]:
    """Every op :func:`apply_op` knows (timm's names)."""
    return tuple(_OPS)


def _cpu_per_sample(value: float | torch.Tensor, batch: int, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.ndim not in (0, 1) or value.numel() not in (1, batch):
            raise ValueError(f"apply_op: {name} has shape {tuple(value.shape)}: pass a number or a ({batch},) tensor")
        return value.detach().to("cpu", torch.float64).reshape(-1).expand(batch)
    return torch.full((batch,), float(value), dtype=torch.float64)


def apply_op(
    x: torch.Tensor,
    name: str,
    magnitude: float | torch.Tensor,
    sign: float | torch.Tensor = 1.0,
    fill: int | Sequence[int] = (128, 128, 128),
) -> torch.Tensor:
    """Apply RandAugment op ``name`` at ``magnitude`` (0 … 10) to every image of ``x``, (B, C, H, W) uint8.

    ``magnitude`` and ``sign`` (+1 or −1, for the signed ops) are numbers or (B,) tensors;
    ``fill`` colours the pixels that geometric ops bring in from outside the image.
    """
    if name not in _OPS:
        raise ValueError(f"apply_op: name={name!r} is not an op; valid names: {', '.join(op_names())}")
    check_batch(x, "apply_op")
    if not isinstance(magnitude, torch.Tensor) and not 0 <= magnitude <= MAX_MAGNITUDE:
        raise ValueError(f"apply_op: magnitude={magnitude!r}: expected a number in [0, {MAX_MAGNITUDE:g}]")
    m = _cpu_per_sample(magnitude, x.shape[0], "magnitude").clamp(0, MAX_MAGNITUDE)
    s = _cpu_per_sample(sign, x.shape[0], "sign").sign()
    fn, level = _OPS[name]
    args = level(m, s, tuple(x.shape[2:])) if level is not None else ()
    kwargs = {"fill": fill} if name in _GEOMETRIC else {}
    return fn(x, *args, **kwargs)


def rand_augment(
    x: torch.Tensor,
    num_ops: int = 2,
    magnitude: float = 9,
    magnitude_std: float = 0.5,
    *,
    generator: torch.Generator,
    prob: float = 0.5,
    increasing: bool = True,
    fill: int | Sequence[int] = (128, 128, 128),
    ops: Sequence[str] | None = None,
) -> torch.Tensor:
    """RandAugment a uint8 batch (B, C, H, W) → (B, C, H, W), each image with its own ops and magnitudes.

    ``magnitude_std`` = 0 fixes m; ``math.inf`` draws m uniformly from [0, magnitude] (as timm).
    ``increasing`` selects :data:`RAND_INCREASING_OPS` (timm ``inc1``) or :data:`RAND_OPS`; ``ops``
    (names from :func:`op_names`) replaces that list. ``fill`` colours what geometric ops bring in.
    ``generator`` must be a CPU generator; it alone decides every random choice.
    """
    check_batch(x, "rand_augment")
    check_generator(generator, "rand_augment")
    check_int(num_ops, "num_ops", "rand_augment")
    check_probability(prob, "prob", "rand_augment")
    if not is_number(magnitude) or not 0 <= magnitude <= MAX_MAGNITUDE:
        raise ValueError(
            f"rand_augment: magnitude={magnitude!r}: expected a number in [0, {MAX_MAGNITUDE:g}] (timm's scale)"
        )
    if not is_number(magnitude_std) or not magnitude_std >= 0:
        raise ValueError(f"rand_augment: magnitude_std={magnitude_std!r}: expected a number ≥ 0 (or math.inf)")
    fill_values(fill, x.shape[1], "rand_augment")  # fail before drawing anything

    names = tuple(ops) if ops is not None else RAND_INCREASING_OPS if increasing else RAND_OPS
    unknown = [name for name in names if name not in _OPS]
    if unknown or not names:
        raise ValueError(f"rand_augment: ops={ops!r}: expected a non-empty list of names from {', '.join(op_names())}")
    batch, out = x.shape[0], x.clone()
    for _ in range(num_ops):
        # draw everything for this round first: always the same number of draws for a given batch size and
        # config, so a seed gives the same choices on any device and for any image content
        choice = torch.randint(len(names), (batch,), generator=generator)
        applied = torch.rand(batch, generator=generator, dtype=torch.float64) < prob
        if magnitude_std == math.inf:
            m = torch.rand(batch, generator=generator, dtype=torch.float64) * magnitude
        elif magnitude_std > 0:
            m = magnitude + magnitude_std * torch.randn(batch, generator=generator, dtype=torch.float64)
        else:
            m = torch.full((batch,), float(magnitude), dtype=torch.float64)
        m = m.clamp(0, MAX_MAGNITUDE)
        sign = torch.where(torch.rand(batch, generator=generator, dtype=torch.float64) < 0.5, -1.0, 1.0)
        # one vectorised call per op on the images that chose it (indices built on the CPU: no sync)
        for k, name in enumerate(names):
            idx = ((choice == k) & applied).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            idx_dev = to_device(idx, x.device)  # no host-device sync: see structinit.utils.transfer
            out.index_copy_(0, idx_dev, apply_op(out.index_select(0, idx_dev), name, m[idx], sign[idx], fill))
    return out
