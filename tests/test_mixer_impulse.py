"""The token-mixing MLP written by functional.mixer computes the impulse's shift on the grid."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from structinit.functional.mixer import token_mixing_impulse
from structinit.functional.targets import impulse_matrix


def _mlp(x, w1, b1, w2, b2):
    return F.gelu(x @ w1.T + b1) @ w2.T + b2  # x: (..., N) tokens of one channel, as timm's mlp_tokens sees them


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(-1, 1), st.integers(-1, 1), st.integers(0, 3), st.data())
def test_mlp_is_the_shift(h, w, dy, dx, extra, data):
    n = h * w
    wide = data.draw(st.booleans())
    hidden = 2 * n + extra if wide else n + min(extra, n - 1)
    x = torch.randn(5, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(h * 7 + w)).clamp(-2, 2)
    out = _mlp(x, *token_mixing_impulse((h, w), (dy, dx), hidden, dtype=torch.float64))
    shift = impulse_matrix((h, w), (dy, dx), dtype=torch.float64)
    # exact route: to rounding; the margin route: GELU's tail at c = 8, below 6e-9 for inputs ≥ −2
    torch.testing.assert_close(out, x @ shift.T, rtol=0, atol=1e-12 if wide else 1e-8)


def test_unused_hidden_units_are_silent_and_narrow_mlps_are_refused():
    w1, b1, w2, b2 = token_mixing_impulse((3, 3), (0, 1), hidden=12)  # margin route, 3 spare units
    assert torch.equal(b2, torch.full((9,), -8.0))
    assert not w1[9:].any() and not b1[9:].any() and not w2[:, 9:].any()
    with pytest.raises(ValueError, match=r"hidden=8: .* at least N = 9"):
        token_mixing_impulse((3, 3), (0, 1), hidden=8)
    with pytest.raises(ValueError, match="margin"):
        token_mixing_impulse((3, 3), (0, 1), hidden=9, margin=0)
