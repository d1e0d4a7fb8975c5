"""Every scheme is bit-reproducible: the seed (or generator, or torch's global seed) and not the
model's constructor determines the weights it writes."""

from __future__ import annotations

import pytest
import torch

import structinit
from rejection import check_rejected

# Schemes that write only the attention layers (and maybe the PE): the remaining tensors come
# from the constructor, so both models are first brought to the same state with 'timm'.
PARTIAL = {"impulse", "mimetic"}
FAST_GD = dict(steps=20, lr=1e-2)


# The ViT's schemes; the depthwise-conv ones are reproducible on a ConvMixer in test_conv_filters.py.
# 'default' writes nothing (the constructor's init stays): nothing to reproduce, checked below.
WRITES_NOTHING = {"default"}
VIT_SCHEMES = [s for s in structinit.schemes("model") + structinit.schemes("attention") if s not in WRITES_NOTHING]


def variants():
    out = []
    for name in VIT_SCHEMES:
        if name == "impulse":
            out += [("impulse", dict(solver="analytic")), ("impulse", dict(solver="closed_form")),
                    ("impulse", dict(solver="gd", **FAST_GD)),
                    ("impulse", dict(solver="analytic", value_init="mimetic"))]
        else:
            out.append((name, {}))
    return out


VARIANTS = variants()
IDS = [name + ("-" + "-".join(f"{k}={v}" for k, v in opts.items() if k not in FAST_GD) if opts else "")
       for name, opts in VARIANTS]


def build(torch_seed: int):
    """A small ViT with every kind of tensor: learned PE, class token, norms, conv, head."""
    torch.manual_seed(torch_seed)
    return structinit.VisionTransformer(img_size=16, patch_size=2, embed_dim=32, depth=2, num_heads=2,
                                        num_classes=10, mlp_ratio=2.0, class_token=True, global_pool="token",
                                        pos_embed="learn")


def prepared(scheme: str, torch_seed: int):
    model = build(torch_seed)
    if scheme in PARTIAL:
        structinit.init_(model, "timm", seed=0)
    return model


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_every_registered_scheme_is_covered():
    assert {"impulse", "mimetic", "pytorch", "timm", "jax", "xavier", "xavier_fused", "trunc_normal",
            "kaiming_uniform"} <= set(VIT_SCHEMES)
    assert {name for name, _ in VARIANTS} == set(VIT_SCHEMES)
    assert set(structinit.schemes()) == set(VIT_SCHEMES) | WRITES_NOTHING | set(structinit.schemes("conv"))


def test_default_writes_nothing_and_leaves_the_global_rng():
    model = build(1)
    before = state(model)
    torch.manual_seed(99)
    expected = torch.rand(4)
    torch.manual_seed(99)
    for opts in ({}, {"seed": 3}, {"generator": torch.Generator().manual_seed(0)}):
        structinit.init_(model, "default", **opts)
    assert torch.equal(torch.rand(4), expected)
    assert_identical(state(model), before)


def test_constructors_differ():
    """Precondition of the tests below: the two models start from different weights."""
    a, b = state(build(1)), state(build(2))
    assert differs(a, b)
    assert not torch.equal(a["blocks.0.mlp.fc1.weight"], b["blocks.0.mlp.fc1.weight"])


@pytest.mark.parametrize("scheme,opts", VARIANTS, ids=IDS)
def test_same_seed_bit_identical(scheme, opts):
    a, b = prepared(scheme, 1), prepared(scheme, 2)
    pre_a, pre_b = state(a), state(b)
    if scheme not in PARTIAL:  # the two constructors drew different weights …
        assert differs(pre_a, pre_b)
    structinit.init_(a, scheme, seed=7, **opts)
    structinit.init_(b, scheme, seed=7, **opts)
    sa = state(a)
    assert_identical(sa, state(b))  # … and the init alone decides the result
    assert differs(sa, pre_a)  # the scheme wrote something


