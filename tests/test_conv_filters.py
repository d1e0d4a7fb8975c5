"""Depthwise filter families and Gaussian covariances (functional/conv_filters.py), the
depthwise finder, and the conv schemes' checks and transfer."""

import pytest
import torch
from torch import nn

import structinit
from rejection import check_rejected
from structinit.functional import conv_filters as cf


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def tiny(**kw):
    """ConvMixer-16/2, k5 p2. Contiguous weights: rejection.bits cannot view a channels-last 1×1
    conv weight (contiguous by PyTorch's test, but with stride(-1) ≠ 1) as bytes."""
    return structinit.create_model("convmixer_256_8", **{"dim": 16, "depth": 2, "channels_last": False, **kw})


def test_impulse_filters_are_one_hot():
    f = cf.impulse_filters(10, 5, generator=gen())
    assert f.shape == (10, 1, 5, 5) and torch.equal(f.flatten(1).sum(1), torch.ones(10))
    assert torch.equal((f != 0).flatten(1).sum(1), torch.ones(10, dtype=torch.long))
    assert len({int(i) for i in f.flatten(1).argmax(1)}) == 10  # distinct while n ≤ k²
    v = cf.impulse_filters(3, 3, norm="variance", generator=gen())
    torch.testing.assert_close(v.flatten(1).pow(2).sum(1), torch.full((3,), 1 / 3))


def test_num_filters_cycles_over_channels():
    f = cf.impulse_filters(7, 3, num_filters=3, generator=gen())
    assert all(torch.equal(f[c], f[c % 3]) for c in range(7))
    shared = cf.random_filters(6, 3, num_filters=2, generator=gen())
    assert torch.equal(shared[4], shared[0])


def test_box_has_n_taps():
    f = cf.box_filters(20, 5, taps=4, generator=gen())
    assert torch.equal((f != 0).flatten(1).sum(1), torch.full((20,), 4))
    torch.testing.assert_close(f[f != 0], torch.full((80,), 0.25))
    v = cf.box_filters(4, 5, taps=4, norm="variance", generator=gen())
    torch.testing.assert_close(v.flatten(1).pow(2).sum(1), torch.full((4,), 1 / 3))


def test_gaussian_peaks_at_its_centre():
    f = cf.gaussian_filters(30, 7, sigma=1.2, generator=gen()).flatten(1)
    assert torch.allclose(f.sum(1), torch.ones(30))
    peak = f.argmax(1)
    for row, p in zip(f, peak):
        i, j = divmod(int(p), 7)
        assert row[p] == row.max() and (row.view(7, 7)[i, j] > row.view(7, 7)[(i + 1) % 7, j] or i == 6)


def test_random_filters_match_pytorch_default_variance():
    f = cf.random_filters(20000, 5, generator=gen())
    assert f.abs().max() <= 1 / 5 and abs(f.var().item() - 1 / 75) < 5e-4


@pytest.mark.parametrize("k, sigma", [(3, 0.7), (5, 1.5), (4, 2.0)])
def test_covariance_invariants(k, sigma):
    cov = cf.gaussian_kronecker_covariance(k, sigma)
    assert cov.shape == (k * k, k * k) and torch.allclose(cov, cov.T)
    assert torch.linalg.eigvalsh(cov).min() >= -1e-8
    assert abs(float(cov.trace()) - 1 / 3) < 1e-12
    t = cov.view(k, k, k, k)
    for a in range(k - 1):  # stationary: shifting both taps keeps the covariance
        assert torch.allclose(t[a, :, a, :], t[a + 1, :, a + 1, :])
        assert torch.allclose(t[:, a, :, a], t[:, a + 1, :, a + 1])
    s = torch.linalg.svdvals(t.permute(0, 2, 1, 3).reshape(k * k, k * k))  # Kronecker rearrangement
    assert s[1] < 1e-10 * s[0]


def test_sampled_filters_have_the_covariance():
    cov = cf.gaussian_kronecker_covariance(5, 1.0)
    f = cf.sample_filters(cov, 100_000, generator=gen())
    emp = cf.estimate_covariance(f)
    assert torch.linalg.norm(emp - cov) / torch.linalg.norm(cov) < 0.02


