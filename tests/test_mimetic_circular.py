"""The circular noise of the mimetic init: Z = Q B Qᵀ, a random normal matrix with Haar
eigenvectors and eigenvalues filling the disk of radius √2 evenly. Its rank-r truncation is built
in closed form, never from a D×D SVD; these tests check it against the SVD of the M it stands
for (Eckart–Young), and Z's properties (normal, entry variance 1/D, spectrum)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import structinit
from structinit.functional.mimetic import NOISE, circular_factors, circular_spectrum


def gen(seed):
    return torch.Generator().manual_seed(seed)


def eye(d):
    return torch.eye(d, dtype=torch.float64)


def check_best_rank_r(p: torch.Tensor, m: torch.Tensor, rank: int) -> None:
    """p is a best rank-``rank`` approximation of m: rank ≤ r and ‖m − p‖_F equals the norm of
    m's tail singular values (Eckart–Young); equal to the SVD truncation where that is unique."""
    u, s, vh = torch.linalg.svd(m)
    scale = s[0].item()
    tail = torch.linalg.svdvals(p)[rank:]
    assert tail.numel() == 0 or tail.max().item() <= 1e-10 * scale
    assert abs((m - p).norm().item() - s[rank:].norm().item()) <= 1e-10 * scale * m.shape[0]
    if rank < len(s) and s[rank - 1] - s[rank] > 1e-6 * scale:  # unique truncation
        torch.testing.assert_close(p, (u[:, :rank] * s[:rank]) @ vh[:rank], atol=1e-9 * scale, rtol=0)