@pytest.mark.parametrize("scheme,opts", VARIANTS, ids=IDS)
def test_different_seeds_differ(scheme, opts):
    a, b = prepared(scheme, 1), prepared(scheme, 1)
    structinit.init_(a, scheme, seed=0, **opts)
    structinit.init_(b, scheme, seed=1, **opts)
    assert differs(state(a), state(b))


@pytest.mark.parametrize("scheme,opts", VARIANTS, ids=IDS)
def test_generators_with_same_seed_agree(scheme, opts):
    a, b = prepared(scheme, 1), prepared(scheme, 2)
    structinit.init_(a, scheme, generator=torch.Generator().manual_seed(5), **opts)
    structinit.init_(b, scheme, generator=torch.Generator().manual_seed(5), **opts)
    assert_identical(state(a), state(b))
    c = prepared(scheme, 1)
    structinit.init_(c, scheme, generator=torch.Generator().manual_seed(6), **opts)
    assert differs(state(a), state(c))


@pytest.mark.parametrize("scheme,opts", VARIANTS, ids=IDS)
def test_global_torch_seed_reproduces(scheme, opts):
    a, b = prepared(scheme, 1), prepared(scheme, 2)
    torch.manual_seed(123)
    structinit.init_(a, scheme, **opts)
    torch.manual_seed(123)
    structinit.init_(b, scheme, **opts)
    sa = state(a)
    assert_identical(sa, state(b))
    # without re-seeding, the global RNG has moved on and the draw differs
    c = prepared(scheme, 1)
    structinit.init_(c, scheme, **opts)
    assert differs(sa, state(c))


@pytest.mark.parametrize("scheme,opts", VARIANTS, ids=IDS)
def test_seed_does_not_touch_global_rng(scheme, opts):
    """An explicitly seeded init must not consume or reset torch's global RNG."""
    model = prepared(scheme, 1)
    torch.manual_seed(99)
    expected = torch.rand(4)
    torch.manual_seed(99)
    structinit.init_(model, scheme, seed=3, **opts)
    assert torch.equal(torch.rand(4), expected)


def test_generator_is_advanced_not_reset():
    """Two inits from one generator draw different weights (the generator is consumed)."""
    g = torch.Generator().manual_seed(0)
    a, b = prepared("mimetic", 1), prepared("mimetic", 1)
    structinit.init_(a, "mimetic", generator=g)
    structinit.init_(b, "mimetic", generator=g)
    assert differs(state(a), state(b))


@pytest.mark.parametrize("bad", [1.5, "0", True])
def test_invalid_seed_rejected(bad):
    check_rejected(build(0), lambda m: structinit.init_(m, "timm", seed=bad), TypeError, rf"seed={bad!r}")


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_the_callers_autocast_changes_no_weight_and_is_back_after(scheme):
    """Called inside ``torch.autocast`` (a training script's mixed-precision region), an attention
    scheme reads and checks the model in its own float32: the same weights as outside it, where
    before the survey compared bf16 recomputations with the model's maps and refused every layer
    ("its q kᵀ is not that of the projections"). The caller's autocast is on again after."""
    a, b = prepared(scheme, 1), prepared(scheme, 1)
    structinit.init_(a, scheme, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        structinit.init_(b, scheme, seed=7)
        assert torch.is_autocast_enabled("cpu")
        assert [n for n, _ in structinit.find_attention_layers(b)] == ["blocks.0.attn", "blocks.1.attn"]
    assert_identical(state(a), state(b))


def test_autocast_is_read_through_the_api_of_older_torch_too(monkeypatch):
    """torch < 2.4 asks whether autocast is on per device by name (CUDA's with no argument):
    ``own_precision`` still finds it there, and a device type torch has no autocast for is off."""
    from structinit.utils import state

    def no_argument():  # torch 2.2's torch.is_autocast_enabled: CUDA's, and no device argument
        return True

    monkeypatch.setattr(torch, "is_autocast_enabled", no_argument)
    monkeypatch.setattr(torch, "is_autocast_cpu_enabled", lambda: False, raising=False)
    assert [state._autocast_on(kind) for kind in ("cuda", "cpu", "xpu")] == [True, False, False]
