"""Relative-position bias tables (Swin, BEiT): the index is the offset's row, and an impulse
written into the table puts the wanted mass on each query's target key."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from structinit.functional.relative import impulse_bias_table, impulse_logit, offset_row, relative_position_index
from structinit.functional.targets import impulse_matrix


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(1, 7))
def test_index_is_the_offset_row_of_every_pair(win_h, win_w):
    index = relative_position_index(win_h, win_w)
    n = win_h * win_w
    assert index.shape == (n, n) and int(index.min()) >= 0 and int(index.max()) < (2 * win_h - 1) * (2 * win_w - 1)
    for i in range(n):
        for j in range(n):
            (yi, xi), (yj, xj) = divmod(i, win_w), divmod(j, win_w)
            assert int(index[i, j]) == offset_row((yj - yi, xj - xi), win_h, win_w)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 7), st.integers(2, 7), st.floats(0.3, 0.99), st.data())
def test_impulse_table_gives_each_query_its_target(win_h, win_w, mass, data):
    heads = data.draw(st.integers(1, 4))
    offsets = [(data.draw(st.integers(-1, 1)), data.draw(st.integers(-1, 1))) for _ in range(heads)]
    table = impulse_bias_table(offsets, win_h, win_w, target_mass=mass, dtype=torch.float64)
    probs = table[relative_position_index(win_h, win_w)].permute(2, 0, 1).softmax(-1)  # (heads, N, N)
    for h, offset in enumerate(offsets):
        target = impulse_matrix((win_h, win_w), offset, dtype=torch.float64)
        inside = target.sum(1) > 0
        assert torch.equal(probs[h][inside].argmax(-1), target[inside].argmax(-1))
        torch.testing.assert_close(probs[h][inside][target[inside] > 0], torch.full((int(inside.sum()),), mass,
                                                                                    dtype=torch.float64))
        if (~inside).any():  # the target is outside the window: nothing to raise, the row stays uniform
            torch.testing.assert_close(probs[h][~inside], torch.full_like(probs[h][~inside], 1 / (win_h * win_w)))


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match=r"offset \(3, 0\): outside a 3×3 window"):
        offset_row((3, 0), 3, 3)
    with pytest.raises(ValueError, match="target_mass"):
        impulse_logit(1.0, 9)
    with pytest.raises(ValueError, match="keys"):
        impulse_logit(0.5, 1)
    with pytest.raises(ValueError, match="offsets is empty"):
        impulse_bias_table([], 3, 3)
