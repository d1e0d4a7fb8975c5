"""The conv-init scheme 'orthogonal': delta-orthogonal (exact) and truncated Cayley
(measured) kernels for the groups == 1 convolutions of a model."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import structinit
from rejection import check_rejected, snapshot
from structinit.functional import cayley_conv as fc
from structinit.functional import orthogonal as fo
from structinit.schemes.registry import get_scheme


def model(k=3, padding_mode="zeros", widths=(3, 8, 8, 4)):
    torch.manual_seed(0)
    layers = []
    for c_in, c_out in itertools.pairwise(widths):
        layers.append(nn.Conv2d(c_in, c_out, k, padding="same", padding_mode=padding_mode))
    layers.append(nn.Conv2d(widths[-1], widths[-1], 3, padding=1, groups=widths[-1]))  # depthwise: left alone
    return nn.Sequential(*layers)


def full_convs(m):
    return [c for c in m if isinstance(c, nn.Conv2d) and c.groups == 1]


def test_registered_for_conv_without_clash():
    assert "orthogonal" in structinit.schemes("conv")
    assert get_scheme("orthogonal") is structinit.orthogonal_init_


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_delta_centre_tap_is_exactly_orthogonal(k):
    m = structinit.init_(model(k), "orthogonal", variant="delta", seed=0)
    c = (k - 1) // 2
    for conv in full_convs(m):
        w = conv.weight.detach().double()
        centre = w[:, :, c, c]
        gram = centre.T @ centre if conv.out_channels >= conv.in_channels else centre @ centre.T
        assert (gram - torch.eye(gram.shape[0], dtype=torch.float64)).abs().max() < 1e-6
        assert w.abs().sum() == centre.abs().sum()  # zeros elsewhere


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("padding_mode", ["circular", "zeros"])
def test_delta_conv_preserves_norms(k, padding_mode):
    m = structinit.init_(model(k, padding_mode, widths=(4, 8, 8)), "orthogonal", variant="delta", seed=1)
    x = torch.randn(3, 4, 12, 12, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for conv in full_convs(m):
            pads = ((k - 1) // 2, k // 2, (k - 1) // 2, k // 2)  # what padding='same' does
            y = F.conv2d(F.pad(x, pads, mode="constant" if padding_mode == "zeros" else "circular"), conv.weight)
            assert torch.allclose(y.flatten(1).norm(dim=1), x.flatten(1).norm(dim=1), rtol=1e-5)
            x = y


def test_delta_co_isometric_when_c_out_below_c_in():
    m = structinit.init_(model(3, "circular", widths=(8, 3)), "orthogonal", variant="delta", seed=0)
    conv = full_convs(m)[0]
    centre = conv.weight.detach()[:, :, 1, 1]
    assert torch.allclose(centre @ centre.T, torch.eye(3), atol=1e-6)
    assert fc.orthogonality_error(fc.fft_conv_weight(conv.weight.detach(), 8)) < 1e-6


def test_depthwise_convs_and_biases_are_left_alone():
    m = model()
    before = snapshot(m)["state"]
    structinit.init_(m, "orthogonal", seed=0)
    after = m.state_dict()
    for key in ("0.bias", "1.bias", "3.weight", "3.bias"):
        assert torch.equal(after[key], before[key]), key
    assert not torch.equal(after["0.weight"], before["0.weight"])


@pytest.mark.parametrize("k, std, bound", [(3, 0.1, 0.06), (3, 0.3, 0.3), (3, 1.0, 0.7), (4, 0.1, 0.2),
                                           (4, 0.3, 0.55), (4, 1.0, 0.8)])
def test_cayley_truncation_error_measured(k, std, bound):
    """The numbers stated in cayley_kernel's docstring: max_f |ŴᴴŴ − I| of the truncated
    kernel on a 32×32 grid (16 channels, n = 16, seed 0)."""
    w = fo.cayley_kernel(16, 16, k, std=std, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    err = fc.orthogonality_error(fc.fft_conv_weight(w, 32))
    assert 0 < err < bound
    stated = {(3, 0.1): 0.043, (3, 0.3): 0.23, (3, 1.0): 0.61, (4, 0.1): 0.14, (4, 0.3): 0.45, (4, 1.0): 0.73}
    assert err == pytest.approx(stated[(k, std)], abs=0.006)


def test_cayley_untruncated_kernel_is_exactly_orthogonal():
    """With k = n nothing is cut: the kernel is the exact circular orthogonal conv."""
    g = torch.randn(6, 6, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.1
    q = fc.semi_orthogonal_cayley(fc.fft_conv_weight(g, 8))
    w = fo.conv_weight_from_fft(q, 8)
    assert fc.orthogonality_error(fc.fft_conv_weight(w, 8)) < 1e-12


def test_cayley_variant_writes_near_orthogonal_kernels():
    m = structinit.init_(model(3, "circular", widths=(8, 8)), "orthogonal", variant="cayley", seed=0)
    conv = full_convs(m)[0]
    assert fc.orthogonality_error(fc.fft_conv_weight(conv.weight.detach(), 16)) < 0.1
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    conv.bias = None
    with torch.no_grad():
        ratio = float(conv(x).norm() / x.norm())
    assert abs(ratio - 1) < 0.05


@pytest.mark.parametrize("variant", ["delta", "cayley"])
def test_reproducible(variant):
    a = structinit.init_(model(), "orthogonal", variant=variant, seed=5)
    b = structinit.init_(model(), "orthogonal", variant=variant, generator=torch.Generator().manual_seed(5))
    b2 = structinit.init_(model(), "orthogonal", variant=variant, generator=torch.Generator().manual_seed(5))
    c = structinit.init_(model(), "orthogonal", variant=variant, seed=6)
    a2 = structinit.init_(model(), "orthogonal", variant=variant, seed=5)
    for x, y in zip(a.state_dict().values(), a2.state_dict().values()):
        assert torch.equal(x, y)
    for x, y in zip(b.state_dict().values(), b2.state_dict().values()):
        assert torch.equal(x, y)
    assert not torch.equal(a[0].weight, c[0].weight)


def test_plan_writes_nothing_until_commit():
    m, direct = model(), model()
    before = snapshot(m)["state"]
    plan = structinit.plan_init(m, "orthogonal", variant="cayley", seed=3)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    plan.commit()
    structinit.orthogonal_init_(direct, variant="cayley", seed=3)
    for x, y in zip(m.state_dict().values(), direct.state_dict().values()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("options, exc, match", [
    (dict(varient="delta"), TypeError,
     r"unknown option\(s\) varient; valid: variant, gain, std, n, frozen, generator, seed"),
    (dict(variant="qr"), ValueError, r"variant='qr': valid names are delta, cayley"),
    (dict(variant=3), ValueError, r"variant=3: valid names are delta, cayley"),
    (dict(gain=0.0), ValueError, r"gain=0\.0"),
    (dict(gain="1"), TypeError, r"gain='1': expected"),
    (dict(std=float("nan")), ValueError, r"std=nan"),
    (dict(n=2.5), TypeError, r"n=2\.5: expected"),
    (dict(variant="cayley", n=2), ValueError, r"n=2: smaller than the kernels of 0 \(k=3\)"),
    (dict(seed="a"), TypeError, r"seed='a'"),
])
def test_options_validated_and_model_unchanged(options, exc, match):
    check_rejected(model(), lambda m: structinit.init_(m, "orthogonal", **options), exc, match)


def test_model_without_full_convs_is_rejected():
    dw = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.Linear(3, 3))
    check_rejected(dw, lambda m: structinit.init_(m, "orthogonal", seed=0), ValueError,
                   "has no nn.Conv2d with groups == 1")


def test_functional_helpers():
    m = fo.orthogonal_matrix(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(m @ m.T, torch.eye(3), atol=1e-6)
    w = fo.delta_orthogonal_kernel(4, 4, 4, gain=2.0, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(w[:, :, 1, 1].T @ w[:, :, 1, 1], 4 * torch.eye(4), atol=1e-5)
    with pytest.raises(ValueError, match="k=0"):
        fo.delta_orthogonal_kernel(2, 2, 0)
    with pytest.raises(ValueError, match="n=2: the Fourier grid must be at least the kernel size k=3"):
        fo.cayley_kernel(2, 2, 3, n=2)


NAN, INF = float("nan"), float("inf")
POSITIVE = [0, -1.0, "1", True, None, [1.0], NAN, INF]
# The bad values tests/test_option_checks.py uses for the conv schemes (CONV_BAD), for 'orthogonal'.
BAD = {"variant": ["qr", 3, None], "gain": POSITIVE, "std": POSITIVE, "n": [0, -1, 1.5, True, "3"],
       "frozen": ["yes", 1, 0, None, [True]],
       "generator": [0, "gen", [1], torch.zeros(1)], "seed": ["0", 1.5, True, [0], 2**64, -(2**63) - 1]}


@pytest.mark.parametrize("option, value", [(o, v) for o, values in BAD.items() for v in values])
def test_bad_values_on_a_convmixer_are_rejected_naming_the_option(option, value):
    m = structinit.create_model("convmixer_256_8", dim=8, depth=2, kernel_size=3, channels_last=False)
    extra = {"variant": "cayley"} if option in ("n", "std") else {}
    msg = check_rejected(m, lambda m: structinit.init_(m, "orthogonal", **{"seed": 0, **extra, option: value}),
                         (ValueError, TypeError), None)
    assert f"{option}=" in msg or f"{option}:" in msg, msg


def test_frozen():
    m = structinit.init_(model(), "orthogonal", frozen=True, seed=0)
    assert [c.weight.requires_grad for c in full_convs(m)] == [False] * 3
    assert m[0].bias.requires_grad and m[3].weight.requires_grad
    structinit.init_(m, "orthogonal", seed=0)
    assert all(c.weight.requires_grad for c in full_convs(m))
