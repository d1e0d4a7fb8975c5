"""Orthogonal convolutions by the Cayley transform: each invariant of the reference
notes (section E.6) is a test, plus the layers, the KWLarge model and the certification helpers."""

import math

import pytest
import torch
import torch.nn.functional as F

import structinit
from structinit.analysis.certify import certified_accuracy, empirical_lipschitz, logit_margins, multiclass_hinge_loss
from structinit.functional import cayley_conv as fc
from structinit.models.layers_orthogonal import CayleyConv2d, CayleyLinear, GroupSort, LipschitzAvgPool, SpaceToDepth


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many tiny batched complex ops: on the shared 2-core test machine, two threads contend
    with the background load and run up to 100× slower; one thread keeps the file at seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=gen(seed), dtype=dtype)


def circular_conv2d(x, w):
    k = w.shape[-1]
    return F.conv2d(F.pad(x, ((k - 1) // 2, k // 2, (k - 1) // 2, k // 2), mode="circular"), w)


def full_spectrum(w, n):
    """The per-frequency matrices on the full fft2 grid (n, n, c_out, c_in), built from the
    n×n kernel as fft_conv_weight does on the one-sided grid."""
    p = (w.shape[-1] - 1) // 2
    u = torch.arange(n).view(n, 1)
    angle = (-2 * math.pi * p / n) * (u + u.T).to(w.dtype)
    return (torch.fft.fft2(w, s=(n, n)).conj() * torch.polar(torch.ones_like(angle), angle)).permute(2, 3, 0, 1)


# --------------------------------------------------------------------------- the maths
@pytest.mark.parametrize("n", [8, 16, 32])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_fft_path_without_cayley_equals_circular_conv2d(n, k):
    x, w = randn(2, 3, n, n, seed=1, dtype=torch.float64), randn(5, 3, k, k, seed=2, dtype=torch.float64)
    y = fc.fft_circular_conv(x, fc.fft_conv_weight(w, n))
    assert (y - circular_conv2d(x, w)).abs().max() < 1e-12
    x32, w32 = x.float(), w.float()  # float32: 1e-5 relative to the output's scale (|y| up to ~20 here)
    ref = circular_conv2d(x32, w32)
    assert (fc.fft_circular_conv(x32, fc.fft_conv_weight(w32, n)) - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("n", [8, 16, 32])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("c_in, c_out", [(8, 8), (4, 12)])
def test_conv_preserves_norms(n, k, c_in, c_out):
    torch.manual_seed(n * 100 + k * 10 + c_out)
    conv = CayleyConv2d(c_in, c_out, k, n=n, bias=False)
    x = randn(3, c_in, n, n, seed=k)
    y = conv(x)
    assert y.dtype == torch.float32 and y.shape == (3, c_out, n, n)
    ratio = y.flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    assert (ratio - 1).abs().max() < 1e-5


def test_conv_preserves_norms_in_float64():
    torch.manual_seed(0)
    conv = CayleyConv2d(6, 6, 3, bias=False).double()
    x = randn(2, 6, 16, 16, dtype=torch.float64)
    assert abs(float(conv(x).detach().norm() / x.norm()) - 1) < 1e-12


@pytest.mark.parametrize("k", [3, 4])
def test_co_isometry_when_c_out_below_c_in(k):
    w = randn(4, 10, k, k, seed=3, dtype=torch.float64)
    q = fc.cayley_conv_matrices(w, 16)
    assert fc.orthogonality_error(q) < 1e-12  # QQᴴ = I
    x = randn(5, 10, 16, 16, seed=4, dtype=torch.float64)
    ratio = fc.fft_circular_conv(x, q).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    assert (ratio <= 1 + 1e-12).all() and (ratio < 0.99).any()
    # the adjoint (per-frequency Qᴴ, c_in × c_out) preserves norms
    z = randn(5, 4, 16, 16, seed=5, dtype=torch.float64)
    adj = fc.fft_circular_conv(z, q.mH.contiguous())
    assert torch.allclose(adj.flatten(1).norm(dim=1), z.flatten(1).norm(dim=1), rtol=1e-12)


@pytest.mark.parametrize("c_in, c_out, k, n", [(16, 16, 3, 8), (16, 32, 3, 8), (8, 8, 5, 16), (3, 3, 9, 32)])
def test_per_frequency_q_is_unitary(c_in, c_out, k, n):
    q = fc.cayley_conv_matrices(randn(c_out, c_in, k, k, seed=k), n)
    assert q.shape == (n, n // 2 + 1, c_out, c_in)
    eye = torch.eye(c_in)
    assert (q.mH @ q - eye).abs().max() < 1e-5
    q64 = fc.cayley_conv_matrices(randn(c_out, c_in, k, k, seed=k, dtype=torch.float64), n)
    assert fc.orthogonality_error(q64) < 1e-12


def test_jacobian_singular_values_are_one():
    """The dense operator of a tiny conv (n = 4, 3 → 3 channels, k = 3): every singular value 1."""
    q = fc.cayley_conv_matrices(randn(3, 3, 3, 3, seed=9, dtype=torch.float64), 4)
    basis = torch.eye(3 * 16, dtype=torch.float64).view(-1, 3, 4, 4)
    dense = fc.fft_circular_conv(basis, q).flatten(1).T  # column j: the image of basis vector j
    sv = torch.linalg.svdvals(dense)
    assert (sv - 1).abs().max() < 1e-12


def test_gradient_norms_preserved_through_a_stack():
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*(CayleyConv2d(6, 6, k, bias=False) for k in (3, 2, 5))).double()
    x = randn(2, 6, 8, 8, dtype=torch.float64).requires_grad_(True)
    y = stack(x)
    g = randn(*y.shape, seed=3, dtype=torch.float64)
    (grad,) = torch.autograd.grad(y, x, g)
    assert abs(float(grad.norm() / g.norm()) - 1) < 1e-12


def test_cayley_of_skew_hermitian_is_unitary():
    a = torch.complex(randn(7, 5, 5, seed=1, dtype=torch.float64), randn(7, 5, 5, seed=2, dtype=torch.float64))
    q = fc.cayley(a - a.mH)
    assert fc.orthogonality_error(q) < 1e-12
    assert torch.allclose(q, (torch.eye(5) - (a - a.mH)) @ torch.linalg.inv(torch.eye(5) + (a - a.mH)))


def test_output_is_real():
    """On the full spectrum, the Cayley map of a conjugate-symmetric Ŵ stays conjugate-symmetric:
    the inverse FFT has (almost) no imaginary part; the one-sided path returns a real tensor."""
    n, w = 8, randn(6, 4, 3, 3, seed=7, dtype=torch.float64)
    x = randn(2, 4, n, n, seed=8, dtype=torch.float64)
    q_full = fc.semi_orthogonal_cayley(full_spectrum(w, n))
    y = fc.fft_circular_conv(x, q_full, onesided=False)
    assert y.imag.abs().max() < 1e-12
    assert torch.allclose(y.real, fc.fft_circular_conv(x, fc.cayley_conv_matrices(w, n)), atol=1e-12)
    q32 = fc.semi_orthogonal_cayley(full_spectrum(w.float(), n))
    assert fc.fft_circular_conv(x.float(), q32, onesided=False).imag.abs().max() < 1e-5
    assert not CayleyConv2d(4, 6, 3)(x.float()).is_complex()


def test_scale_invariance():
    torch.manual_seed(0)
    conv = CayleyConv2d(4, 8, 3, bias=False)
    x = randn(2, 4, 8, 8)
    y = conv(x)
    for c in (1e-3, 0.5, 7.0, 1e3):
        with torch.no_grad():
            conv.weight.mul_(c)
        assert torch.allclose(conv(x), y, atol=1e-5)
        with torch.no_grad():
            conv.weight.div_(c)


def test_alpha_starts_at_the_weight_norm():
    torch.manual_seed(0)
    for layer in (CayleyConv2d(4, 8, 3), CayleyLinear(5, 3)):
        assert torch.allclose(layer.alpha, layer.weight.norm())
        assert layer.alpha.requires_grad


def test_space_to_depth_is_a_norm_preserving_permutation():
    x = randn(2, 3, 8, 8)
    y = SpaceToDepth(2)(x)
    assert y.shape == (2, 12, 4, 4)
    assert torch.equal(y.flatten().sort().values, x.flatten().sort().values)
    assert y.norm() == x.norm()


def test_stride_two_halves_the_size_and_stays_orthogonal():
    torch.manual_seed(0)
    conv = CayleyConv2d(4, 16, 4, n=16, stride=2, bias=False)  # 16 channels after space-to-depth: 16 → 16
    assert conv.kernel_size == 2 and conv.weight.shape == (16, 16, 2, 2)
    x = randn(3, 4, 16, 16)
    y = conv(x)
    assert y.shape == (3, 16, 8, 8)
    assert torch.allclose(y.flatten(1).norm(dim=1), x.flatten(1).norm(dim=1), rtol=1e-5)


def test_linear_is_semi_orthogonal_and_co_isometric():
    torch.manual_seed(0)
    x = randn(6, 8, seed=3)
    tall, wide = CayleyLinear(8, 12, bias=False), CayleyLinear(8, 4, bias=False)
    assert torch.allclose(tall(x).norm(dim=1), x.norm(dim=1), rtol=1e-5)
    q = wide._matrices(None)
    assert torch.allclose(q @ q.T, torch.eye(4), atol=1e-5)
    assert (wide(x).norm(dim=1) <= x.norm(dim=1) * (1 + 1e-5)).all()


def test_groupsort_and_pool_are_one_lipschitz():
    x, z = randn(4, 6, 8, 8, seed=1), randn(4, 6, 8, 8, seed=2)
    act = GroupSort()
    assert torch.allclose(act(x).norm(), x.norm())
    assert (act(x) - act(z)).norm() <= (x - z).norm() * (1 + 1e-6)
    assert torch.equal(act(torch.tensor([[1.0, 5.0, 3.0, 2.0]])), torch.tensor([[3.0, 5.0, 1.0, 2.0]]))
    pool = LipschitzAvgPool(2)
    assert (pool(x) - pool(z)).norm() <= (x - z).norm() * (1 + 1e-6)
    const = torch.ones(1, 1, 4, 4)
    assert torch.allclose(pool(const).norm(), const.norm())  # the bound is tight
    with pytest.raises(ValueError, match="even number of channels"):
        act(torch.zeros(2, 3))


# --------------------------------------------------------------------------- caching
def test_eval_cache_is_used_and_invalidated(monkeypatch):
    torch.manual_seed(0)
    conv = CayleyConv2d(4, 4, 3, n=8)
    calls = []
    original = fc.cayley_conv_matrices
    monkeypatch.setattr(fc, "cayley_conv_matrices", lambda *a, **k: calls.append(1) or original(*a, **k))
    x = randn(2, 4, 8, 8)
    conv(x), conv(x)
    assert len(calls) == 2  # training mode: recomputed every call
    conv.eval()
    y1, y2 = conv(x), conv(x)
    assert len(calls) == 3 and torch.equal(y1, y2)
    conv.train()
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    conv(x).square().sum().backward()
    opt.step()
    conv.eval()
    y3 = conv(x)
    assert len(calls) == 5 and not torch.allclose(y3, y1)
    conv(x)
    assert len(calls) == 5
    with torch.no_grad():  # an optimizer step without train(): the version key catches it
        conv.alpha.mul_(2)
    conv(x)
    assert len(calls) == 6


# --------------------------------------------------------------------------- bad input
def test_bad_input_gives_clear_errors():
    conv = CayleyConv2d(3, 4, 3, n=8)
    with pytest.raises(ValueError, match=r"square input .*got shape \(1, 3, 8, 6\)"):
        conv(torch.zeros(1, 3, 8, 6))
    with pytest.raises(ValueError, match="built for n=8, got a 16×16 input"):
        conv(torch.zeros(1, 3, 16, 16))
    with pytest.raises(TypeError, match=r"real floating-point input, got torch\.complex64"):
        conv(torch.zeros(1, 3, 8, 8, dtype=torch.complex64))
    with pytest.raises(ValueError, match="kernel 5 is larger than the 4×4 input"):
        CayleyConv2d(3, 4, 5)(torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="kernel_size=9: larger than the 8×8 input"):
        CayleyConv2d(3, 4, 9, n=8)
    with pytest.raises(ValueError, match="kernel size 5 is larger than the input size n=4"):
        fc.fft_conv_weight(torch.zeros(2, 2, 5, 5), 4)
    with pytest.raises(TypeError, match="weight: expected a real floating-point tensor"):
        fc.fft_conv_weight(torch.zeros(2, 2, 3, 3, dtype=torch.complex64), 8)
    with pytest.raises(ValueError, match="stride=3"):
        CayleyConv2d(3, 4, 3, stride=3)
    with pytest.raises(TypeError, match="CayleyLinear: expected a real input"):
        CayleyLinear(3, 3)(torch.zeros(1, 3, dtype=torch.complex64))


# --------------------------------------------------------------------------- the model
def test_kwlarge_cpu_is_registered_and_one_lipschitz():
    torch.manual_seed(0)
    model = structinit.create_model("kwlarge_cpu", img_size=16, num_classes=10).eval()
    x = randn(4, 3, 16, 16, seed=1)
    assert model(x).shape == (4, 10)
    estimate = empirical_lipschitz(model, x, steps=10, seed=0)
    assert 0.1 < estimate <= 1 + 1e-3
    plain = structinit.create_model("kwlarge_cpu", img_size=16, conv="plain")
    assert plain(x).shape == (4, 10)
    assert structinit.create_model("kwlarge_cpu", in_chans=1, img_size=8)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_kwlarge_default_width_and_gradients_flow():
    model = structinit.create_model("kwlarge")
    assert model[9].in_features == 4096 and model[9].out_features == 512
    small = structinit.create_model("kwlarge_cpu", img_size=8)
    small(randn(2, 3, 8, 8)).sum().backward()
    assert all(p.grad is not None for p in small.parameters())
    with pytest.raises(ValueError, match="img_size=10: expected a multiple of 4"):
        structinit.create_model("kwlarge_cpu", img_size=10)


# --------------------------------------------------------------------------- certification
def test_margins_hinge_and_certified_accuracy():
    logits = torch.tensor([[1.0, 0.0, -1.0], [0.1, 0.0, 0.0], [0.0, 2.0, 0.0]])
    y = torch.tensor([0, 0, 0])
    assert torch.allclose(logit_margins(logits, y), torch.tensor([1.0, 0.1, -2.0]))
    assert certified_accuracy(logits, y, eps=0.0) == pytest.approx(2 / 3)
    assert certified_accuracy(logits, y, eps=0.05) == pytest.approx(2 / 3)  # 0.1 > √2·0.05 = 0.0707
    assert certified_accuracy(logits, y, eps=0.1) == pytest.approx(1 / 3)   # 0.1 < 0.141
    assert certified_accuracy(logits, y, eps=0.05, lipschitz=2.0) == pytest.approx(1 / 3)
    assert torch.allclose(multiclass_hinge_loss(logits, y, margin=0.5), F.multi_margin_loss(logits, y, margin=0.5))
    with pytest.raises(ValueError, match="eps=-1"):
        certified_accuracy(logits, y, eps=-1)


def test_certificate_holds_against_an_attack():
    """A certified point of a 1-Lipschitz network keeps its prediction under perturbations of
    norm ε: random ones here, and the PGD estimate never exceeds 1."""
    torch.manual_seed(0)
    model = structinit.create_model("kwlarge_cpu", img_size=8).eval()
    x = randn(16, 3, 8, 8, seed=2)
    logits = model(x).detach()
    y = logits.argmax(1)
    margins = logit_margins(logits, y)
    eps = float(margins.max()) / math.sqrt(2) * 0.9
    certified = margins > math.sqrt(2) * eps
    for seed in range(5):
        d = randn(*x.shape, seed=seed + 10)
        d = d * eps / d.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        assert torch.equal(model(x + d).argmax(1)[certified], y[certified])


def test_empirical_lipschitz_finds_a_linear_map_constant():
    lin = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.diag(torch.tensor([3.0, 1.0, 0.5, 0.1])))
    est = empirical_lipschitz(lin, randn(3, 4), steps=20, seed=0)
    assert 2.9 < est <= 3.0 + 1e-4
    assert lin.weight.grad is None


# --------------------------------------------------------------------------- docstring examples
@pytest.mark.parametrize("module", [
    "structinit.functional.cayley_conv", "structinit.functional.orthogonal", "structinit.models.layers_orthogonal",
    "structinit.models.kwlarge", "structinit.schemes.orthogonal", "structinit.analysis.certify",
])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, extraglobs={"structinit": structinit, "torch": torch, **vars(mod)},
                             optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
