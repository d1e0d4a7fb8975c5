"""Batch augmentation (structinit.augment): determinism, crop/flip geometry, every RandAugment op,
parity with PIL (what timm's RandAugment runs), the Augment config and its spec strings."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from structinit import augment as A
from structinit.augment import Augment, apply_op, rand_augment, random_crop, random_hflip

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------

RANDOM_FNS = {
    "crop_reflect": lambda x, g: random_crop(x, 4, g),
    "crop_constant": lambda x, g: random_crop(x, 4, g, padding_mode="constant", fill=(1, 2, 3)),
    "hflip": lambda x, g: random_hflip(x, 0.5, g),
    "rand_augment": lambda x, g: rand_augment(x, 2, 9, 0.5, generator=g),
    "rand_augment_orig": lambda x, g: rand_augment(x, 3, 5, math.inf, generator=g, increasing=False),
    "augment": FULL,
}


@pytest.mark.parametrize("name", list(RANDOM_FNS))
def test_same_seed_same_bits_other_seed_differs(name):
    fn, x = RANDOM_FNS[name], noise(64)
    before = x.clone()
    a, b, c = fn(x, gen(3)), fn(x, gen(3)), fn(x, gen(4))
    assert a.dtype == torch.uint8 and a.shape == x.shape
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(x, before), "the input batch must not be modified"


@pytest.mark.parametrize("name", list(RANDOM_FNS))
def test_draws_do_not_depend_on_the_images(name):
    """The generator advances by the same amount whatever the content, so later draws stay in step."""
    fn = RANDOM_FNS[name]
    g1, g2 = gen(5), gen(5)
    fn(noise(32, seed=1), g1)
    fn(photo(32, seed=2, h=16, w=16), g2)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_one_generator_across_calls_is_reproducible():
    x = noise(32)
    g1, g2 = gen(9), gen(9)
    first = [FULL(x, g1) for _ in range(3)]
    second = [FULL(x, g2) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], first[1])  # the generator moves on between batches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = photo(64, h=32, w=32)
    for name, fn in RANDOM_FNS.items():
        cpu, cuda = fn(x, gen(1)), fn(x.cuda(), gen(1))
        assert cuda.device.type == "cuda"
        # ops are exact integer maps except the float blends, where a rounding tie may go the other way
        assert (cpu.int() - cuda.cpu().int()).abs().max() <= 1, name


# ---------------------------------------------------------------------------------------------
# random_crop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["reflect", "constant"])
def test_crop_without_padding_is_identity(mode):
    x = noise()
    assert torch.equal(random_crop(x, 0, gen(), padding_mode=mode), x)


def test_constant_crop_is_the_shifted_padded_image_and_covers_every_offset():
    b, p, h, w = 400, 2, 8, 8
    x = unique_pixels(b, h, w)
    out = random_crop(x, p, gen(), padding_mode="constant", fill=0)
    # recover each offset from the first real pixel in the window: value v sits at row (v−1)//w, col (v−1)%w
    first = (out[:, 0] > 0).flatten(1).int().argmax(1)
    i, j = first // w, first % w
    v = out[:, 0].flatten(1).gather(1, first[:, None]).squeeze(1).long() - 1
    dy, dx = v // w - i + p, v % w - j + p
    padded = F.pad(x, (p, p, p, p), mode="constant", value=0)
    for k in range(b):
        assert torch.equal(out[k], padded[k, :, dy[k] : dy[k] + h, dx[k] : dx[k] + w])
    assert set(zip(dy.tolist(), dx.tolist())) == {(a, c) for a in range(2 * p + 1) for c in range(2 * p + 1)}


def test_constant_crop_fills_per_channel():
    x = unique_pixels(200)
    out = random_crop(x, 3, gen(), padding_mode="constant", fill=(0, 200, 250))
    outside = out[:, 0] == 0
    assert outside.any()
    assert (out[:, 1][outside] == 200).all() and (out[:, 2][outside] == 250).all()


def windows(padded, h, w):
    """All h×w windows of each padded image, (B, n_windows, C·h·w)."""
    return F.unfold(padded.float(), (h, w)).transpose(1, 2)


def test_reflect_crop_windows_are_windows_of_the_padded_image_and_cover_every_offset():
    b, p = 300, 3
    x = noise(b, 3, 10, 12)
    out = random_crop(x, p, gen(2))
    all_windows = windows(F.pad(x, (p, p, p, p), mode="reflect"), 10, 12)  # (B, 7·7, C·h·w)
    match = (all_windows == out.float().flatten(1).unsqueeze(1)).all(dim=2)
    assert match.any(dim=1).all(), "some output is not a window of its padded image"
    assert set(match.int().argmax(dim=1).tolist()) == set(range((2 * p + 1) ** 2))


def test_crop_to_a_smaller_size():
    x = noise(100, 3, 12, 12)
    out = random_crop(x, 2, gen(), size=(6, 8))
    assert out.shape == (100, 3, 6, 8)
    all_windows = windows(F.pad(x, (2, 2, 2, 2), mode="reflect"), 6, 8)
    assert (all_windows == out.float().flatten(1).unsqueeze(1)).all(dim=2).any(dim=1).all()


# ---------------------------------------------------------------------------------------------
# random_hflip
# ---------------------------------------------------------------------------------------------


def test_hflip_probability_zero_one_and_half():
    x = noise(1000, 1, 4, 4)
    assert torch.equal(random_hflip(x, 0.0, gen()), x)
    assert torch.equal(random_hflip(x, 1.0, gen()), torch.flip(x, [-1]))
    out = random_hflip(x, 0.5, gen())
    flipped = (out == torch.flip(x, [-1])).flatten(1).all(1)
    kept = (out == x).flatten(1).all(1)
    assert (flipped ^ kept).all(), "every image is either flipped or kept"
    assert 0.45 < flipped.float().mean() < 0.55


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


# ---------------------------------------------------------------------------------------------
# rand_augment
# ---------------------------------------------------------------------------------------------


def test_rand_augment_trivial_settings_are_identity():
    x = noise(32)
    assert torch.equal(rand_augment(x, 0, generator=gen()), x)
    assert torch.equal(rand_augment(x, 2, 9, 0.5, generator=gen(), prob=0.0), x)


def test_rand_augment_clips_the_magnitude_and_draws_the_sign_per_image():
    x = noise(200, 3, 8, 8)
    # std 10⁴: all but ~4e-4 of draws land outside [0, 10] and are clipped to 0 (identity) or 10 (±30°)
    out = rand_augment(x, 1, 10, 1e4, generator=gen(), prob=1.0, fill=0, ops=["Rotate"])
    same = (out == x).flatten(1).all(1)
    left = (out == A.rotate(x, 30.0)).flatten(1).all(1)
    right = (out == A.rotate(x, -30.0)).flatten(1).all(1)
    assert (same | left | right).all()
    assert 0.3 < same.float().mean() < 0.7 and left.sum() > 30 and right.sum() > 30


def test_rand_augment_chooses_per_image():
    x = photo(1).expand(200, -1, -1, -1).contiguous()  # the same image 200 times
    out = rand_augment(x, 2, 9, 0.5, generator=gen())
    changed = (out != x).flatten(1).any(1).float().mean()
    # each op runs with p = 0.5, so about a quarter of the images get no op at all
    assert 0.6 < changed < 0.9
    assert len({tuple(img.flatten().tolist()) for img in out}) > 40


@pytest.mark.parametrize("channels", [1, 3])
def test_rand_augment_grayscale_and_rgb(channels):
    x = photo(64, channels, 28, 28)
    out = rand_augment(x, 3, 10, 0.5, generator=gen())
    assert out.dtype == torch.uint8 and out.shape == x.shape


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: random_crop(noise(), -1, gen()), "padding=-1"),
        (lambda: random_crop(noise(h=8, w=8), 8, gen()), "padding=8"),
        (lambda: random_crop(noise(), 2, gen(), padding_mode="wrap"), "padding_mode='wrap'"),
        (lambda: random_crop(noise(), 2, gen(), padding_mode="constant", fill=(1, 2)), "fill=.1, 2."),
        (lambda: random_crop(noise(), 2, None), "torch.Generator"),
        (lambda: random_hflip(noise(), 1.5, gen()), "p=1.5"),
        (lambda: random_hflip(noise().float(), 0.5, gen()), "uint8"),
        (lambda: random_hflip(noise(c=2), 0.5, gen()), "C=2"),
        (lambda: random_hflip(noise()[0], 0.5, gen()), "batch"),
        (lambda: rand_augment(noise(), 2, 11, generator=gen()), "magnitude=11"),
        (lambda: rand_augment(noise(), -1, generator=gen()), "num_ops=-1"),
        (lambda: rand_augment(noise(), 2, 9, -0.5, generator=gen()), "magnitude_std=-0.5"),
        (lambda: A.posterize(noise(), 9), "bits=9"),
        (lambda: A.adjust_contrast(noise(), torch.ones(3)), "one value per sample"),
        (lambda: apply_op(noise(), "Blur", 5), "valid names"),
        (lambda: rand_augment(noise(), generator=gen(), ops=["Blur"]), "ops=.'Blur'."),
        (lambda: Augment(crop_padding=-4), "crop_padding=-4"),
        (lambda: Augment(randaugment=(2, 9)), "num_ops, magnitude, magnitude_std"),
    ],
)
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ---------------------------------------------------------------------------------------------
# Augment
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", Augment()),
        ("", Augment()),
        ("flip", Augment(flip=True)),
        ("crop4,flip", Augment(crop_padding=4, flip=True)),
        ("flip, crop4", Augment(crop_padding=4, flip=True)),
        ("crop2-constant", Augment(crop_padding=2, padding_mode="constant")),
        ("flip,ra2-9-0.5", Augment(flip=True, randaugment=(2, 9, 0.5))),
        ("ra1-7.5", Augment(randaugment=(1, 7.5, 0.0))),
        ("ra2-9-inf,crop4", Augment(crop_padding=4, randaugment=(2, 9, math.inf))),
    ],
)
def test_parse_and_round_trip(spec, expected):
    parsed = Augment.parse(spec)
    assert parsed == expected
    assert Augment.parse(parsed.to_spec()) == parsed


@pytest.mark.parametrize("spec", ["crop", "crop-4", "ra2", "ra2-9-0.5-1", "flip,flip", "blur", "none,flip",
                                  "ra2-11-0.5", "crop4-wrap"])  # fmt: skip
def test_parse_rejects_bad_specs_listing_the_valid_tokens(spec):
    with pytest.raises(ValueError, match="valid tokens") as info:
        Augment.parse(spec)
    message = str(info.value)
    assert all(token in message for token in ("none", "crop<N>", "flip", "ra<num_ops>"))


def test_augment_order_is_randaugment_crop_flip():
    x = noise(32)
    g = gen(7)
    manual = random_hflip(random_crop(rand_augment(x, 2, 9, 0.5, generator=g), 4, g), 0.5, g)
    assert torch.equal(FULL(x, gen(7)), manual)
    assert torch.equal(Augment()(x, gen()), x)


def test_augment_runs_on_a_training_batch():
    x = noise(512, 3, 32, 32)
    out = FULL(x, gen())
    assert out.shape == x.shape and out.dtype == torch.uint8
