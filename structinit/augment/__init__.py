"""Batch data augmentation on uint8 image tensors, on the training device.

The dataset lives in memory as uint8 (B, C, H, W) tensors (C = 1 or 3); augmentation runs on
whole batches, vectorised, on CPU or CUDA. Every random choice comes from a CPU
``torch.Generator``: per-image parameters are drawn on the CPU and moved to the batch's device
(through pinned memory, so that a GPU never waits for the host), and a seed fixes the result,
whatever the device.

    from structinit.augment import Augment
    aug = Augment.parse("ra2-9-0.5,crop4,flip")       # RandAugment (timm rand-m9-mstd0.5-inc1), crop, flip
    g = torch.Generator().manual_seed(0)
    x = aug(x_uint8, g)
"""

from structinit.augment.ops import (
    adjust_brightness,
    adjust_color,
    adjust_contrast,
    adjust_sharpness,
    affine,
    auto_contrast,
    equalize,
    grayscale,
    invert,
    posterize,
    rotate,
    shear_x,
    shear_y,
    solarize,
    solarize_add,
    translate_x,
    translate_y,
)
from structinit.augment.randaugment import (
    MAX_MAGNITUDE,
    RAND_INCREASING_OPS,
    RAND_OPS,
    apply_op,
    op_names,
    rand_augment,
)
from structinit.augment.transforms import PADDING_MODES, Augment, random_crop, random_hflip

__all__ = [
    "Augment", "random_crop", "random_hflip", "rand_augment", "apply_op", "op_names",
    "RAND_INCREASING_OPS", "RAND_OPS", "MAX_MAGNITUDE", "PADDING_MODES",
    # ops
    "auto_contrast", "equalize", "invert", "posterize", "solarize", "solarize_add",
    "adjust_brightness", "adjust_color", "adjust_contrast", "adjust_sharpness", "grayscale",
    "affine", "rotate", "shear_x", "shear_y", "translate_x", "translate_y",
]  # fmt: skip
