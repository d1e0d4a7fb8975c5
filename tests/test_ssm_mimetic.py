"""Mimetic init of Mamba-1 SSM layers (target 'ssm', mambapy): the invariants of the notes' D.5,
the linear-attention equivalence, reproducibility, dispatch and rejection of bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters import find_ssm_layers, is_ssm
from structinit.functional.mimetic import mimetic_factors
from structinit.functional.ssm import (
    causal_linear_attention,
    mimetic_bc,
    softplus_inverse,
    ssm_attention,
    ssm_retention,
)
from structinit.utils import OptionError

mambapy = pytest.importorskip("mambapy")
from mambapy.mamba import Mamba, MambaConfig  # noqa: E402


def mamba(torch_seed=0, **kw):
    torch.manual_seed(torch_seed)
    return Mamba(MambaConfig(**{"d_model": 16, "n_layers": 2, **kw}))


def blocks(model):
    return [ad.module for _, ad in find_ssm_layers(model)]


def inner(block, u):
    """The SSM path of MambaBlock.forward up to the scan: (x, B, C, Δ, A) for block input u."""
    cfg, length = block.config, u.shape[1]
    x, _ = block.in_proj(u).chunk(2, dim=-1)
    x = F.silu(block.conv1d(x.transpose(1, 2))[:, :, :length].transpose(1, 2))
    d, b, c = torch.split(block.x_proj(x), [cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
    delta = F.softplus(d @ block.dt_proj.weight.T + block.dt_proj.bias)
    return x, b, c, delta, -torch.exp(block.A_log.float())


def truncation(m, rank):
    u, s, vh = torch.linalg.svd(m)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def written(model):
    """The tensors the SSM mimetic init writes, by name (of x_proj only the B/C rows)."""
    out = {}
    for name, ad in find_ssm_layers(model):
        for key in ("A_log", "dt_weight", "dt_bias", "w_b", "w_c", "conv_weight", "conv_bias"):
            out[f"{name}.{key}"] = getattr(ad, key).detach().clone()
    return out


# --------------------------------------------------------------------------- the maths
def test_softplus_inverse_and_retention():
    y = torch.tensor([1e-4, 0.3, 1.0, 20.0], dtype=torch.float64)
    assert torch.allclose(F.softplus(softplus_inverse(y)), y, rtol=1e-12)
    assert abs(float(softplus_inverse(1.0)) - 0.5413248546129181) < 1e-12
    with pytest.raises(ValueError, match="> 0"):
        softplus_inverse(0.0)
    r = ssm_retention(torch.full((3, 4), -8.0, dtype=torch.float64), 1.0, 256)
    assert torch.allclose(r, torch.full_like(r, 0.9177), atol=1e-4)


def test_mimetic_bc_is_the_rank_n_truncation_and_b_differs_from_c():
    for d_inner, n in [(32, 16), (32, 32), (64, 32)]:
        w_b, w_c = mimetic_bc(d_inner, n, 0.7, 0.7, generator=torch.Generator().manual_seed(3))
        _, _, m = mimetic_factors(d_inner, 0.7, 0.7, generator=torch.Generator().manual_seed(3))
        assert w_b.shape == w_c.shape == (n, d_inner)
        assert torch.allclose(w_c.T @ w_b, truncation(m, n), atol=1e-5)
        assert not torch.equal(w_b, w_c) and (w_b - w_c).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"d_state=8.*d_state ≤ d_inner = 4"):
        mimetic_bc(4, 8)


def test_causal_linear_attention_matches_a_direct_recurrence():
    g = torch.Generator().manual_seed(0)
    x, b, c = (torch.randn(2, 7, s, generator=g, dtype=torch.float64) for s in (3, 2, 2))
    delta = torch.rand(2, 7, 3, generator=g, dtype=torch.float64) + 0.1
    a = -torch.rand(3, 2, generator=g, dtype=torch.float64)
    h, ys = torch.zeros(2, 3, 2, dtype=torch.float64), []
    for t in range(7):
        h = torch.exp(delta[:, t, :, None] * a) * h + delta[:, t, :, None] * b[:, t, None, :] * x[:, t, :, None]
        ys.append((h * c[:, t, None, :]).sum(-1))
    assert torch.allclose(causal_linear_attention(x, b, c, delta, a), torch.stack(ys, 1), atol=1e-12)
    no_decay = causal_linear_attention(x, b, c, delta)
    assert torch.allclose(no_decay, causal_linear_attention(x, b, c, delta, torch.zeros(3, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"A must be \(d_inner, N\)"):
        ssm_attention(b, c, delta, torch.zeros(2, 2))


# --------------------------------------------------------------------------- the invariants on a model
@pytest.fixture(scope="module")
def mimetic_model():
    return structinit.init_(mamba(), "mimetic", seed=0)


def test_retention_and_delta(mimetic_model):
    for block in blocks(mimetic_model):
        delta = F.softplus(block.dt_proj.bias.detach().double())
        assert (delta - 1.0).abs().max() < 1e-6
        assert torch.count_nonzero(block.dt_proj.weight) == 0
        assert ssm_retention(block.A_log.detach(), delta, 256).min() >= 0.9
        assert torch.exp(-torch.exp(block.A_log.detach()) * delta[:, None]).min() >= 0.999
        assert torch.equal(block.D.detach(), torch.ones_like(block.D))  # left at default


def test_delta_option_and_dt_weight_scale():
    model = structinit.init_(mamba(), "mimetic", delta=0.25, dt_weight_scale=0.01, seed=0)
    for block in blocks(model):
        assert (F.softplus(block.dt_proj.bias.detach().double()) - 0.25).abs().max() < 1e-6
        w = block.dt_proj.weight.detach()
        assert 0 < w.abs().max() <= 0.01


def test_bc_product_in_the_model(mimetic_model):
    _, _, m = mimetic_factors(32, 0.7, 0.7, generator=torch.Generator().manual_seed(0))  # layer 0 draws first
    ad = find_ssm_layers(mimetic_model)[0][1]
    product = (ad.w_c.T @ ad.w_b).detach().double()
    assert torch.allclose(product, truncation(m, 16), atol=1e-5)
    assert not torch.equal(ad.w_b, ad.w_c)


@pytest.mark.parametrize("d_model, d_state", [(16, 32), (32, 32)])  # N = d_inner and N = d_inner / 2, N = 32
def test_bc_diagonal_dominates(d_model, d_state):
    """diag mean > 5 × mean |off-diagonal|. The ratio grows like √N (≈ 1.1 √N at α = β): it holds
    from N ≈ 32; at mambapy's default N = 16 it is ≈ 4.5–5 (see test below)."""
    model = structinit.init_(mamba(d_model=d_model, d_state=d_state), "mimetic", seed=1)
    for _, ad in find_ssm_layers(model):
        p = (ad.w_c.T @ ad.w_b).detach().double()
        off = (p - torch.diag(p.diag())).abs().sum() / (p.numel() - p.shape[0])
        assert p.diag().mean() > 5 * off


