"""The impulse through rotary position embeddings: constant q and k whose rotated dot products
peak at the filter's offset, only there, with the wanted softmax mass."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from structinit.functional.rope import rope_impulse_terms, rope_logits
from structinit.functional.targets import kernel_offsets


def axial_bands(per_axis: int = 16, theta: float = 1e4) -> tuple[torch.Tensor, list[int]]:
    """timm's axial 2-D RoPE: ``per_axis`` bands θ^(−i/per_axis) on rows, the same on columns."""
    bands = theta ** (-torch.arange(per_axis, dtype=torch.float64) / per_axis)
    return torch.cat([bands, bands]), [0] * per_axis + [1] * per_axis


def hits(logits: torch.Tensor, offset, grid) -> list[tuple[bool, float]]:
    """(argmax is the target, mass on it) of every query whose target key is in the grid."""
    h, w = grid
    probs = torch.softmax(logits, -1)
    out = []
    for i in range(h * w):
        y, x = divmod(i, w)
        ty, tx = y + offset[0], x + offset[1]
        if 0 <= ty < h and 0 <= tx < w:
            out.append((int(probs[i].argmax()) == ty * w + tx, float(probs[i, ty * w + tx])))
    return out


@settings(max_examples=25, deadline=None)
@given(h=st.integers(2, 16), w=st.integers(2, 16), kernel=st.sampled_from([3, 5]), data=st.data(),
       per_axis=st.sampled_from([8, 16]), mass=st.floats(0.3, 0.98))
def test_every_query_whose_target_exists_puts_the_target_mass_on_it(h, w, kernel, data, per_axis, mass):
    offsets = [o for o in kernel_offsets(kernel) if abs(o[0]) < h and abs(o[1]) < w]
    offset = data.draw(st.sampled_from(offsets))
    freqs, axes = axial_bands(per_axis)
    amplitudes, phases = rope_impulse_terms(freqs, axes, offset, (h, w), mass)
    found = hits(rope_logits(freqs, axes, amplitudes, phases, (h, w)), offset, (h, w))
    assert all(top for top, _ in found)
    assert min(m for _, m in found) == pytest.approx(mass, abs=1e-6)  # the worst query gets exactly that


def test_every_band_peaks_at_the_offset():
    freqs, axes = axial_bands()
    amplitudes, phases = rope_impulse_terms(freqs, axes, (1, -1), (8, 8))
    shift = torch.tensor([1.0 if a == 0 else -1.0 for a in axes], dtype=torch.float64)
    assert torch.allclose(phases, freqs * shift * (amplitudes > 0))
    assert 0 < int((amplitudes > 0).sum()) < len(freqs)  # the fastest bands, not all of them


def test_the_logits_are_those_of_rotated_constant_q_and_k():
    """Rotate constant q, k by each token's angles, pair by pair, as a RoPE layer does, and take
    the dot products: they are rope_logits, with q_f = √A_f and k_f = √A_f e^{−iφ_f}."""
    freqs, axes = axial_bands(8)
    grid = (5, 6)
    amplitudes, phases = rope_impulse_terms(freqs, axes, (0, 1), grid)
    q = torch.stack([amplitudes.sqrt(), torch.zeros_like(amplitudes)], -1)  # (F, 2): real pairs
    k = amplitudes.sqrt()[:, None] * torch.stack([torch.cos(-phases), torch.sin(-phases)], -1)
    y, x = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    pos = torch.stack([y.flatten(), x.flatten()], 1).double()
    angle = freqs * pos[:, axes]  # (N, F)

    def rotate(v):  # (F, 2) rotated by every token's angle: (N, F, 2)
        c, s = torch.cos(angle), torch.sin(angle)
        return torch.stack([c * v[:, 0] - s * v[:, 1], s * v[:, 0] + c * v[:, 1]], -1)

    logits = torch.einsum("ifc,jfc->ij", rotate(q), rotate(k))
    assert torch.allclose(logits, rope_logits(freqs, axes, amplitudes, phases, grid), atol=1e-9)


def test_a_band_that_aliases_on_the_grid_is_refused():
    freqs = torch.tensor([math.pi, math.pi])  # period 2: every other token looks the same
    with pytest.raises(ValueError, match=r"axis rows .*no unique peak at offset 1 on 6 tokens"):
        rope_impulse_terms(freqs, [0, 1], (1, 0), (6, 6))


@pytest.mark.parametrize(("freq", "match"), [
    (1e-3, r"target_mass=0.95: not reachable"),  # a peak, but too flat for any sane amplitude
    (1e-7, r"axis rows \(1e-07\) give no unique peak"),  # flat to float64's precision
])
def test_bands_too_slow_to_single_out_a_token_are_refused(freq, match):
    with pytest.raises(ValueError, match=match):
        rope_impulse_terms(torch.tensor([freq, freq]), [0, 1], (1, 1), (8, 8))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"axes": [0, 2]}, r"axes: expected one 0 \(rows\) or 1 \(columns\)"),
    ({"axes": [0]}, r"axes: expected one 0"),
    ({"offset": (4, 0)}, r"offset \(4, 0\): outside a 4×4 grid"),
    ({"grid": (0, 4)}, r"grid rows=0"),
    ({"target_mass": 1.0}, r"target_mass=1.0"),
    ({"freqs": torch.tensor([math.nan, 1.0])}, r"freqs: .*NaN"),
])
def test_bad_input_is_named(kwargs, match):
    args = {"freqs": torch.tensor([1.0, 1.0]), "axes": [0, 1], "offset": (1, 0), "grid": (4, 4), **kwargs}
    with pytest.raises(ValueError, match=match):
        rope_impulse_terms(args["freqs"], args["axes"], args["offset"], args["grid"], args.get("target_mass", 0.9))
