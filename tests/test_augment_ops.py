"""Each RandAugment op on tensors, one by one, and its parity with PIL (which timm's policy calls)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from augment_helpers import BLENDS, noise, photo
from structinit import augment as A
from structinit.augment import apply_op

# ---------------------------------------------------------------------------------------------
# the RandAugment ops, one by one
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BLENDS))
def test_blend_factor_one_is_identity(name):
    for c in (1, 3):
        x = photo(c=c)
        assert torch.equal(BLENDS[name](x, 1.0), x)


@pytest.mark.parametrize("name", ["BrightnessIncreasing", "ContrastIncreasing", "ColorIncreasing",
                                  "SharpnessIncreasing", "Rotate", "ShearX", "ShearY", "TranslateXRel",
                                  "TranslateYRel", "SolarizeIncreasing", "SolarizeAdd"])  # fmt: skip
def test_increasing_ops_at_magnitude_zero_are_identity(name):
    x = photo()
    assert torch.equal(apply_op(x, name, 0.0, sign=-1), x)
    assert torch.equal(apply_op(x, name, 0.0, sign=1), x)


def test_blends_at_factor_zero_give_the_degenerate_image():
    x = photo()
    assert (A.adjust_brightness(x, 0.0) == 0).all()
    gray = A.adjust_color(x, 0.0)
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])
    assert torch.equal(gray[:, :1], A.grayscale(x).to(torch.uint8))
    flat = A.adjust_contrast(x, 0.0).flatten(1)
    assert (flat == flat[:, :1]).all()
    # PIL's degenerate is the mean luma rounded half up to an integer grey level
    assert torch.equal(flat[:, 0].long(), (A.grayscale(x).flatten(1).double().mean(1) + 0.5).floor().long())
    # SMOOTH = [[1,1,1],[1,5,1],[1,1,1]] / 13 rounded (13 is odd: no ties), border pixels kept
    smooth = A.adjust_sharpness(x, 0.0)
    kernel = torch.tensor([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=torch.float64).expand(3, 1, 3, 3)
    sums = F.conv2d(x.double(), kernel, groups=3).long()
    assert torch.equal(smooth[..., 1:-1, 1:-1].long(), (2 * sums + 13) // 26)
    assert torch.equal(smooth[..., 0, :], x[..., 0, :]) and torch.equal(smooth[..., :, -1], x[..., :, -1])


@pytest.mark.parametrize("name, fn", [("Brightness", A.adjust_brightness), ("Contrast", A.adjust_contrast),
                                      ("Color", A.adjust_color), ("Sharpness", A.adjust_sharpness)])  # fmt: skip
def test_enhance_magnitude_to_factor(name, fn):
    x = photo()
    # timm: increasing = 1 ± 0.9·m/10 with the sign random; the original maps m to 0.1 + 1.8·m/10
    assert torch.equal(apply_op(x, f"{name}Increasing", 10.0, sign=-1), fn(x, 0.1))
    assert torch.equal(apply_op(x, f"{name}Increasing", 5.0, sign=1), fn(x, 1.45))
    assert torch.equal(apply_op(x, name, 5.0, sign=-1), fn(x, 1.0))
    assert torch.equal(apply_op(x, name, 0.0), fn(x, 0.1))


def test_blends_extrapolate_from_the_integer_degenerate_image():
    """PIL blends with a uint8 degenerate image: factor 2 gives exactly clamp(2·x − degenerate)."""
    x = photo()
    kernel = torch.tensor([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=torch.float64).expand(3, 1, 3, 3)
    smooth = x.long().clone()
    smooth[..., 1:-1, 1:-1] = (2 * F.conv2d(x.double(), kernel, groups=3).long() + 13) // 26
    assert torch.equal(A.adjust_sharpness(x, 2.0).long(), (2 * x.long() - smooth).clamp(0, 255))
    mean = (A.grayscale(x).flatten(1).double().mean(1) + 0.5).floor().long().view(-1, 1, 1, 1)
    assert torch.equal(A.adjust_contrast(x, 2.0).long(), (2 * x.long() - mean).clamp(0, 255))


def test_blends_per_sample_factors():
    x = photo(4)
    factors = torch.tensor([0.0, 1.0, 0.5, 1.0])
    out = A.adjust_brightness(x, factors)
    assert (out[0] == 0).all() and torch.equal(out[1], x[1]) and torch.equal(out[3], x[3])
    assert torch.equal(out[2], (x[2].float() * 0.5).round().to(torch.uint8))


def test_invert_twice_is_identity():
    x = noise()
    assert torch.equal(A.invert(x), 255 - x)
    assert torch.equal(A.invert(A.invert(x)), x)


def test_rotate():
    x = noise(4, 3, 8, 8)
    assert torch.equal(A.rotate(x, 0.0), x)
    assert torch.equal(A.rotate(x, 90.0), torch.rot90(x, 1, (-2, -1)))  # positive = counter-clockwise
    assert torch.equal(A.rotate(x, -180.0), torch.flip(x, [-2, -1]))
    assert torch.equal(apply_op(x, "Rotate", 10.0, sign=1, fill=0), A.rotate(x, 30.0, fill=0))
    corners = A.rotate(x, 45.0, fill=(7, 8, 9))[:, :, 0, 0]
    assert (corners == torch.tensor([7, 8, 9], dtype=torch.uint8)).all()


@pytest.mark.parametrize("pixels", [1, 3, -2])
def test_translate_whole_pixels_shifts_exactly_with_fill(pixels):
    x = noise(4, 3, 8, 10)
    fill = torch.tensor([5, 6, 7], dtype=torch.uint8).view(1, 3, 1, 1)
    ox, oy = A.translate_x(x, pixels, fill=(5, 6, 7)), A.translate_y(x, pixels, fill=(5, 6, 7))
    # output column u reads input column u + pixels: content moves left (up) for positive pixels
    ex, ey = fill.expand_as(x).clone(), fill.expand_as(x).clone()
    if pixels > 0:
        ex[..., :, :-pixels], ey[..., :-pixels, :] = x[..., :, pixels:], x[..., pixels:, :]
    else:
        ex[..., :, -pixels:], ey[..., -pixels:, :] = x[..., :, :pixels], x[..., :pixels, :]
    assert torch.equal(ox, ex) and torch.equal(oy, ey)


def test_half_pixel_shifts_round_like_pil():
    """PIL takes the pixel containing the sample point (floor); grid_sample alone would round half to even."""
    x = noise(2, 3, 8, 10)
    assert torch.equal(A.translate_x(x, 0.5), A.translate_x(x, 1))
    assert torch.equal(A.translate_y(x, -0.5), x)
    assert torch.equal(A.translate_y(x, 2.5), A.translate_y(x, 3))


def test_translate_rel_is_a_fraction_of_the_image_size():
    x = noise(2, 3, 20, 40)
    # 0.45 · m/10 · W = 0.45 · 10/10 · 40 = 18 pixels
    assert torch.equal(apply_op(x, "TranslateXRel", 10.0, sign=1, fill=0), A.translate_x(x, 18, fill=0))
    assert torch.equal(apply_op(x, "TranslateYRel", 10.0, sign=-1, fill=0), A.translate_y(x, -9, fill=0))


def test_shear():
    x = noise(4, 3, 8, 8)
    assert torch.equal(A.shear_x(x, 0.0), x) and torch.equal(A.shear_y(x, 0.0), x)
    # the shear is about the top (left) edge, as PIL: the first row (column) stays in place
    assert torch.equal(A.shear_x(x, 0.3)[..., 0, :], x[..., 0, :])
    assert torch.equal(A.shear_y(x, -0.3)[..., :, 0], x[..., :, 0])
    assert not torch.equal(A.shear_x(x, 0.3), x)


def test_auto_contrast():
    x = photo()
    out = A.auto_contrast(x)
    assert (out.amin(dim=(2, 3)) == 0).all() and (out.amax(dim=(2, 3)) == 255).all()
    # order-preserving within each channel
    order = x.flatten(2).argsort(dim=2)
    assert (out.flatten(2).gather(2, order).diff(dim=2) >= 0).all()
    flat = torch.full((1, 3, 4, 4), 77, dtype=torch.uint8)
    assert torch.equal(A.auto_contrast(flat), flat)


def test_equalize_flattens_the_histogram_and_preserves_order():
    x = photo(4, 3, 32, 32)
    out = A.equalize(x)
    order = x.flatten(2).argsort(dim=2)
    assert (out.flatten(2).gather(2, order).diff(dim=2) >= 0).all(), "equalize must be monotone"
    # the empirical CDF of the output is close to the uniform one, unlike the input's
    levels = torch.arange(0, 256, 16, dtype=torch.uint8).view(1, 1, 1, -1)

    def cdf_gap(y):
        cdf = (y.flatten(2).unsqueeze(3) <= levels).float().mean(dim=2)
        return (cdf - (levels.float() + 1) / 256).abs().max()

    assert cdf_gap(out) < 0.06 < cdf_gap(x)
    flat = torch.full((1, 1, 4, 4), 9, dtype=torch.uint8)
    assert torch.equal(A.equalize(flat), flat)


def test_posterize():
    x = noise()
    assert torch.equal(A.posterize(x, 4), x & 0xF0)
    assert (A.posterize(x, 4) & 0x0F == 0).all()
    assert torch.equal(A.posterize(x, 8), x)
    assert (A.posterize(x, 0) == 0).all()
    assert (apply_op(x, "PosterizeIncreasing", 10.0) == 0).all()  # timm: 4 − int(m/10·4) = 0 bits


def test_solarize():
    x = noise()
    out = A.solarize(x, 100)
    assert torch.equal(out[x >= 100], 255 - x[x >= 100]) and torch.equal(out[x < 100], x[x < 100])
    assert torch.equal(A.solarize(x, 256), x) and torch.equal(A.solarize(x, 0), 255 - x)
    assert torch.equal(apply_op(x, "SolarizeIncreasing", 10.0), 255 - x)  # threshold 256 − 256 = 0
    added = A.solarize_add(x, 110)
    low = x < 128
    assert torch.equal(added[low], x[low] + 110) and torch.equal(added[~low], x[~low])
    assert (A.solarize_add(x, 255)[low] == 255).all()  # saturates


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("name", A.op_names())
def test_every_op_keeps_dtype_shape_device(name, channels):
    x = photo(5, channels, 12, 10)
    out = apply_op(x, name, torch.tensor([0.0, 2.5, 5.0, 9.0, 10.0]), torch.tensor([1, -1, 1, -1, 1]))
    assert out.dtype == torch.uint8 and out.shape == x.shape and out.device == x.device


def test_color_on_grayscale_is_identity():
    x = photo(c=1)
    assert torch.equal(A.adjust_color(x, 0.0), x)
    assert torch.equal(apply_op(x, "ColorIncreasing", 10.0), x)


# ---------------------------------------------------------------------------------------------
# parity with PIL (the library timm's RandAugment calls)
# ---------------------------------------------------------------------------------------------



def enhance(enhancer, factor):
    return lambda im: enhancer(im).enhance(factor)


PIL_OPS = {
    # name: (ours, PIL's, how close): "exact"; "rounded" (off by one where we round and PIL truncates);
    # "geometric" (PIL maps points in 16.16 fixed point, so a point within ~1e-5 px of a pixel edge may
    # land in the neighbouring pixel there: a few pixels per image may differ)
    "auto_contrast": (A.auto_contrast, ImageOps.autocontrast, "rounded"),
    "equalize": (A.equalize, ImageOps.equalize, "exact"),
    "posterize": (lambda x: A.posterize(x, 3), lambda im: ImageOps.posterize(im, 3), "exact"),
    "solarize": (lambda x: A.solarize(x, 90), lambda im: ImageOps.solarize(im, 90), "exact"),
    "color": (lambda x: A.adjust_color(x, 1.7), enhance(ImageEnhance.Color, 1.7), "rounded"),
    "contrast": (lambda x: A.adjust_contrast(x, 0.3), enhance(ImageEnhance.Contrast, 0.3), "rounded"),
    "brightness": (lambda x: A.adjust_brightness(x, 1.4), enhance(ImageEnhance.Brightness, 1.4), "rounded"),
    "sharpness": (lambda x: A.adjust_sharpness(x, 1.9), enhance(ImageEnhance.Sharpness, 1.9), "rounded"),
    "rotate": (lambda x: A.rotate(x, -23.0, fill=(1, 2, 3)),
               lambda im: im.rotate(-23.0, Image.Resampling.NEAREST, fillcolor=(1, 2, 3)), "geometric"),
    "shear_x": (lambda x: A.shear_x(x, 0.27, fill=9),
                lambda im: im.transform(im.size, Image.Transform.AFFINE, (1, 0.27, 0, 0, 1, 0),
                                        Image.Resampling.NEAREST, fillcolor=(9, 9, 9)), "geometric"),
    "translate_y": (lambda x: A.translate_y(x, -4.3, fill=9),
                    lambda im: im.transform(im.size, Image.Transform.AFFINE, (1, 0, 0, 0, 1, -4.3),
                                            Image.Resampling.NEAREST, fillcolor=(9, 9, 9)), "geometric"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PIL_OPS))
def test_matches_pil(name):
    ours, theirs, closeness = PIL_OPS[name]
    x = photo(4, 3, 32, 36)  # ≥ 2·255 pixels, so that equalize's step // 2 offset is not 0
    images = [Image.fromarray(img.permute(1, 2, 0).numpy()) for img in x]
    expected = torch.stack([torch.from_numpy(np.array(theirs(im))).permute(2, 0, 1) for im in images])
    diff = (ours(x).int() - expected.int()).abs()
    if closeness == "exact":
        assert diff.max() == 0
    elif closeness == "rounded":
        assert diff.max() <= 1 and (diff == 0).float().mean() > 0.5
    else:
        assert (diff.amax(dim=1) > 0).float().mean() < 0.01
