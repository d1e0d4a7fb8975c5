"""Linear CKA: full batch against a naive numpy formula, the unbiased HSIC estimator against its
U-statistic definition, the minibatch estimator against the full batch, and CKA matrices of
real models."""

import doctest
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structinit
from structinit.analysis import cka as cka_module


def gen(seed):
    return torch.Generator().manual_seed(seed)


def orthogonal(d, seed):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen(seed), dtype=torch.float64))
    return q


def naive_cka(x, y):
    """Kornblith et al. (2019), eq. for linear CKA in feature space, in numpy."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    x = x - x.mean(0)
    y = y - y.mean(0)
    return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


def u_statistic_hsic(k, l):  # noqa: E741 (Song et al.'s names)
    """HSIC_1 as the U-statistic over ordered 4-tuples of distinct indices (Song et al. 2012, Thm. 3)."""
    n = k.shape[0]
    total, count = 0.0, 0
    for i, j, q, r in itertools.permutations(range(n), 4):
        total += k[i, j] * l[i, j] + k[i, j] * l[q, r] - 2 * k[i, j] * l[i, q]
        count += 1
    return total / count


def correlated(n, seed, p=12, q=6, noise=0.7):
    x = torch.randn(n, p, generator=gen(seed), dtype=torch.float64)
    mix = torch.randn(p, q, generator=gen(seed + 1), dtype=torch.float64)
    return x, x @ mix + noise * torch.randn(n, q, generator=gen(seed + 2), dtype=torch.float64)


# ------------------------------------------------------------------------------- full batch
@pytest.mark.parametrize("n, p, q", [(40, 12, 6), (5, 30, 20)])  # feature-space form, then n×n form
def test_linear_cka_matches_naive_numpy(n, p, q):
    x = torch.randn(n, p, generator=gen(0), dtype=torch.float64)
    y = torch.tanh(x[:, :q]) + 0.5 * torch.randn(n, q, generator=gen(1), dtype=torch.float64)
    out = structinit.linear_cka(x, y)
    assert out.dtype == torch.float64 and out.ndim == 0
    assert out.item() == pytest.approx(naive_cka(x.numpy(), y.numpy()), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 30), p=st.integers(1, 10), q=st.integers(1, 10), scale=st.floats(1e-3, 1e3),
       seed=st.integers(0, 999))
def test_linear_cka_invariances(n, p, q, scale, seed):
    x, _ = correlated(n, seed, p, q)
    y = torch.randn(n, q, generator=gen(seed + 7), dtype=torch.float64) + x[:, :1]
    ref = structinit.linear_cka(x, y).item()
    assert -1e-12 <= ref <= 1 + 1e-12
    assert structinit.linear_cka(x, x).item() == pytest.approx(1, abs=1e-12)
    assert structinit.linear_cka(x @ orthogonal(p, seed) * scale, y).item() == pytest.approx(ref, abs=1e-9)
    assert structinit.linear_cka(x, -scale * y @ orthogonal(q, seed + 1)).item() == pytest.approx(ref, abs=1e-9)
    assert structinit.linear_cka(y, x).item() == pytest.approx(ref, abs=1e-12)  # symmetric
    assert structinit.linear_cka(x + 3.0, y - 2.0).item() == pytest.approx(ref, abs=1e-9)  # centred


def test_linear_cka_takes_float32_and_is_exact_for_independent_blocks():
    """X = [A, B] with A ⟂ B column-centred and equal energy, Y = A: CKA = ‖AᵀA‖ / (√2 ‖AᵀA‖) = 1/√2."""
    spread = torch.randn(8, 4, generator=gen(0), dtype=torch.float64)
    basis = torch.linalg.qr(torch.cat([torch.ones(8, 1, dtype=torch.float64), spread], 1))[0][:, 1:]  # ⟂ 1: centred
    a, b = basis[:, :2], basis[:, 2:4]
    x = torch.cat([a, b], 1)
    assert structinit.linear_cka(x.float(), a.float()).item() == pytest.approx(2**-0.5, abs=1e-6)


# ------------------------------------------------------------------------------- unbiased HSIC
@pytest.mark.parametrize("n", [4, 6])
def test_unbiased_hsic_is_the_u_statistic(n):
    x, y = correlated(n, 3, 5, 3)
    x = x + 2.0  # uncentred on purpose: HSIC_1 needs no centring
    k, l = x @ x.T, y @ y.T  # noqa: E741
    assert structinit.unbiased_hsic(k, l).item() == pytest.approx(u_statistic_hsic(k.numpy(), l.numpy()), rel=1e-10)


# ------------------------------------------------------------------------------- minibatches
def test_minibatch_estimator_approaches_the_full_batch_value():
    x, y = correlated(8192, 0)
    full = structinit.linear_cka(x, y).item()
    est = structinit.MinibatchCKA()
    for xb, yb in zip(x.split(64), y.split(64)):
        est.update([xb], [yb])
    assert est.batches == 128
    assert est.compute()[0, 0].item() == pytest.approx(full, abs=0.02)
    assert 0.3 < full < 0.95  # a non-trivial value, not 0 or 1


def test_minibatch_estimator_equals_its_formula_and_known_values():
    x, y = correlated(40, 5)
    est = structinit.MinibatchCKA()
    batches = list(zip(x.split(8), y.split(8)))
    for xb, yb in batches:
        est.update([xb, 3 * xb @ orthogonal(12, 1), yb], [yb, xb])
    got = est.compute()
    assert got.shape == (3, 2) and got.dtype == torch.float64

    def mean_hsic(f, g):
        return np.mean([u_statistic_hsic((f(b) @ f(b).T).numpy(), (g(b) @ g(b).T).numpy()) for b in batches])

    first, second = (lambda b: b[0]), (lambda b: b[1])
    expected = mean_hsic(first, second) / np.sqrt(mean_hsic(first, first) * mean_hsic(second, second))
    assert got[0, 0].item() == pytest.approx(expected, rel=1e-9)
    torch.testing.assert_close(got[:, 1], torch.tensor([1.0, 1.0, expected], dtype=torch.float64))  # x vs x, …
    torch.testing.assert_close(got[1, 0], got[0, 0])  # orthogonal transform and scale of x change nothing
    assert got[2, 0].item() == pytest.approx(1.0, abs=1e-12)


def test_minibatch_constant_layer_is_nan():
    est = structinit.MinibatchCKA()
    x = torch.randn(8, 3, generator=gen(0))
    est.update([x, torch.ones(8, 3)], [x])
    got = est.compute()
    assert got[0, 0].item() == pytest.approx(1.0) and torch.isnan(got[1, 0])


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e.update([torch.randn(3, 2)], [torch.randn(3, 2)]), ValueError, r"xs\[0\] has 3 examples.*at least 4"),
    (lambda e: e.update([torch.randn(8, 2)], [torch.randn(7, 2)]), ValueError,
     r"xs\[0\] has 8 examples .* ys\[0\] has 7"),
    (lambda e: e.update([torch.randn(8, 2), torch.randn(7, 2)], [torch.randn(8, 2)]), ValueError,
     r"xs\[0\] has 8 .* xs\[1\] has 7"),
    (lambda e: e.update([torch.randn(8, 2, 2)], [torch.randn(8, 2)]), ValueError, r"xs\[0\]: expected a 2-D"),
    (lambda e: e.update([], [torch.randn(8, 2)]), ValueError, r"xs=\[\]: expected a non-empty list"),
    (lambda e: e.compute(), RuntimeError, r"before any update"),
])
def test_minibatch_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(structinit.MinibatchCKA())


def test_minibatch_layer_count_must_not_change():
    est = structinit.MinibatchCKA()
    est.update(torch.randn(8, 2), torch.randn(8, 2))  # a single tensor is one layer
    with pytest.raises(ValueError, match=r"2 × 1 layers, earlier ones had 1 × 1"):
        est.update([torch.randn(8, 2)] * 2, [torch.randn(8, 2)])


@pytest.mark.parametrize("call, match", [
    (lambda: structinit.linear_cka(torch.randn(5, 2), torch.randn(6, 2)), r"x has 5 examples .* y has 6"),
    (lambda: structinit.linear_cka(torch.randn(5), torch.randn(5, 2)), r"x: expected a 2-D .*flatten"),
    (lambda: structinit.linear_cka(torch.randn(5, 2), "y"), r"y: expected a 2-D"),
    (lambda: structinit.linear_cka(torch.ones(5, 2), torch.randn(5, 2)), r"x has the same row for every example"),
    (lambda: structinit.linear_cka(torch.randn(5, 2), torch.full((5, 2), float("nan"))), r"y contains NaN"),
    (lambda: structinit.unbiased_hsic(torch.eye(3), torch.eye(3)), r"gram_k: .*n ≥ 4"),
    (lambda: structinit.unbiased_hsic(torch.eye(4), torch.ones(4, 5)), r"gram_l: .*\(n, n\)"),
    (lambda: structinit.unbiased_hsic(torch.eye(4), torch.eye(5)), r"gram_k has 4 examples .* gram_l has 5"),
])
def test_full_batch_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def images():
    return torch.randn(22, 3, 16, 16, generator=gen(0))


def micro(seed, init="pytorch", **overrides):
    torch.manual_seed(seed)
    model = structinit.create_model("vit_micro_patch2_16", **overrides)
    structinit.init_(model, init, seed=seed)
    return model


def test_identical_models_have_a_unit_diagonal(images):
    a, b = micro(0), micro(0)  # two objects with the same weights
    m = structinit.cka_matrix(a, b, images, batch_size=8)  # batches 8, 8, 6
    assert m.shape == (2, 2) and m.dtype == torch.float64
    torch.testing.assert_close(m.diagonal(), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(m, m.T)
    torch.testing.assert_close(structinit.cka_matrix(a, a, images, batch_size=8), m)  # the same object, run once


def test_models_of_different_depth_give_a_rectangular_matrix(images):
    deep = micro(1, "impulse", depth=4)
    m = structinit.cka_matrix(micro(0), deep, images, batch_size=10)  # 10 + 12: the short remainder is merged
    assert m.shape == (2, 4) and torch.isfinite(m).all() and ((m >= -0.05) & (m <= 1 + 1e-9)).all()
    mean = structinit.cka_matrix(micro(0), deep, images, batch_size=10, layers_b=[0, -1], tokens="mean")
    assert mean.shape == (2, 2) and torch.isfinite(mean).all()
    deep.train()
    structinit.cka_matrix(deep, deep, images[:4], layers_a=[1])
    assert deep.training  # the mode is restored


def test_cka_matrix_equals_minibatch_cka_of_the_captured_inputs(images):
    a, b = micro(0), micro(1, "impulse")
    inputs = {}
    for key, model in (("a", a), ("b", b)):
        layers = structinit.adapters.find_attention_layers(model)
        model.eval()
        inputs[key] = [[] for _ in layers]
        for batch in images.split(11):
            structinit.analysis.run_with_hooks(model, batch, layers, lambda i, x, k=key: inputs[k][i].append(x))
    est = structinit.MinibatchCKA()
    for j in range(2):
        est.update([x[j].flatten(1) for x in inputs["a"]], [y[j].flatten(1) for y in inputs["b"]])
    torch.testing.assert_close(structinit.cka_matrix(a, b, images, batch_size=11), est.compute())


def test_windowed_layers_are_compared_image_by_image(images):
    """A Swin layer's input arrives as (images · windows, T, D): CKA puts each image's windows
    back together, so it equals CKA of the block's un-windowed normalised tokens (the order
    of an image's features does not change a Gram)."""
    torch.manual_seed(0)
    swin = structinit.create_model("swin_cpu_patch2_32", img_size=16, num_classes=10)
    vit = micro(1, "impulse")
    natural = []
    block = swin.layers[0].blocks[1]  # the shifted block: its windows are also rolled
    handle = block.norm1.register_forward_hook(lambda m, a, out: natural.append(out.flatten(1)))
    swin.eval()
    with torch.no_grad():
        swin(images)
    handle.remove()
    vit_inputs = []
    layers = structinit.adapters.find_attention_layers(vit)
    vit.eval()
    structinit.analysis.run_with_hooks(vit, images, layers[:1], lambda i, x: vit_inputs.append(x.flatten(1)))
    est = structinit.MinibatchCKA()
    est.update([natural[0]], [vit_inputs[0]])
    m = structinit.cka_matrix(swin, vit, images, batch_size=len(images), layers_a=[1], layers_b=[0])
    torch.testing.assert_close(m, est.compute())
    full = structinit.cka_matrix(swin, swin, images, batch_size=11)
    assert full.shape == (6, 6) and torch.allclose(full.diagonal(), torch.ones(6, dtype=torch.float64))


