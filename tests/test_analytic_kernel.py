"""The analytic solver's 2-D kernel: exact argmax, shift invariance, the ridge readout, and
properties over dims, heads, grids and kernels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import structinit
from golden_helpers import differences, failure, fingerprints, load, unsigned_kernel_factors
from impulse_helpers import hit_and_mass, ln_sincos, logits_from_factors, small_vit, target_margins
from structinit.functional.impulse_analytic import analytic_qk, ridge_readout
from structinit.functional.posembed import sincos_frequencies


@pytest.mark.parametrize("dim,heads,grid,kernel", [(64, 4, (9, 9), 5), (64, 2, (7, 10), 3), (192, 3, (12, 12), 7)])
def test_analytic_kernel_argmax_exactly_at_target(dim, heads, grid, kernel):
    taps = structinit.kernel_offsets(kernel)
    offsets = [taps[(7 * h + 3) % len(taps)] for h in range(heads)]
    z = ln_sincos(grid, dim)
    wq, wk = analytic_qk(z, grid, offsets, dim // heads, sincos_frequencies(dim))
    assert wq.shape == wk.shape == (heads, dim, dim // heads)
    logits = logits_from_factors(z, wq, wk)
    for h, off in enumerate(offsets):
        t = structinit.target_index(grid, off)
        rows = torch.nonzero(t >= 0).squeeze(1)
        assert torch.equal(logits[h, rows].argmax(-1), t[rows]), (h, off)
    assert min(target_margins(logits, grid, offsets)) > 0


def _shift_windows(logits, grid, p1, p2, reach=2):
    """Logits of rows p1 and p2 at the same relative displacements δ, |δ| ≤ reach."""
    w = grid[1]
    a, b = [], []
    for dy in range(-reach, reach + 1):
        for dx in range(-reach, reach + 1):
            a.append(logits[p1[0] * w + p1[1], (p1[0] + dy) * w + p1[1] + dx])
            b.append(logits[p2[0] * w + p2[1], (p2[0] + dy) * w + p2[1] + dx])
    return torch.stack(a), torch.stack(b)


def test_analytic_kernel_is_shift_invariant_on_raw_sincos():
    """Control for the next test: read out of the *raw* sin-cos table the kernel is
    κ(p, p') = f(p' − p) up to the small ridge bias, with a margin ≈ 1 at the target."""
    dim, grid = 64, (10, 10)
    offsets = [(0, 0), (-1, 1), (2, 0), (1, -2)]
    pe = structinit.sincos_2d(grid, dim, dtype=torch.float64)
    wq, wk = analytic_qk(pe, grid, offsets, dim // 4, sincos_frequencies(dim))
    logits = logits_from_factors(pe, wq, wk)
    for h in range(4):
        a, b = _shift_windows(logits[h], grid, (2, 2), (7, 7))
        spread = (a.max() - a.min()).item()
        assert (a - b).abs().max().item() < 0.01 * spread
    assert min(target_margins(logits, grid, offsets)) > 0.9


@pytest.mark.parametrize("dim,heads", [(64, 4), (192, 3)])
def test_analytic_readout_through_layernorm_is_the_ridge_solution(dim, heads):
    """Through LayerNorm no linear readout is exact (each token is divided by its own std), so
    the documented contract is: the readout R = Zᵀ(ZZᵀ + λI)⁻¹ solves the ridge normal equations
    Zᵀ(Z R T − T) + λ R T = 0 for any feature table T, it sums to zero over channels (LayerNorm's
    mean is ignored), and the kernel stays shift-invariant to within the ~±10 % token-scale
    spread (the argmax itself is guaranteed separately by impulse_qk's check)."""
    grid = (10, 10)
    z = ln_sincos(grid, dim)
    readout = ridge_readout(z, ridge=2e-3)
    feats = torch.randn(z.shape[0], 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = readout @ feats
    lam = 2e-3 * (z @ z.T).diagonal().mean()
    residual = z.T @ (z @ w - feats) + lam * w
    assert residual.abs().max() < 1e-8 * (z.T @ feats).abs().max()
    assert w.sum(0).abs().max() < 1e-9
    offsets = [(0, 0), (-1, 1), (2, 0), (1, -2)][:heads]
    wq, wk = analytic_qk(z, grid, offsets, dim // heads, sincos_frequencies(dim))
    logits = logits_from_factors(z, wq, wk)
    for h in range(heads):
        a, b = _shift_windows(logits[h], grid, (2, 2), (7, 7))
        spread = (a.max() - a.min()).item()
        assert ((a - a.mean()) - (b - b.mean())).abs().max().item() < 0.15 * spread


@pytest.mark.parametrize("dim,heads,side", [(16, 2, 10), (16, 1, 8), (12, 1, 8), (8, 1, 8)])
def test_analytic_small_embed_dim_hits_every_target_or_refuses(dim, heads, side):
    """A width too small for LayerNorm's per-token scale to be absorbed by the kernel margin must
    not silently give a broken structure: either every head's argmax is on its target with the
    position-only pseudo input, or the init raises naming the size, and the model is untouched."""
    model = small_vit(img_size=side, patch_size=1, embed_dim=dim, depth=1, num_heads=heads, num_classes=0)
    taps = structinit.kernel_offsets(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        structinit.init_(model, "impulse", offsets=taps[-heads:], seed=0)
    except ValueError as err:
        assert f"head_dim={dim // heads}" in str(err) and "misses" in str(err)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return
    hit, _ = hit_and_mass(model)
    assert hit.min().item() == 1.0, hit


def _dims_heads():
    return st.tuples(st.integers(1, 4), st.integers(2, 16)).map(lambda t: (4 * t[0] * t[1], t[0])).filter(
        lambda t: t[0] // t[1] >= 8 and t[0] <= 64)


# Derandomised (a fixed example set, so the suite is stable) and without shrinking (each example
# runs a solver; the explicit small-width test above pins the known failures deterministically).
NO_SHRINK = dict(deadline=None, derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                 suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


@settings(max_examples=15, **NO_SHRINK)
@given(dh=_dims_heads(), side=st.integers(3, 10), data=st.data())
def test_property_analytic_model_hits_every_target(dh, side, data):
    dim, heads = dh
    kernel = data.draw(st.sampled_from([k for k in (3, 5, 7) if k <= side]), label="kernel")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    model = small_vit(img_size=side, patch_size=1, embed_dim=dim, depth=1, num_heads=heads, num_classes=0)
    structinit.init_(model, "impulse", kernel_size=kernel, seed=seed)
    hit, mass = hit_and_mass(model)
    assert hit.min().item() == 1.0, (hit, model.blocks[0].attn.structinit_impulse["offsets"])
    assert abs(mass.mean().item() - 0.5) < 1e-3


@settings(max_examples=15, **NO_SHRINK)
@given(dh=_dims_heads(), h=st.integers(3, 10), w=st.integers(3, 10), data=st.data())
def test_property_analytic_kernel_non_square_grids(dh, h, w, data):
    dim, heads = dh
    kernel = data.draw(st.sampled_from([k for k in (3, 5, 7) if k <= min(h, w)]), label="kernel")
    offsets = data.draw(st.lists(st.sampled_from(structinit.kernel_offsets(kernel)), min_size=heads,
                                 max_size=heads), label="offsets")
    z = ln_sincos((h, w), dim)
    wq, wk = analytic_qk(z, (h, w), offsets, dim // heads, sincos_frequencies(dim))
    logits = logits_from_factors(z, wq, wk)
    assert min(target_margins(logits, (h, w), offsets)) > 0


# --------------------------------------------------------------------------- the signed kernel
def _signed_logits(grid, dim, heads, kernel, seed=0):
    taps = structinit.kernel_offsets(kernel)
    g = torch.Generator().manual_seed(seed)
    offsets = [taps[int(i)] for i in torch.randint(len(taps), (heads,), generator=g)]
    pe = structinit.sincos_2d(grid, dim, dtype=torch.float64)
    z = ln_sincos(grid, dim)
    sigma = (pe.var(-1, unbiased=False) + 1e-6).sqrt()
    wq, wk = analytic_qk(z, grid, offsets, dim // heads, signed=True, token_scale=sigma)
    return logits_from_factors(z, wq, wk), offsets


def _target_and_others(logits, grid, offsets):
    """(smallest target logit, largest non-target logit) over heads and in-grid rows."""
    lo, hi = float("inf"), -float("inf")
    for h, off in enumerate(offsets):
        t = structinit.target_index(grid, off)
        rows = torch.nonzero(t >= 0).squeeze(1)
        block = logits[h, rows].clone()
        lo = min(lo, float(block[torch.arange(len(rows)), t[rows]].min()))
        block[torch.arange(len(rows)), t[rows]] = -float("inf")
        hi = max(hi, float(block.max()))
    return lo, hi


@pytest.mark.parametrize("dim,heads,grid,kernel", [(128, 4, (8, 8), 3), (192, 3, (16, 16), 3), (96, 3, (7, 9), 5)])
def test_signed_kernel_target_positive_every_other_logit_negative_through_layernorm(dim, heads, grid, kernel):
    """The claim that makes the argmax content-proof: on LN(sin-cos) the target logit is > 0 and
    every other logit < 0 (fitted as T/σ, the readout is exact through LayerNorm)."""
    logits, offsets = _signed_logits(grid, dim, heads, kernel)
    lo, hi = _target_and_others(logits, grid, offsets)
    assert lo > 0.5 and hi < -0.5, (lo, hi)


def test_signed_kernel_argmax_survives_any_positive_token_scales():
    """Content changes each token's LayerNorm std; with reservation that multiplies query i's and
    key j's features by a_i, a_j > 0. The signed kernel's argmax is the target for any such
    scales, here drawn over two orders of magnitude; the unsigned cosine kernel's is not."""
    grid, dim, heads = (8, 8), 128, 4
    logits, offsets = _signed_logits(grid, dim, heads, 3)
    g = torch.Generator().manual_seed(1)
    a = torch.exp(torch.empty(64, dtype=torch.float64).uniform_(-2.3, 2.3, generator=g))
    scaled = logits * a[:, None] * a[None, :]
    assert min(target_margins(scaled, grid, offsets)) > 0
    z = ln_sincos(grid, dim)
    wq, wk = analytic_qk(z, grid, offsets, dim // heads)
    cosine = logits_from_factors(z, wq, wk) * a[:, None] * a[None, :]
    assert min(target_margins(cosine, grid, offsets)) < 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])
@given(side_h=st.integers(3, 12), side_w=st.integers(3, 12), heads=st.integers(1, 4),
       head_dim=st.sampled_from([16, 24, 32, 48]), seed=st.integers(0, 10_000))
def test_signed_kernel_sign_pattern_over_shapes(side_h, side_w, heads, head_dim, seed):
    grid, dim = (side_h, side_w), heads * head_dim
    if dim % 4:
        return
    logits, offsets = _signed_logits(grid, dim, heads, 3, seed)
    lo, hi = _target_and_others(logits, grid, offsets)
    assert lo > 0 > hi, (lo, hi)


def test_signed_kernel_needs_one_more_dimension():
    z = ln_sincos((4, 4), 16)
    with pytest.raises(ValueError, match=r"head_dim=4.*at least 5 dimensions.*signed kernel"):
        analytic_qk(z, (4, 4), [(0, 0)], 4, signed=True)


# --------------------------------------------------------------------------- content term
def test_content_term_is_the_projected_mimetic_truncation_and_silent_on_position():
    from structinit.functional.impulse_analytic import content_qk
    from structinit.functional.mimetic import mimetic_noise
    from structinit.functional.reservation import position_basis

    grid, dim, heads, head_dim, used = (8, 8), 64, 2, 32, 13
    z = ln_sincos(grid, dim)
    wq, wk = content_qk(z, heads, head_dim, used, 0.7, generator=torch.Generator().manual_seed(3))
    assert wq.shape == wk.shape == (heads, dim, head_dim)
    assert torch.count_nonzero(wq[..., :used]) == 0 and torch.count_nonzero(wk[..., :used]) == 0
    torch.testing.assert_close(logits_from_factors(z, wq, wk), torch.zeros(heads, 64, 64, dtype=torch.float64),
                               atol=1e-10, rtol=0)  # the position-only input gets no content logit
    u = position_basis(z)
    ones = torch.full((dim, 1), dim**-0.5, dtype=torch.float64)
    proj = torch.eye(dim, dtype=torch.float64) - u @ u.T - ones @ ones.T
    gen = torch.Generator().manual_seed(3)
    for h in range(heads):
        m = 0.7 * proj @ (mimetic_noise(dim, generator=gen) + torch.eye(dim, dtype=torch.float64)) @ proj
        a, s, b = torch.linalg.svd(m)
        best = (a[:, : head_dim - used] * s[: head_dim - used]) @ b[: head_dim - used]
        torch.testing.assert_close(wq[h] @ wk[h].T, best, atol=1e-10, rtol=0)


def test_content_option_keeps_position_only_fidelity_and_halves_the_position_columns():
    from structinit.functional.impulse_analytic import position_columns

    model = small_vit(img_size=16, patch_size=2, embed_dim=64, depth=2, num_heads=2)
    structinit.init_(model, "impulse", content=0.5, seed=0)
    hit, mass = hit_and_mass(model)
    assert hit.min().item() == 1.0
    torch.testing.assert_close(mass.mean(), torch.tensor(0.5), atol=1e-4, rtol=0)
    used = position_columns(32, True, 3)
    assert used == 13  # half of 32 columns: 3 frequencies per axis + the constant
    qk = model.blocks[0].attn.qkv.weight.detach()
    assert qk[:32][used:].abs().max() > 0  # the content term fills the rest of head 0's query rows
    capped = small_vit(img_size=16, patch_size=2, embed_dim=64, depth=2, num_heads=2)
    structinit.init_(capped, "impulse", frequencies=2, seed=0)
    assert torch.count_nonzero(capped.blocks[0].attn.qkv.weight[:32][position_columns(32, True, 2):]) == 0
    assert hit_and_mass(capped)[0].min().item() == 1.0


def test_unsigned_solver_is_the_earlier_kernel_bit_for_bit():
    """signed=False must reproduce the unsigned kernel of earlier releases (published results were
    measured with it): no token-scale fit, no constant column. The reference is stored, not
    recomputed: fingerprints of Wq, Wk in tests/golden/scheme_weights.json, made when the current
    solver and ``impulse_qk`` of the release before the signed kernel (commit 1a4cd72^) gave
    bit-identical factors. Compared to float noise (rtol 1e-5), as LAPACK and SLSQP round
    differently across machines; any change of the kernel's maths moves them far more."""
    diffs = differences(load()["references"]["unsigned_analytic_kernel"], fingerprints(unsigned_kernel_factors()))
    assert not diffs, failure("the unsigned analytic kernel (signed=False)", "unsigned_analytic_kernel", diffs)
    # and the solver adds nothing to the kernel function it calls
    from structinit.functional.impulse_analytic import impulse_qk
    from structinit.functional.impulse_solvers import LayerSpec, make_impulse_solver

    grid, dim, offsets = (8, 8), 64, ((0, 0), (1, -1))
    z = ln_sincos(grid, dim)
    solved = make_impulse_solver("analytic", signed=False).solve(z, grid, [LayerSpec(offsets, 32, 32**-0.5)], None)
    wq, wk = impulse_qk(z, grid, list(offsets), 32, target_mass=0.5, softmax_scale=32**-0.5)
    assert torch.equal(solved[0].wq, wq) and torch.equal(solved[0].wk, wk)


def test_a_grid_too_large_for_the_readout_is_refused_before_it_is_formed():
    from structinit.functional.impulse_analytic import ridge_readout

    with pytest.raises(ValueError, match=r"20000 tokens: the ridge readout forms a 20000×20000 float64 Gram matrix"):
        ridge_readout(torch.zeros(20000, 4))