def test_sigma_schedule_is_monotone_and_checked():
    up = [cf.depth_sigma(i, 8, 0.5, 1.0) for i in range(8)]
    assert up == sorted(up) and up[0] == 0.5 and up[-1] == 1.5
    down = [cf.depth_sigma(i, 8, 2.0, -1.0) for i in range(8)]
    assert down == sorted(down, reverse=True)
    with pytest.raises(ValueError, match=r"sigma0=0.5, v_sigma=-1.0"):
        cf.depth_sigma(7, 8, 0.5, -1.0)


def test_resize_covariance():
    cov = cf.gaussian_kronecker_covariance(5, 1.0)
    assert torch.equal(cf.resize_covariance(cov, 5), cov)
    for k in (3, 7, 9, 4):
        r = cf.resize_covariance(cov, k)
        assert r.shape == (k * k, k * k) and torch.equal(r, r.T)
        assert torch.linalg.eigvalsh(r).min() >= -1e-10 and abs(float(r.trace()) - 1 / 3) < 1e-9


def test_relative_depth_map():
    assert cf.relative_depth_map(8, 8) == list(range(8))
    assert cf.relative_depth_map(2, 5) == [0, 0, 1, 1, 1] and cf.relative_depth_map(6, 1) == [0]
    assert cf.relative_depth_map(8, 4)[-1] == 7


@pytest.mark.parametrize("call, match", [
    (lambda: cf.gaussian_filters(3, 3, sigma=-1.0), r"sigma=-1\.0"),
    (lambda: cf.box_filters(3, 3, taps=10), r"taps=10"),
    (lambda: cf.impulse_filters(3, 3, norm="l2"), r"norm='l2'"),
    (lambda: cf.gaussian_kronecker_covariance(3, 0.0), r"sigma=0\.0"),
    (lambda: cf.sample_filters(torch.eye(8), 3), r"cov: size 8"),
    (lambda: cf.resize_covariance(torch.ones(1, 1), 3), r"1×1 source"),
])
def test_functional_errors_name_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- finder and schemes
def test_find_depthwise_convs_and_errors():
    model = tiny()
    assert [n for n, _ in structinit.find_depthwise_convs(model)] == ["blocks.0.dw", "blocks.1.dw"]
    assert structinit.find_depthwise_convs(model, ["blocks.1.dw"])[0][1] is model.blocks[1].dw
    with pytest.raises(ValueError, match=r"'blocks\.0\.pw' is Conv2d\(16, 16.*groups=1\), not a depthwise conv"):
        structinit.find_depthwise_convs(model, ["blocks.0.pw"])
    with pytest.raises(ValueError, match=r"'nope' is not a module"):
        structinit.find_depthwise_convs(model, ["nope"])
    with pytest.raises(ValueError, match=r"Sequential has no depthwise conv"):
        structinit.find_depthwise_convs(nn.Sequential(nn.Conv2d(3, 8, 3)))


def test_only_depthwise_weights_are_written():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, "covariance", seed=0)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"blocks.0.dw.weight", "blocks.1.dw.weight"}


def test_covariance_scheme_draws_the_layer_covariance():
    model = structinit.create_model("convmixer_256_8", dim=20000, depth=2, kernel_size=3)
    structinit.init_(model, "covariance", sigma0=0.5, v_sigma=1.0, seed=0)
    for i, (_, conv) in enumerate(structinit.find_depthwise_convs(model)):
        cov = cf.gaussian_kronecker_covariance(3, cf.depth_sigma(i, 2, 0.5, 1.0))
        emp = cf.estimate_covariance(conv.weight)
        assert torch.linalg.norm(emp - cov) / torch.linalg.norm(cov) < 0.05


def test_softmax_filters_are_parametrised():
    model = tiny()
    structinit.init_(model, "softmax", seed=0)
    w = model.blocks[0].dw.weight
    assert (w > 0).all() and torch.allclose(w.flatten(1).sum(1), torch.ones(16))
    assert "blocks.0.dw.parametrizations.weight.original" in model.state_dict()
    structinit.init_(model, "impulse", seed=0)  # a plain scheme afterwards removes the parametrisation
    assert "blocks.0.dw.weight" in model.state_dict()


def test_covariance_transfer_from_model_state_dict_and_file(tmp_path):
    source = structinit.create_model("convmixer_256_8", dim=32, depth=3, kernel_size=3)
    structinit.init_(source, "covariance", seed=1)
    target = tiny(kernel_size=5, depth=4)
    structinit.init_(target, "covariance_transfer", source=source, seed=0)
    a = target.blocks[0].dw.weight.clone()
    structinit.init_(target, "covariance_transfer", source=source.state_dict(), seed=0)
    assert torch.equal(a, target.blocks[0].dw.weight)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "s.safetensors"))
    structinit.init_(target, "covariance_transfer", source=str(tmp_path / "s.safetensors"), seed=0)
    assert torch.equal(a, target.blocks[0].dw.weight)