def test_bc_diagonal_positive_at_default_state_size(mimetic_model):
    for _, ad in find_ssm_layers(mimetic_model):
        p = (ad.w_c.T @ ad.w_b).detach().double()
        off = (p - torch.diag(p.diag())).abs().sum() / (p.numel() - p.shape[0])
        assert p.diag().mean() > 3 * off > 0


def test_conv_is_identity_when_asked_and_left_as_built_by_default():
    x = torch.randn(3, 32, 20)
    for block in blocks(structinit.init_(mamba(), "mimetic", conv_identity=True, seed=0)):
        assert torch.equal(block.conv1d(x)[:, :, :20], x)
    torch.manual_seed(0)
    reference = mamba()
    torch.manual_seed(0)
    built = structinit.init_(mamba(), "mimetic", seed=0)
    for a, b in zip(blocks(reference), blocks(built)):
        assert torch.equal(a.conv1d.weight, b.conv1d.weight) and torch.equal(a.conv1d.bias, b.conv1d.bias)


def test_switches_leave_parts_as_built():
    a, b = mamba(3), mamba(3)
    structinit.init_(b, "mimetic", bc=False, conv_identity=False, seed=0)
    for ba, bb in zip(blocks(a), blocks(b)):
        assert torch.equal(ba.x_proj.weight, bb.x_proj.weight)
        assert torch.equal(ba.conv1d.weight, bb.conv1d.weight) and torch.equal(ba.conv1d.bias, bb.conv1d.bias)
        assert not torch.equal(ba.A_log, bb.A_log)
    c = structinit.init_(mamba(3), "mimetic", layers=[1], seed=0)
    assert torch.equal(blocks(c)[0].A_log, blocks(a)[0].A_log) and (blocks(c)[1].A_log == -8).all()


