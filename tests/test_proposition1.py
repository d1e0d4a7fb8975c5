import doctest

import pytest
import torch
import torch.nn.functional as F

import proposition1 as prop1
from proposition1 import (
    channel_assignment,
    filter_output,
    impulse_features,
    mixing_residual,
    proposition1_curve,
)
from structinit.functional.targets import impulse_matrix, kernel_offsets

GRID = (8, 8)


def low_rank(n, d, k, g):
    return torch.randn(n, k, generator=g, dtype=torch.float64) @ torch.randn(k, d, generator=g, dtype=torch.float64)


def residual_for(k, f, d, g, assignment="balanced", grid=GRID, d_out=3):
    """Relative residual for a rank-k input, D = d channels, random general f×f conv target."""
    x = low_rank(grid[0] * grid[1], d, k, g)
    w = torch.randn(f, f, d, d_out, generator=g, dtype=torch.float64)
    offsets = channel_assignment(d, f, assignment, g)
    return mixing_residual(x, grid, f, offsets, filter_output(x, grid, w))


def test_doctests():
    assert doctest.testmod(prop1, raise_on_error=False).failed == 0


@pytest.mark.parametrize("k,f", [(1, 3), (2, 3), (3, 3), (1, 5), (2, 5)])
def test_exact_when_every_tap_has_k_spanning_channels(k, f):
    g = torch.Generator().manual_seed(k * 10 + f)
    for d in (k * f * f, k * f * f + 5):
        assert residual_for(k, f, d, g) < 1e-8


def test_exact_with_shuffled_assignment_of_exactly_k_channels_per_tap():
    g = torch.Generator().manual_seed(1)
    k, f = 2, 3
    taps = kernel_offsets(f) * k
    offsets = [taps[i] for i in torch.randperm(len(taps), generator=g).tolist()]
    x = low_rank(64, len(offsets), k, g)
    z = filter_output(x, GRID, torch.randn(f, f, len(offsets), 4, generator=g, dtype=torch.float64))
    assert mixing_residual(x, GRID, f, offsets, z) < 1e-8