@pytest.mark.parametrize("dim,rank", [(192, 64), (64, 16), (17, 4), (16, 5), (33, 33), (32, 31), (9, 1), (2, 1)])
@pytest.mark.parametrize("alpha,beta", [(0.7, 0.7), (0.4, -0.4), (2.0, 0.1)])
def test_factors_are_the_best_rank_r_approximation_of_m(dim, rank, alpha, beta):
    left, right, m = circular_factors(dim, rank, alpha, beta, heads=2, with_target=True, generator=gen(dim + rank))
    assert left.shape == (2, dim, rank) and right.shape == (2, rank, dim) and m.shape == (2, dim, dim)
    for h in range(2):
        check_best_rank_r(left[h] @ right[h], m[h], rank)
        # balanced, like U S^½ and S^½ Vᵀ: both factors carry the square roots of M's top singular values
        s = torch.linalg.svdvals(m[h])[:rank]
        torch.testing.assert_close(torch.linalg.svdvals(left[h]) ** 2, s, atol=1e-10, rtol=0)
        torch.testing.assert_close(torch.linalg.svdvals(right[h]) ** 2, s, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dim", [16, 17, 96])
def test_z_is_a_normal_matrix_with_a_disk_spectrum(dim):
    _, _, m = circular_factors(dim, dim // 4 + 1, 0.7, 0.7, heads=3, with_target=True, generator=gen(dim))
    z = (m - 0.7 * eye(dim)) / 0.7
    for h in range(3):
        torch.testing.assert_close(z[h] @ z[h].T, z[h].T @ z[h], atol=1e-10, rtol=0)
        eig = torch.linalg.eigvals(z[h])
        assert eig.abs().max().item() <= math.sqrt(2) + 1e-9
        assert abs(z[h].trace().item()) <= 1 + 1e-9  # 0, or the ±1 real eigenvalue of an odd D
        assert (eig.imag.abs() > 1e-9).sum().item() >= 2 * (dim // 2) - 2  # conjugate pairs (one may be ≈ real)
    assert not torch.allclose(m[0], m[1])  # a fresh Z per head


def test_z_has_the_iid_noise_mean_variance_and_energy():
    """Entries of mean 0 and variance 1/D, and ‖Z‖²_F = D, as for the i.i.d. uniform noise;
    eigenvalues evenly on the disk of radius √2, so half of them lie inside the unit circle."""
    dim, draws = 64, 40
    _, _, m = circular_factors(dim, 8, 1.0, 0.0, heads=draws, with_target=True, generator=gen(0))
    z = m  # α = 1, β = 0
    off = z[:, ~torch.eye(dim, dtype=torch.bool)]
    assert abs(off.mean().item()) < 0.1 / math.sqrt(dim)
    assert abs(off.pow(2).mean().item() * dim - 1) < 0.05
    assert abs(z.pow(2).sum((1, 2)).mean().item() / dim - 1) < 0.05
    inside = (torch.linalg.eigvals(z).abs() < 1).double().mean().item()
    assert abs(inside - 0.5) < 0.03


def test_the_spectrum_is_the_fixed_even_filling_of_the_disk():
    """Every draw has the same eigenvalues (circular_spectrum): only the Haar eigenvectors are
    random, and the mirrored pattern makes tr Z = 0 (i.i.d. noise has tr Z = O(1))."""
    rho, theta = circular_spectrum(12)
    assert rho.shape == theta.shape == (12,) and rho.max() < math.sqrt(2)
    torch.testing.assert_close((rho * torch.cos(theta)).sum(), torch.tensor(0.0, dtype=torch.float64), atol=1e-12,
                               rtol=0)
    torch.testing.assert_close((rho**2).sum(), torch.tensor(12.0, dtype=torch.float64), atol=1e-12, rtol=0)
    expected = torch.cat([torch.polar(rho, theta), torch.polar(rho, -theta)])
    for seed in (1, 2):
        _, _, m = circular_factors(24, 12, 0.3, -2.0, with_target=True, generator=gen(seed))
        eig = torch.linalg.eigvals((m[0] + 2.0 * eye(24)) / 0.3)
        for part in (lambda e: e.real, lambda e: e.imag):
            torch.testing.assert_close(part(eig).sort().values, part(expected).sort().values, atol=1e-9, rtol=0)
    _, _, m = circular_factors(7, 3, 1.0, 0.0, heads=8, with_target=True, generator=gen(0))
    traces = {round(t, 9) for t in m.diagonal(dim1=1, dim2=2).sum(1).tolist()}
    assert traces == {-1.0, 1.0}  # odd D: the real eigenvalue ±1, its sign drawn


def test_factors_do_not_depend_on_building_the_target():
    """The scheme never builds M (O(D³)); what it writes must equal what the tests check."""
    for dim, rank in ((64, 16), (33, 10), (20, 20)):
        a = circular_factors(dim, rank, 0.7, 0.7, heads=3, with_target=True, generator=gen(5))
        b = circular_factors(dim, rank, 0.7, 0.7, heads=3, with_target=False, generator=gen(5))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and b[2] is None


def test_public_functions_route_to_it():
    wq, wk, m = structinit.mimetic_qk(48, 4, 12, noise="circular", generator=gen(2))
    assert wq.shape == wk.shape == (4, 48, 12) and m.shape == (4, 48, 48)
    for h in range(4):
        check_best_rank_r(wq[h] @ wk[h].T, m[h], 12)
    assert not torch.allclose(wq, wk)  # W_q ≠ W_k: the blocks' rotations sit in W_k only
    lean = structinit.mimetic_qk(48, 4, 12, noise="circular", generator=gen(2), with_target=False)
    assert torch.equal(lean[0], wq) and torch.equal(lean[1], wk) and lean[2] is None
    wv, wo, mv = structinit.mimetic_vo(48, 48, noise="circular", generator=gen(3))
    torch.testing.assert_close(wv @ wo, mv, atol=1e-10, rtol=0)
    assert (mv.diagonal() < 0).float().mean().item() > 0.9  # γZ − δI: −δ on the diagonal, plus noise
    wv, wo, mv = structinit.mimetic_vo(48, 20, noise="circular", generator=gen(3))
    check_best_rank_r(wv @ wo, mv, 20)
    left, right, mf = structinit.mimetic_factors(30, 0.7, 0.7, noise="circular", generator=gen(4))
    torch.testing.assert_close(left @ right, mf, atol=1e-10, rtol=0)


@settings(max_examples=40, deadline=None)
@given(dim=st.integers(1, 40), data=st.data(), seed=st.integers(0, 2**31 - 1),
       alpha=st.floats(0.05, 2.0), beta=st.floats(-1.5, 1.5))
def test_property_best_rank_r_over_shapes(dim, data, seed, alpha, beta):
    rank = data.draw(st.integers(1, dim))
    heads = data.draw(st.integers(1, 3))
    left, right, m = circular_factors(dim, rank, alpha, beta, heads=heads, with_target=True, generator=gen(seed))
    for h in range(heads):
        check_best_rank_r(left[h] @ right[h], m[h], rank)


# --------------------------------------------------------------------------- model level
def test_model_products_and_reproducibility():
    def build(seed):
        torch.manual_seed(0)
        model = structinit.VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=96, depth=2,
                                             num_heads=4)
        structinit.init_(model, "mimetic", noise="circular", seed=seed)
        return model

    model = build(3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), build(3).state_dict().values()))
    assert not torch.equal(model.blocks[0].attn.qkv.weight, build(4).blocks[0].attn.qkv.weight)
    d = 96
    for (_, ad), blk in zip(structinit.find_attention_layers(model), model.blocks):
        wq, bq, wk, bk = ad.read_qk()
        assert torch.count_nonzero(bq) == 0 and torch.count_nonzero(bk) == 0
        for h in range(4):
            p = wq[h].double() @ wk[h].double().T
            s = torch.linalg.svdvals(p)
            assert s[24:].max().item() < 1e-5 * s[0].item()
            assert (p.argmax(1) == torch.arange(d)).double().mean().item() >= 0.95  # uniform noise: 0.97–1.0 here
        wv, _, wo, _ = ad.read_vo()
        c = wv.double() @ wo.double()
        z = (c + 0.4 * eye(d)) / 0.4
        torch.testing.assert_close(z @ z.T, z.T @ z, atol=1e-4, rtol=0)  # normal, to the weights' float32
        assert abs(c.trace().item() + 0.4 * d) < 0.4 * 4 * math.sqrt(d)
        x = torch.randn(3, d, generator=gen(0))
        attn = blk.attn
        with torch.no_grad():
            out = attn.proj(F.linear(x, attn.qkv.weight[2 * d:], attn.qkv.bias[2 * d:]))
        torch.testing.assert_close(out, x @ c.float(), atol=1e-5, rtol=1e-4)