# --------------------------------------------------------------------------- the scan is linear attention
def test_ssm_output_is_causal_linear_attention(mimetic_model):
    torch.manual_seed(1)
    u, length = torch.randn(2, 64, 16), 64
    for block in blocks(mimetic_model):
        with torch.no_grad():
            block.D.zero_()
            x, b, c, delta, a = inner(block, u)
            y = block.ssm(x, torch.zeros_like(x))  # conv → SiLU → x_proj → scan, gate bypassed, D = 0
            block.D.fill_(1.0)
        exact = causal_linear_attention(x, b, c, delta, a)
        assert (y - exact).abs().max() <= 1e-4 * exact.abs().max()
        linear = causal_linear_attention(x, b, c, delta)  # A = 0: no decay at all
        loss = 1 - float(torch.exp(a.abs().max() * delta.max() * -length))  # ≈ 1 − exp(−|A| L)
        assert (y - linear).norm() / linear.norm() <= loss
        assert 0 < loss < 0.03


@pytest.mark.parametrize("length", [64, 50, 1, 7])
def test_pscan_and_sequential_scan_agree(mimetic_model, length):
    """mambapy's pscan pads L to the next power of two with zeros and cuts the output back."""
    torch.manual_seed(2)
    u = torch.randn(2, length, 16)
    block = blocks(mimetic_model)[0]
    with torch.no_grad():
        x, b, c, delta, a = inner(block, u)
        par = block.selective_scan(x, delta, a, b, c, block.D.float())
        seq = block.selective_scan_seq(x, delta, a, b, c, block.D.float())
    assert (par - seq).abs().max() <= 1e-5 * max(1.0, seq.abs().max().item())


def far_mass(model, length=128, reach=32):
    """Share of the layer-0 'attention' |mass| further than ``reach`` tokens back."""
    torch.manual_seed(5)
    u = torch.randn(2, length, model.config.d_model)
    with torch.no_grad():
        _, b, c, delta, a = inner(blocks(model)[0], u)
        att = ssm_attention(b, c, delta, a).abs()
    i = torch.arange(length)
    return float(att[:, (i[:, None] - i[None, :]) > reach].sum() / att.sum())


def test_default_init_attends_far_less_than_mimetic():
    default = structinit.init_(mamba(4), "default", seed=0)
    mimetic = structinit.init_(mamba(4), "mimetic", seed=0)
    assert far_mass(default) < 0.5 * far_mass(mimetic)
    assert far_mass(mimetic) > 0.45  # uniform causal attention would give 0.55 at L = 128


# --------------------------------------------------------------------------- reproducibility and dispatch
def test_same_seed_identical_different_seed_differs():
    every = dict(conv_identity=True)  # `written` covers every part the init can write
    a = written(structinit.init_(mamba(1), "mimetic", seed=7, **every))
    b = written(structinit.init_(mamba(2), "mimetic", seed=7, **every))  # another constructor draw
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = written(structinit.init_(mamba(1), "mimetic", seed=8, **every))
    assert any(not torch.equal(a[k], c[k]) for k in a)
    g = written(structinit.ssm_mimetic_init_(mamba(2), generator=torch.Generator().manual_seed(7), **every))
    assert all(torch.equal(a[k], g[k]) for k in a)


