"""Random crop and flip of uint8 batches, and :class:`Augment`, the training loop's augmentation config."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from structinit.augment._checks import check_batch, check_int, check_probability, fill_values
from structinit.augment.randaugment import MAX_MAGNITUDE, rand_augment
from structinit.utils import check_generator, is_number, to_device

PADDING_MODES = ("reflect", "constant")


def _window_index(offset: torch.Tensor, out: int, size: int, padding: int, reflect: bool):
    """Input indices (B, out) of windows starting at ``offset`` (B,) in the padded axis, and which are inside.

    Reflect padding mirrors without repeating the edge (torch's "reflect": −1 → 1, size → size − 2),
    which needs padding < size. Constant padding clamps the index and reports the outside positions.
    """
    index = offset.unsqueeze(1) + torch.arange(out, device=offset.device) - padding
    if reflect:
        index = index.abs()
        return torch.where(index > size - 1, 2 * (size - 1) - index, index), None
    inside = (index >= 0) & (index < size)
    return index.clamp(0, size - 1), inside


def random_crop(
    x: torch.Tensor,
    padding: int,
    generator: torch.Generator,
    padding_mode: str = "reflect",
    fill: int | Sequence[int] = 0,
    size: int | tuple[int, int] | None = None,
) -> torch.Tensor:
    """Pad each side by ``padding`` and cut a random window from every image, (B, C, H, W) → (B, C, h, w).

    ``size`` (h, w) defaults to (H, W), the usual "pad 4 and crop 32" of CIFAR training. Offsets
    are uniform over the (H + 2·padding − h + 1)·(W + 2·padding − w + 1) windows, one per image; the
    crop is a single ``gather`` with no padded copy of the batch. ``padding_mode`` "reflect" mirrors
    the image (``F.pad`` semantics), "constant" uses ``fill`` (one value or one per channel).
    """
    check_batch(x, "random_crop")
    check_generator(generator, "random_crop")
    check_int(padding, "padding", "random_crop")
    b, c, h, w = x.shape
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"random_crop: padding_mode={padding_mode!r}: expected one of {', '.join(PADDING_MODES)}")
    if padding >= h or padding >= w:
        raise ValueError(
            f"random_crop: padding={padding} for {h}×{w} images: padding must be smaller than the image (reflect "
            f"padding cannot mirror further, wider padding gives windows of pure fill); use ≤ {min(h, w) - 1}"
        )
    oh, ow = (h, w) if size is None else (size, size) if isinstance(size, int) else tuple(size)
    if not 1 <= oh <= h + 2 * padding or not 1 <= ow <= w + 2 * padding:
        raise ValueError(
            f"random_crop: size={size!r}: the window must fit the padded {h + 2 * padding}×{w + 2 * padding} image"
        )
    fill_t = to_device(torch.tensor(fill_values(fill, c, "random_crop"), dtype=torch.uint8), x.device).view(1, c, 1, 1)

    dy = to_device(torch.randint(h + 2 * padding - oh + 1, (b,), generator=generator), x.device)
    dx = to_device(torch.randint(w + 2 * padding - ow + 1, (b,), generator=generator), x.device)
    reflect = padding_mode == "reflect"
    rows, rows_inside = _window_index(dy, oh, h, padding, reflect)
    cols, cols_inside = _window_index(dx, ow, w, padding, reflect)
    index = (rows.unsqueeze(2) * w + cols.unsqueeze(1)).view(b, 1, oh * ow).expand(b, c, oh * ow)
    out = x.reshape(b, c, h * w).gather(2, index).view(b, c, oh, ow)
    if not reflect:
        inside = (rows_inside.unsqueeze(2) & cols_inside.unsqueeze(1)).unsqueeze(1)
        out = torch.where(inside, out, fill_t)
    return out


def random_hflip(x: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """Mirror each image left–right with probability ``p``, (B, C, H, W) → (B, C, H, W)."""
    check_batch(x, "random_hflip")
    check_generator(generator, "random_hflip")
    check_probability(p, "p", "random_hflip")
    flip = to_device(torch.rand(x.shape[0], generator=generator, dtype=torch.float64) < p, x.device)
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


_TOKENS = (
    "none",
    "crop<N> (pad N, reflect)",
    "crop<N>-constant (pad N with 0)",
    "flip (horizontal, p=0.5)",
    "ra<num_ops>-<magnitude>[-<magnitude_std>] (RandAugment, e.g. ra2-9-0.5)",
)
_NUMBER = r"(\d+(?:\.\d*)?|inf)"
_CROP = re.compile(r"crop(\d+)(?:-(reflect|constant))?")
_RA = re.compile(rf"ra(\d+)-{_NUMBER}(?:-{_NUMBER})?")


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


@dataclass
class Augment:
    """Batch augmentation for the training loop: RandAugment, then random crop, then horizontal flip.

    Call it on a uint8 batch (B, C, H, W) with a CPU generator; the default config is the identity.

        aug = Augment.parse("crop4,flip,ra2-9-0.5")
        x = aug(x_uint8, generator)           # same device, dtype and shape
    """

    crop_padding: int = 0  # 0 = no crop
    padding_mode: str = "reflect"
    flip: bool = False  # horizontal flip with p = 0.5
    randaugment: tuple[int, int, float] | None = None  # (num_ops, magnitude, magnitude_std), e.g. (2, 9, 0.5)

    def __post_init__(self):
        check_int(self.crop_padding, "crop_padding", "Augment")
        if self.padding_mode not in PADDING_MODES:
            raise ValueError(f"Augment: padding_mode={self.padding_mode!r}: expected one of {', '.join(PADDING_MODES)}")
        if not isinstance(self.flip, bool):
            raise ValueError(f"Augment: flip={self.flip!r}: expected True or False")
        if self.randaugment is not None:
            ra = self.randaugment
            if not isinstance(ra, (tuple, list)) or len(ra) != 3:
                raise ValueError(
                    f"Augment: randaugment={ra!r}: expected (num_ops, magnitude, magnitude_std), e.g. (2, 9, 0.5), "
                    "or None"
                )
            num_ops, magnitude, std = ra
            check_int(num_ops, "randaugment num_ops", "Augment")
            if not is_number(magnitude) or not 0 <= magnitude <= MAX_MAGNITUDE:
                raise ValueError(f"Augment: randaugment magnitude={magnitude!r}: expected a number in [0, 10]")
            if not is_number(std) or not std >= 0:
                raise ValueError(f"Augment: randaugment magnitude_std={std!r}: expected a number ≥ 0 (or math.inf)")
            self.randaugment = (num_ops, magnitude, float(std))

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Augment a uint8 batch (B, C, H, W) → (B, C, H, W), every random choice from ``generator``."""
        check_batch(x, "Augment")
        check_generator(generator, "Augment")
        if self.randaugment is not None:
            num_ops, magnitude, std = self.randaugment
            x = rand_augment(x, num_ops, magnitude, std, generator=generator)
        if self.crop_padding:
            x = random_crop(x, self.crop_padding, generator, self.padding_mode)
        if self.flip:
            x = random_hflip(x, 0.5, generator)
        return x

    def to_spec(self) -> str:
        """The canonical spec string, in application order; ``Augment.parse(a.to_spec())`` rebuilds ``a``."""
        tokens = []
        if self.randaugment is not None:
            num_ops, magnitude, std = self.randaugment
            tokens.append(f"ra{num_ops}-{magnitude:g}" + (f"-{std:g}" if std else ""))
        if self.crop_padding:
            tokens.append(f"crop{self.crop_padding}" + ("-constant" if self.padding_mode == "constant" else ""))
        if self.flip:
            tokens.append("flip")
        return ",".join(tokens) or "none"

    @classmethod
    def parse(cls, spec: str) -> Augment:
        """Build from a comma-separated spec, e.g. ``"crop4,flip"``, ``"flip,ra2-9-0.5"`` or ``"none"``."""
        valid = "valid tokens: " + ", ".join(_TOKENS)
        if not isinstance(spec, str):
            raise TypeError(f"Augment.parse: spec={spec!r}: expected a string; {valid}")
        tokens = [t.strip().lower() for t in spec.split(",")]
        if tokens in (["none"], [""]):
            return cls()
        kwargs: dict = {}
        for token in tokens:
            if token == "none":
                raise ValueError(f"Augment.parse: 'none' cannot be combined with other tokens in {spec!r}; {valid}")
            crop, ra = _CROP.fullmatch(token), _RA.fullmatch(token)
            key = "crop_padding" if crop else "randaugment" if ra else "flip" if token == "flip" else None
            if key is None:
                raise ValueError(f"Augment.parse: unknown token {token!r} in spec {spec!r}; {valid}")
            if key in kwargs:
                raise ValueError(f"Augment.parse: {key} given twice in spec {spec!r}; {valid}")
            if crop:
                kwargs["crop_padding"] = int(crop[1])
                kwargs["padding_mode"] = crop[2] or "reflect"
            elif ra:
                std = _number(ra[3]) if ra[3] else 0.0
                kwargs["randaugment"] = (int(ra[1]), _number(ra[2]), float(std))
            else:
                kwargs["flip"] = True
        try:
            return cls(**kwargs)
        except ValueError as error:  # e.g. a magnitude above 10: say which spec it came from
            raise ValueError(f"Augment.parse: spec {spec!r}: {error}; {valid}") from None