def test_a_mixer_is_read_at_its_token_mixing_inputs(images):
    """No attention: each Mixer block's representation is the normalised tokens its token MLP mixes."""
    torch.manual_seed(0)
    mixer = structinit.create_model("mixer_cpu_patch4_32", img_size=16, num_classes=10)
    structinit.init_(mixer, "impulse", seed=0)
    normed = []
    handle = mixer.blocks[2].norm1.register_forward_hook(lambda m, a, out: normed.append(out.flatten(1)))
    mixer.eval()
    with torch.no_grad():
        mixer(images)
    handle.remove()
    vit = micro(1)
    vit_inputs = []
    vit.eval()
    layers = structinit.adapters.find_attention_layers(vit)
    structinit.analysis.run_with_hooks(vit, images, layers[1:], lambda i, x: vit_inputs.append(x.flatten(1)))
    est = structinit.MinibatchCKA()
    est.update([normed[0]], [vit_inputs[0]])
    m = structinit.cka_matrix(mixer, vit, images, batch_size=len(images), layers_a=[2], layers_b=[1])
    torch.testing.assert_close(m, est.compute())
    full = structinit.cka_matrix(mixer, mixer, images, batch_size=11, tokens="mean")
    assert full.shape == (6, 6) and torch.allclose(full.diagonal(), torch.ones(6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"layers contains 9, but the model has 6 token-mixing layers"):
        structinit.cka_matrix(mixer, mixer, images, layers_a=[9])


def test_cka_matrix_bad_input(images):
    model = micro(0)
    with pytest.raises(ValueError, match=r"batch_size=3"):
        structinit.cka_matrix(model, model, images, batch_size=3)
    with pytest.raises(ValueError, match=r"at least 4 images"):
        structinit.cka_matrix(model, model, images[:3])
    with pytest.raises(ValueError, match=r"layers contains 5, but the model has 2 attention layers"):
        structinit.cka_matrix(model, model, images, layers_b=[5])
    with pytest.raises(ValueError, match=r"tokens='cls'"):
        structinit.cka_matrix(model, model, images, tokens="cls")


def test_docstring_examples_run():
    result = doctest.testmod(cka_module, extraglobs={"structinit": structinit, "torch": torch},
                             optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