def test_circular_is_the_default_of_the_scheme():
    def weights(**kw):
        torch.manual_seed(0)
        model = structinit.create_model("vit_micro_patch2_16")
        structinit.init_(model, "mimetic", seed=1, **kw)
        return model.state_dict()

    default, circular, uniform = weights(), weights(noise="circular"), weights(noise="uniform")
    assert all(torch.equal(default[k], circular[k]) for k in default)
    assert not torch.equal(default["blocks.0.attn.qkv.weight"], uniform["blocks.0.attn.qkv.weight"])


def test_the_same_seed_gives_the_same_weights_on_any_thread_count():
    """LAPACK's Householder QR rounds differently on 1 and 2 threads; the orthonormalisation the
    circular noise uses (Cholesky QR, BLAS-3) does not, so a run resumed on another thread
    count finds the init it started from."""
    threads = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append([circular_factors(96, r, 0.7, 0.7, heads=3, generator=gen(0))[:2] for r in (8, 40, 96)])
    finally:
        torch.set_num_threads(threads)
    for (l1, r1), (l2, r2) in zip(*out):
        assert torch.equal(l1, l2) and torch.equal(r1, r2)


@settings(max_examples=25, deadline=None)
@given(dim=st.integers(1, 12), extra=st.integers(1, 9), heads=st.integers(1, 3), noise=st.sampled_from(NOISE),
       seed=st.integers(0, 2**31 - 1))
def test_a_head_wider_than_the_model_gets_m_itself_and_zero_channels_past_it(dim, extra, heads, noise, seed):
    """r > D (a language model's 128-channel heads at width 96): Wq Wkᵀ is M exactly, grouped or
    not, and the channels past D are zero on both sides (was an internal shape error)."""
    from structinit.functional.mimetic import mimetic_qk, mimetic_qk_grouped

    r = dim + extra
    wq, wk, m = mimetic_qk(dim, heads, r, noise=noise, generator=gen(seed))
    assert wq.shape == wk.shape == (heads, dim, r)
    torch.testing.assert_close(wq @ wk.transpose(1, 2), m, atol=1e-9, rtol=1e-9)
    assert not wq[..., dim:].any() and not wk[..., dim:].any()
    kv_of = tuple(h // 2 for h in range(2 * heads))
    gq, gk = mimetic_qk_grouped(dim, kv_of, r, noise=noise, generator=gen(seed))
    assert gq.shape == (2 * heads, dim, r) and gk.shape == (heads, dim, r)
    assert not gq[..., dim:].any() and not gk[..., dim:].any()