@pytest.mark.parametrize("k,f", [(1, 3), (2, 3), (3, 3), (2, 5)])
def test_residual_when_too_few_channels(k, f):
    g = torch.Generator().manual_seed(7)
    assert k * f * f <= 64  # N ≥ k·f²: the converse holds
    for d in (k * f * f - k, k * f * f // 2):
        assert residual_for(k, f, d, g) > 1e-3


def test_residual_when_a_tap_has_fewer_than_k_channels_despite_d_equal_kf2():
    g = torch.Generator().manual_seed(3)
    k, f = 2, 3
    taps = kernel_offsets(f)
    offsets = taps * k
    offsets[0] = taps[1]  # tap 0 keeps 1 < k channel, tap 1 gets 3; still D = k·f²
    x = low_rank(64, len(offsets), k, g)
    z = filter_output(x, GRID, torch.randn(f, f, len(offsets), 3, generator=g, dtype=torch.float64))
    assert mixing_residual(x, GRID, f, offsets, z) > 1e-3


def test_spanning_fails_when_channels_of_a_tap_share_a_b_column_direction():
    g = torch.Generator().manual_seed(4)
    k, f = 2, 3
    offsets = kernel_offsets(f) * k  # channel c and c + 9 share a tap
    a = torch.randn(64, k, generator=g, dtype=torch.float64)
    b = torch.randn(k, 18, generator=g, dtype=torch.float64)
    b[:, 9] = 2 * b[:, 0]  # tap 0's two B columns are parallel: they do not span ℝ²
    x = a @ b
    z = filter_output(x, GRID, torch.randn(f, f, 18, 3, generator=g, dtype=torch.float64))
    assert mixing_residual(x, GRID, f, offsets, z) > 1e-3


def test_random_offsets_reach_zero_once_covered():
    g = torch.Generator().manual_seed(5)
    curve = proposition1_curve(1, 3, GRID, [4, 9, 40, 60], trials=4, generator=g, assignment="random")
    assert curve[0, 0] > 1e-3 and curve[-1, 1] < 1e-8  # 60 draws cover 9 taps (fails w.p. ≈ 9·(8/9)^60 ≈ 8e-3)


@pytest.mark.parametrize("assignment", ["balanced", "random"])
def test_mean_residual_non_increasing_in_d(assignment):
    g = torch.Generator().manual_seed(6)
    k, f = 2, 3
    counts = [1, 2, 4, 6, 9, 12, 15, 18, 24, 30, 36]
    curve = proposition1_curve(k, f, GRID, counts, trials=5, generator=g, assignment=assignment)
    mean = curve[:, 0]
    assert torch.all(mean[1:] <= mean[:-1] + 1e-12)
    assert torch.all(curve[:, 1] >= curve[:, 0])
    assert mean[0] > 0.1
    if assignment == "balanced":
        assert curve[counts.index(k * f * f) :, 1].max() < 1e-8
        assert curve[counts.index(k * f * f) - 1, 0] > 1e-3


def test_kf2_bound_is_sufficient_not_necessary_when_n_is_small():
    # 4×4 grid: N = 16 < k·f² = 18, so D = N balanced channels already reach every target.
    g = torch.Generator().manual_seed(8)
    assert residual_for(2, 3, 16, g, grid=(4, 4)) < 1e-8


def depthwise_reference(x, grid, offsets, f):
    h, w = grid
    d = x.shape[1]
    filt = torch.zeros(d, 1, f, f, dtype=x.dtype)
    for c, (dy, dx) in enumerate(offsets):
        filt[c, 0, dy + f // 2, dx + f // 2] = 1
    return F.conv2d(x.T.reshape(1, d, h, w), filt, padding=f // 2, groups=d).reshape(d, h * w).T


@pytest.mark.parametrize("grid,f", [((8, 8), 3), ((5, 7), 5), ((3, 6), 3), ((7, 7), 7)])
def test_impulse_features_matches_depthwise_conv2d(grid, f):
    g = torch.Generator().manual_seed(9)
    d = 2 * f * f
    x = torch.randn(grid[0] * grid[1], d, generator=g, dtype=torch.float64)
    offsets = channel_assignment(d, f, "random", g)
    torch.testing.assert_close(impulse_features(x, grid, offsets, f), depthwise_reference(x, grid, offsets, f))
    # and with the N×N shift matrices of structinit.impulse_matrix
    cols = [impulse_matrix(grid, o, dtype=torch.float64) @ x[:, c] for c, o in enumerate(offsets)]
    torch.testing.assert_close(impulse_features(x, grid, offsets), torch.stack(cols, 1))


@pytest.mark.parametrize("grid,f,d,d_out", [((8, 8), 3, 5, 4), ((5, 7), 5, 3, 2), ((6, 4), 3, 1, 1)])
def test_filter_output_matches_conv2d(grid, f, d, d_out):
    g = torch.Generator().manual_seed(10)
    h, w = grid
    x = torch.randn(h * w, d, generator=g, dtype=torch.float64)
    weight = torch.randn(d_out, d, f, f, generator=g, dtype=torch.float64)  # conv2d layout
    ref = F.conv2d(x.T.reshape(1, d, h, w), weight, padding=f // 2).reshape(d_out, h * w).T
    torch.testing.assert_close(filter_output(x, grid, weight.permute(2, 3, 1, 0)), ref)


def test_validation_errors_name_the_parameter():
    x = torch.zeros(64, 9, dtype=torch.float64)
    z = torch.ones(64, 2, dtype=torch.float64)
    offs = kernel_offsets(3)
    with pytest.raises(ValueError, match="kernel_size"):
        mixing_residual(x, GRID, 4, offs, z)
    with pytest.raises(ValueError, match=r"channel_offsets.*outside"):
        mixing_residual(x, GRID, 3, [*offs[:8], (2, 0)], z)
    with pytest.raises(ValueError, match=r"channel_offsets.*not a pair"):
        mixing_residual(x, GRID, 3, [*offs[:8], (1, 0, 0)], z)
    with pytest.raises(ValueError, match=r"channel_offsets.*D=9"):
        mixing_residual(x, GRID, 3, offs[:8], z)
    with pytest.raises(ValueError, match="target"):
        mixing_residual(x, GRID, 3, offs, torch.ones(63, 2))
    with pytest.raises(ValueError, match=r"target.*zeros"):
        mixing_residual(x, GRID, 3, offs, torch.zeros(64, 2))
    with pytest.raises(ValueError, match=r"x:.*grid"):
        mixing_residual(x, (7, 8), 3, offs, z)
    with pytest.raises(ValueError, match=r"x:.*shape"):
        impulse_features(torch.zeros(64), GRID, offs)
    with pytest.raises(ValueError, match=r"offsets.*outside"):
        impulse_features(x, GRID, [*offs[:8], (0, 2)], kernel_size=3)
    with pytest.raises(ValueError, match="weights"):
        filter_output(x, GRID, torch.zeros(3, 3, 8, 2))
    with pytest.raises(ValueError, match="kernel_size"):
        filter_output(x, GRID, torch.zeros(2, 2, 9, 2))
    with pytest.raises(ValueError, match="assignment"):
        proposition1_curve(1, 3, GRID, [9], assignment="cyclic")
    with pytest.raises(ValueError, match="channel_counts"):
        proposition1_curve(1, 3, GRID, [0, 9])
    with pytest.raises(ValueError, match="k=0"):
        proposition1_curve(0, 3, GRID, [9])
    with pytest.raises(ValueError, match="kernel_size"):
        proposition1_curve(1, 9, GRID, [9])
