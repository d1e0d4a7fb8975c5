import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from structinit.functional.targets import (
    enumerated_offsets,
    impulse_matrix,
    kernel_offsets,
    random_offsets,
    target_index,
    target_indices,
)


def conv_reference(x: torch.Tensor, grid, offset, k):
    """Depthwise zero-padded conv2d of token features x (N, C) with a one-hot k×k filter."""
    h, w = grid
    c = x.shape[1]
    img = x.T.reshape(1, c, h, w)
    filt = torch.zeros(c, 1, k, k, dtype=x.dtype)
    filt[:, 0, offset[0] + k // 2, offset[1] + k // 2] = 1
    return F.conv2d(img, filt, padding=k // 2, groups=c).reshape(c, h * w).T


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), k=st.sampled_from([3, 5, 7]), data=st.data())
def test_impulse_matrix_equals_zero_padded_conv(h, w, k, data):
    offset = data.draw(st.sampled_from(kernel_offsets(k)))
    x = torch.randn(h * w, 4, dtype=torch.float64)
    hm = impulse_matrix((h, w), offset, dtype=torch.float64)
    torch.testing.assert_close(hm @ x, conv_reference(x, (h, w), offset, k))


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 7), w=st.integers(1, 7),
       offsets=st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3)), min_size=1, max_size=6))
def test_target_indices_are_each_offsets_targets(h, w, offsets):
    got = target_indices((h, w), offsets)
    assert got.shape == (len(offsets), h * w) and got.dtype == torch.long
    for k, (dy, dx) in enumerate(offsets):
        want = [(y + dy) * w + (x + dx) if 0 <= y + dy < h and 0 <= x + dx < w else -1
                for y in range(h) for x in range(w)]
        assert got[k].tolist() == want
        assert torch.equal(target_index((h, w), (dy, dx)), got[k])


def test_target_index_matches_matrix():
    grid = (5, 7)
    for off in kernel_offsets(5):
        t = target_index(grid, off)
        hm = impulse_matrix(grid, off)
        for row in range(35):
            if t[row] >= 0:
                assert hm[row].argmax() == t[row] and hm[row].sum() == 1
            else:
                assert hm[row].sum() == 0


def test_enumerated_order_and_cycling():
    assert enumerated_offsets(9) == [(0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1)]
    assert enumerated_offsets(12)[9:] == [(0, 0), (-1, 0), (0, 1)]
    five = enumerated_offsets(25, 5)
    assert len(set(five)) == 25 and five[:9] == enumerated_offsets(9)


def test_random_offsets_seeded():
    a = random_offsets(6, 5, torch.Generator().manual_seed(3))
    b = random_offsets(6, 5, torch.Generator().manual_seed(3))
    assert a == b and all(max(map(abs, o)) <= 2 for o in a)
