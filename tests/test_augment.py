"""Batch augmentation (structinit.augment): determinism, crop/flip geometry, the RandAugment policy,
the Augment config and its spec strings (each op on its own: test_augment_ops.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from augment_helpers import FULL, gen, noise, photo, unique_pixels
from structinit import augment as A
from structinit.augment import Augment, apply_op, rand_augment, random_crop, random_hflip

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