def test_dispatch_default_and_plan():
    model = mamba()
    assert is_ssm(model.layers[0].mixer) and not is_ssm(model.layers[0])
    from structinit.schemes.registry import resolve_scheme

    assert resolve_scheme(model, "mimetic", {})[0].target == "ssm"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, "default", seed=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    plan = structinit.plan_init(model, "mimetic", seed=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    plan.commit()
    ref = written(structinit.ssm_mimetic_init_(mamba(), seed=0))
    assert all(torch.equal(v, written(model)[k]) for k, v in ref.items())


def test_import_without_mambapy():
    code = ("import sys; sys.modules['mambapy'] = None\n"
            "import structinit\n"
            "m = structinit.create_model('vit_micro_patch2_16'); structinit.init_(m, 'mimetic', seed=0)\n"
            "print('mimetic' in structinit.schemes('ssm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d_model=st.integers(2, 12), d_state=st.integers(1, 8), expand=st.integers(1, 3), n_layers=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_property_small_shapes(d_model, d_state, expand, n_layers, seed):
    model = mamba(0, d_model=d_model, d_state=d_state, expand_factor=expand, n_layers=n_layers)
    d_inner = d_model * expand
    if d_state > d_inner:
        check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=seed), ValueError, r"d_state=")
        model = structinit.init_(model, "mimetic", bc=False, conv_identity=True, seed=seed)
    else:
        structinit.init_(model, "mimetic", conv_identity=True, seed=seed)
        _, _, m = mimetic_factors(d_inner, 0.7, 0.7, generator=torch.Generator().manual_seed(seed))
        ad = find_ssm_layers(model)[0][1]
        assert torch.allclose((ad.w_c.T @ ad.w_b).detach().double(), truncation(m, d_state), atol=1e-5)
    assert len(find_ssm_layers(model)) == n_layers
    for block in blocks(model):
        assert ssm_retention(block.A_log.detach(), F.softplus(block.dt_proj.bias.detach()), 256).min() >= 0.9
        x = torch.randn(1, d_inner, 5)
        assert torch.equal(block.conv1d(x)[:, :, :5], x)
    assert torch.isfinite(model(torch.randn(1, 9, d_model))).all()


@pytest.mark.parametrize("off, kept", [
    (dict(a_log=None), ("A_log",)),
    (dict(delta=None), ("dt_weight", "dt_bias")),
    (dict(bc=False), ("w_b", "w_c")),
    (dict(a_log=None, delta=None), ("A_log", "dt_weight", "dt_bias")),
])
def test_each_part_switched_off_keeps_its_tensors_and_the_rest_is_unchanged(off, kept):
    """An ablation spec like ``mimetic:a_log=None`` leaves exactly that part as built, and the
    parts still on get the same values as in the full init (same seed)."""
    built, full = written(mamba()), written(structinit.init_(mamba(), "mimetic", seed=4))
    part = written(structinit.init_(mamba(), "mimetic", seed=4, **off))
    for name, value in part.items():
        expected = built[name] if name.rsplit(".", 1)[1] in kept else full[name]
        assert torch.equal(value, expected), name


# --------------------------------------------------------------------------- bad input
def test_model_without_ssm_layers_is_rejected():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 3))
    for call in (structinit.ssm_mimetic_init_, lambda m: structinit.init_(m, "mimetic", target="ssm")):
        msg = check_rejected(seq, call, ValueError, r"Sequential has no SSM layer")
        assert "MambaBlock" in msg and "register_ssm_adapter" in msg


def test_state_larger_than_inner_width_is_rejected():
    model = mamba(d_model=4, d_state=16, expand_factor=1, n_layers=1)
    msg = check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                         r"d_state=16: SSM layer 'layers\.0\.mixer' has d_state > d_inner = 4")
    assert "bc=False" in msg


