"""Images and constants shared by the augmentation tests."""

import torch
import torch.nn.functional as F

from structinit import augment as A
from structinit.augment import Augment


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def noise(b=8, c=3, h=16, w=16, seed=0):
    """Uniform random uint8 images: every window and every flip is distinguishable."""
    return torch.randint(0, 256, (b, c, h, w), generator=gen(seed), dtype=torch.uint8)


def photo(b=6, c=3, h=16, w=16, seed=0):
    """Smooth images with a skewed histogram and mid-range values, closer to photographs than noise."""
    g = gen(seed)
    low = torch.rand(b, c, 4, 4, generator=g)
    y = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    y = y**2 * 180 + 30 + 10 * torch.rand(b, c, h, w, generator=g)
    return y.round().clamp(0, 255).to(torch.uint8)


def unique_pixels(b, h=8, w=8):
    """Every pixel of an image holds its own value 1 … h·w (0 is left for the fill)."""
    return torch.arange(1, h * w + 1, dtype=torch.uint8).view(1, 1, h, w).expand(b, 3, h, w).contiguous()


FULL = Augment(crop_padding=4, flip=True, randaugment=(2, 9, 0.5))
BLENDS = {
    "adjust_brightness": A.adjust_brightness,
    "adjust_contrast": A.adjust_contrast,
    "adjust_color": A.adjust_color,
    "adjust_sharpness": A.adjust_sharpness,
}
GEOMETRIC = {"rotate": A.rotate, "shear_x": A.shear_x, "shear_y": A.shear_y,
             "translate_x": A.translate_x, "translate_y": A.translate_y}  # fmt: skip