@pytest.mark.parametrize("scheme, options, match", [
    ("covariance_transfer", dict(source=None), r"source=None"),
    ("covariance_transfer", dict(source="missing.safetensors"), r"source='missing\.safetensors': no such file"),
    ("covariance_transfer", dict(source={"w": torch.ones(3, 3)}), r"source: the state dict has no depthwise"),
    ("gaussian", dict(sigma=-1.0), r"sigma=-1\.0"),
    ("covariance", dict(sigma0=1.0, v_sigma=-2.0), r"sigma0=1\.0, v_sigma=-2\.0"),
    ("box", dict(taps=26), r"taps=26"),
])
def test_bad_input_leaves_the_model_unchanged(scheme, options, match):
    check_rejected(tiny(), lambda m: structinit.init_(m, scheme, seed=0, **options), (ValueError, TypeError), match)


def test_transfer_across_kernels_needs_resize():
    source = structinit.create_model("convmixer_256_8", dim=8, depth=3, kernel_size=3)
    check_rejected(tiny(), lambda m: structinit.init_(m, "covariance_transfer", source=source, resize=False, seed=0),
                   ValueError, r"resize=False: source kernel 3×3 differs from target kernel 5×5")
    one = structinit.create_model("convmixer_256_8", dim=8, depth=3, kernel_size=1)
    check_rejected(tiny(), lambda m: structinit.init_(m, "covariance_transfer", source=one, seed=0),
                   ValueError, r"1×1 source")


def test_a_model_without_depthwise_convs_is_rejected():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
    check_rejected(model, lambda m: structinit.init_(m, "box", seed=0), ValueError, r"no depthwise conv")


@pytest.mark.parametrize("module", ["structinit.functional.conv_filters", "structinit.adapters.conv",
                                    "structinit.schemes.conv_filters"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, extraglobs={"structinit": structinit, "torch": torch, "nn": nn, **vars(mod)},
                             optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("scheme", ["impulse", "box", "gaussian", "random", "softmax", "covariance"])
def test_same_seed_gives_bit_identical_filters_and_leaves_the_global_rng(scheme):
    weights = []
    for torch_seed in (1, 2):  # two constructions that drew different weights
        torch.manual_seed(torch_seed)
        model = tiny()
        before = torch.random.get_rng_state()
        structinit.init_(model, scheme, seed=7)
        assert torch.equal(torch.random.get_rng_state(), before)
        weights.append([m.weight.detach().clone() for _, m in structinit.adapters.find_depthwise_convs(model)])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


@pytest.mark.parametrize("k, sigma", [(3, 0.7), (5, 1.3), (7, 2.5)])
def test_fit_kronecker_sigma_recovers_sigma_from_sampled_filters(k, sigma):
    cov = cf.gaussian_kronecker_covariance(k, sigma)
    exact, residual = cf.fit_kronecker_sigma(cov * 5.0)  # the fit ignores the total variance
    assert abs(exact - sigma) / sigma < 0.01 and residual < 0.01
    filters = cf.sample_filters(cov, 20000, generator=torch.Generator().manual_seed(0))
    fitted, residual = cf.fit_kronecker_sigma(cf.estimate_covariance(filters))
    assert abs(fitted - sigma) / sigma < 0.05 and residual < 0.1
    # white filters are not of the family: a small σ is the nearest, with a large residual
    white, residual = cf.fit_kronecker_sigma(torch.eye(k * k, dtype=torch.float64))
    assert white < 0.3 and residual < 0.05  # G_σ→I as σ→0: identity is the family's limit


def test_fit_depth_schedule_inverts_depth_sigma():
    sigmas = [cf.depth_sigma(i, 6, 0.8, 1.7) for i in range(6)]
    s0, v = cf.fit_depth_schedule(sigmas)
    assert s0 == pytest.approx(0.8, abs=1e-9) and v == pytest.approx(1.7, abs=1e-9)
    assert cf.fit_depth_schedule([2.0]) == (2.0, 0.0)
    with pytest.raises(ValueError, match="sigmas"):
        cf.fit_depth_schedule([1.0, -1.0])