@pytest.mark.parametrize("options, exc, match", [
    (dict(foo=1), OptionError, r"unknown option\(s\) foo.*a_log.*conv_identity"),
    (dict(delta=-1.0), ValueError, r"delta=-1\.0: expected a number in \(0, ∞\)"),
    (dict(delta=0), ValueError, r"delta=0"),
    (dict(delta=1e300), ValueError, r"NaN/inf into layers\.0\.mixer\.dt_proj\.bias"),
    (dict(alpha=float("nan")), ValueError, r"alpha=nan"),
    (dict(beta=float("inf")), ValueError, r"beta=inf"),
    (dict(a_log=100.0), ValueError, r"a_log=100\.0: expected a number in \[-87\.0, 88\.0\]"),
    (dict(dt_weight_scale=-0.1), ValueError, r"dt_weight_scale=-0\.1"),
    (dict(delta=None, dt_weight_scale=0.1), ValueError, r"dt_weight_scale=0\.1 with delta=None"),
    (dict(a_log=None, delta=None, bc=False), ValueError, r"every part .* is switched off"),
    (dict(a_log="-8"), OptionError, r"a_log='-8'"),
    (dict(bc="yes"), OptionError, r"bc='yes'"),
    (dict(conv_identity=1), OptionError, r"conv_identity=1"),
    (dict(noise="laplace"), ValueError, r"noise='laplace'"),
    (dict(layers=[5]), ValueError, r"layers contains 5, but the model has 2 SSM layers"),
    (dict(seed="0"), OptionError, r"seed='0'"),
])
def test_bad_options_are_rejected_and_the_model_is_unchanged(options, exc, match):
    calls = (lambda m: structinit.init_(m, "mimetic", **options), lambda m: structinit.ssm_mimetic_init_(m, **options))
    for call in calls:
        check_rejected(mamba(), call, exc, match)


def test_attention_mimetic_on_mamba_is_rejected():
    check_rejected(mamba(), lambda m: structinit.mimetic_init_(m, seed=0), ValueError, r"attention")


def test_bc_is_refused_when_b_and_c_are_normalised_after_the_projection():
    from mambapy.mamba import Mamba, MambaConfig

    model = Mamba(MambaConfig(d_model=8, n_layers=1, inner_layernorms=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="inner_layernorms"):
        structinit.init_(model, "mimetic", seed=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    structinit.init_(model, "mimetic", seed=0, bc=False)  # the rest of the init still applies
    assert float(model.layers[0].mixer.A_log.detach().max()) == -8.0


def test_hugging_face_mamba_gets_the_same_init():
    """transformers' MambaMixer has mambapy's parameter names and x_proj layout: the mimetic
    init finds every mixer, and the retention, Δ and conv identity hold there too; the model
    still runs forward on CPU (transformers' pure-torch path)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MambaConfig(vocab_size=20, hidden_size=16, state_size=8, num_hidden_layers=2,
                                      expand=2, conv_kernel=4, use_mambapy=False)
    torch.manual_seed(0)
    model = transformers.MambaModel(config).eval()
    layers = find_ssm_layers(model)
    assert [n for n, _ in layers] == ["layers.0.mixer", "layers.1.mixer"]
    structinit.init_(model, "mimetic", conv_identity=True, seed=0)
    for _, ad in layers:
        a_log = ad.A_log.detach()
        assert float(a_log.max()) == -8.0 and float(a_log.min()) == -8.0
        dt = F.softplus(ad.dt_bias.detach().double())
        assert torch.allclose(dt, torch.ones(ad.d_inner, dtype=torch.float64), atol=1e-6)
        assert float(ad.dt_weight.detach().abs().max()) == 0.0
        taps = ad.conv_weight.detach()
        assert torch.equal(taps[..., -1], torch.ones_like(taps[..., -1])) and float(taps[..., :-1].abs().max()) == 0
        assert not torch.equal(ad.w_b, ad.w_c)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 20, (2, 9))).last_hidden_state
    assert out.shape == (2, 9, 16) and torch.isfinite(out).all()
