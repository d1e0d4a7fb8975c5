"""Bad requests get a clear error naming the parameter and value, and leave the model
bit-identical (no partial writes, no impulse record)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from attention_modules import EncoderOnly
from rejection import RECORD, check_rejected
from structinit.models.vit import Attention

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def small(**kw):
    """4×4 grid, D = 32, 2 heads (head_dim 16), depth 2, fixed sin-cos PE."""
    return structinit.create_model("vit_micro_patch2_16", img_size=8, **kw)


def micro(**kw):
    """8×8 grid, D = 32, 2 heads, depth 2."""
    return structinit.create_model("vit_micro_patch2_16", **kw)


def linears():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


impulse = structinit.impulse_init_


# ---------------------------------------------------------------------------------------------
# kernel size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k, exc, match",
    [
        (4, ValueError, r"kernel_size=4\b"),
        (0, ValueError, r"kernel_size=0\b"),
        (-3, ValueError, r"kernel_size=-3\b"),
        (3.0, TypeError, r"kernel_size=3\.0"),
        (True, TypeError, r"kernel_size=True"),
        ("3", TypeError, r"kernel_size='3'"),
    ],
)
def test_bad_kernel_size(k, exc, match):
    check_rejected(small(), lambda m: impulse(m, kernel_size=k, seed=0), exc, match)


_SHARED = small()


@settings(max_examples=25, deadline=None)
@given(k=st.integers(-50, 50).filter(lambda k: k <= 0 or k % 2 == 0))
def test_any_even_or_non_positive_kernel_size_rejected(k):
    check_rejected(_SHARED, lambda m: impulse(m, kernel_size=k, seed=0), ValueError, rf"kernel_size={k}\b")


@pytest.mark.parametrize("make, k, grid", [(micro, 9, "8×8"), (small, 5, "4×4"), (small, 7, "4×4")])
def test_kernel_larger_than_grid(make, k, grid):
    msg = check_rejected(make(), lambda m: impulse(m, kernel_size=k, seed=0), ValueError, rf"kernel_size={k}\b")
    assert grid in msg


def test_kernel_larger_than_explicit_grid():
    model = EncoderOnly()
    check_rejected(model, lambda m: impulse(m, grid=(2, 9), kernel_size=3, pos_embed=torch.randn(18, 16), seed=0),
                   ValueError, r"kernel_size=3\b.*2×9")


# ---------------------------------------------------------------------------------------------
# model structure
# ---------------------------------------------------------------------------------------------


def test_head_dim_too_small_for_analytic():
    model = structinit.VisionTransformer(img_size=8, patch_size=2, embed_dim=8, num_heads=4, depth=1, num_classes=2,
                                         class_token=False, global_pool="avg", pos_embed="sincos")
    check_rejected(model, lambda m: impulse(m, seed=0), ValueError, r"head_dim=2\b")


def test_grid_not_inferable():
    msg = check_rejected(EncoderOnly(), lambda m: impulse(m, seed=0), ValueError, r"grid=")
    assert "EncoderOnly" in msg


@pytest.mark.parametrize(
    "call",
    [
        lambda m: structinit.impulse_init_(m, grid=(3, 3), seed=0),
        lambda m: structinit.init_(m, "mimetic", seed=0),
        lambda m: structinit.impulse_fidelity(m, grid=(3, 3), offsets=[(0, 0)]),
    ],
    ids=["impulse", "mimetic", "fidelity"],
)
def test_model_without_attention(call):
    msg = check_rejected(linears(), call, ValueError, r"no attention layer")
    assert "Sequential" in msg and "register_adapter" in msg


def test_init_rejects_non_module():
    with pytest.raises(TypeError, match=r"nn\.Module.*dict"):
        structinit.init_({}, "impulse")


@pytest.mark.parametrize("call", ["init_", "plan_init", "direct"])
@pytest.mark.parametrize("scheme", ["impulse", "mimetic", "timm", "pytorch"])
def test_a_meta_device_model_is_refused_saying_how_to_materialise_it(scheme, call):
    # A write to a meta tensor does nothing: before this check 'timm' and 'pytorch' returned as if done.
    with torch.device("meta"):
        model = structinit.create_model("vit_micro_patch2_16", img_size=8)
    fn = {"init_": lambda: structinit.init_(model, scheme, seed=0),
          "plan_init": lambda: structinit.plan_init(model, scheme, seed=0),
          "direct": lambda: getattr(structinit, f"{scheme}_init_")(model, seed=0)}[call]
    with pytest.raises(ValueError, match=r"^model: 31 tensors \(pos_embed, …\) are on the meta device.*to_empty"):
        fn()
    assert all(t.is_meta for t in model.state_dict().values())


@pytest.mark.parametrize("scheme", ["impulse", "mimetic", "timm"])
def test_a_model_with_lazy_modules_is_refused_and_stays_lazy(scheme):
    """A probe's forward would materialise a lazy module's parameters, which no restore undoes:
    the model is refused before any run, saying how to materialise it, and stays lazy."""
    from torch.nn.parameter import is_lazy

    model = structinit.create_model("vit_micro_patch2_16", img_size=8)
    model.head = nn.LazyLinear(10)
    with pytest.raises(ValueError, match=r"^model: 2 tensors \(head\.weight, …\) belong to lazy modules.*Run the "):
        structinit.init_(model, scheme, seed=0)
    assert isinstance(model.head, nn.LazyLinear) and is_lazy(model.head.weight)


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_refused_model_in_train_mode_keeps_the_power_iteration_of_its_spectral_norms(scheme):
    """Reading a spectral-normed weight in train mode runs one power iteration, updating the
    parametrisation's ``_u`` and ``_v`` buffers: structinit reads weights to survey and validate,
    and a refused init leaves those buffers bit for bit as they were."""
    from torch.nn.utils import parametrizations

    model = structinit.create_model("vit_micro_patch2_16", img_size=8).train()
    for block in model.blocks:
        parametrizations.spectral_norm(block.mlp.fc1)
        parametrizations.spectral_norm(block.attn.proj)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"kernel_size": 9} if scheme == "impulse" else {"alpha": -1.0}  # refused after the survey
    with pytest.raises(ValueError):
        structinit.init_(model, scheme, seed=0, **options)
    after = model.state_dict()
    assert any(k.endswith("._u") for k in after)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_deferred_initialisation_to_empty_then_init_gives_the_eager_models_weights():
    with torch.device("meta"):
        deferred = structinit.create_model("vit_micro_patch2_16", img_size=8)
    deferred.to_empty(device="cpu")  # uninitialised memory: every value comes from the inits below
    eager = structinit.create_model("vit_micro_patch2_16", img_size=8)
    for model in (deferred, eager):
        structinit.init_(model, "timm", seed=1)
        structinit.init_(model, "impulse", seed=2)
    want = eager.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in deferred.state_dict().items())
    assert structinit.fidelity_summary(structinit.impulse_fidelity(deferred)).hit_first == 1.0


# ---------------------------------------------------------------------------------------------
# unknown names and options
# ---------------------------------------------------------------------------------------------


def test_unknown_scheme_lists_valid_names():
    msg = check_rejected(small(), lambda m: structinit.init_(m, "impulsive", seed=0), ValueError, r"'impulsive'")
    for name in ("impulse", "mimetic", *structinit.schemes()):
        assert name in msg


def test_unknown_solver_lists_valid_names():
    msg = check_rejected(small(), lambda m: impulse(m, solver="newton", seed=0), ValueError, r"'newton'")
    for name in ("analytic", "closed_form", "gd"):
        assert name in msg


@pytest.mark.parametrize(
    "solver, option, valid",
    [("analytic", "targetmass", "target_mass"), ("closed_form", "target_mass", "qk_norm"), ("gd", "step", "steps")],
)
def test_unknown_solver_option_lists_valid_options(solver, option, valid):
    msg = check_rejected(small(), lambda m: impulse(m, solver=solver, seed=0, **{option: 1}), TypeError, option)
    assert valid in msg


def test_unknown_offsets_mode():
    msg = check_rejected(small(), lambda m: impulse(m, offsets="diagonal", seed=0), ValueError, r"offsets='diagonal'")
    assert "random" in msg and "enumerated" in msg


def test_unknown_pseudo_input_names_the_option():
    msg = check_rejected(small(), lambda m: impulse(m, solver="gd", pseudo="nope", steps=1, seed=0),
                         ValueError, r"'nope'")
    assert "uniform" in msg and "gaussian" in msg
    # the option is called `pseudo`: the message must name it as such
    assert "pseudo='nope'" in msg, msg


@pytest.mark.parametrize("solver", ["analytic", "closed_form", "gd"])
def test_unknown_value_init(solver):
    opts = {"steps": 1} if solver == "gd" else {}
    msg = check_rejected(small(), lambda m: impulse(m, solver=solver, value_init="bogus", seed=0, **opts),
                         ValueError, r"value_init='bogus'")
    assert "keep" in msg and "mimetic" in msg


def test_unknown_mimetic_noise():
    msg = check_rejected(small(), lambda m: structinit.init_(m, "mimetic", noise="laplace", seed=0),
                         ValueError, r"noise='laplace'")
    assert "uniform" in msg and "normal" in msg


def test_unknown_mimetic_option():
    check_rejected(small(), lambda m: structinit.init_(m, "mimetic", alpah=0.5), TypeError, r"alpah")


# ---------------------------------------------------------------------------------------------
# explicit offsets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offsets, kwargs, exc, match",
    [
        ([(2, 0), (0, 0)], {}, ValueError, r"\(2, 0\).*3×3"),
        ([(0, 0), (0, -2)], {}, ValueError, r"\(0, -2\).*3×3"),
        ([(0, 3), (0, 0)], {"kernel_size": 5, "grid": None}, ValueError, r"\(0, 3\).*5×5"),
        ([(0, 0)], {}, ValueError, r"1 entries.*2 heads"),
        ([(0, 0), (1, 1), (-1, 0)], {}, ValueError, r"3 entries.*2 heads"),
        ([(0.5, 0), (0, 0)], {}, TypeError, r"0\.5"),
        ([(0, 0), (1,)], {}, TypeError, r"\(1,\)"),
        ([(0, 0), (True, 0)], {}, TypeError, r"True"),
    ],
)
def test_bad_explicit_offsets(offsets, kwargs, exc, match):
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    model = micro() if kwargs.get("kernel_size", 3) > 3 else small()
    check_rejected(model, lambda m: impulse(m, offsets=offsets, seed=0, **kwargs), exc, match)


# ---------------------------------------------------------------------------------------------
# non-finite position embeddings
# ---------------------------------------------------------------------------------------------


def poisoned(value, learned=False):
    model = small(pos_embed="learn") if learned else small()
    with torch.no_grad():
        model.pos_embed[0, 5, 3] = value
        model.pos_embed[0, 9, 0] = value
    return model


PE_READERS = [
    dict(solver="analytic", pe_scale=None),
    dict(solver="closed_form"),
    dict(solver="closed_form", pe_scale=None),
    dict(solver="gd", pseudo="pe", steps=1),
    dict(solver="gd", pseudo="pe+uniform", steps=1),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("opts", PE_READERS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_non_finite_pos_embed_is_rejected_where_read(opts, value):
    msg = check_rejected(poisoned(value), lambda m: impulse(m, seed=0, **opts), ValueError, r"pos_embed")
    assert "NaN/Inf" in msg


def test_non_finite_learned_pos_embed_rejected_by_closed_form():
    check_rejected(poisoned(float("nan"), learned=True), lambda m: impulse(m, solver="closed_form", seed=0),
                   ValueError, r"pos_embed.*NaN/Inf")


def test_non_finite_explicit_pos_embed_rejected():
    pe = structinit.sincos_2d((4, 4), 16)
    pe[2, 2] = float("nan")
    check_rejected(EncoderOnly(), lambda m: impulse(m, grid=(4, 4), pos_embed=pe, pe_scale=None, seed=0),
                   ValueError, r"pos_embed.*NaN/Inf")


def test_analytic_default_overwrites_non_finite_pos_embed():
    """With the default pe_scale the analytic solver writes pe_scale · sin-cos into the grid
    rows and never reads the old PE, so a NaN there is no obstacle (documented behaviour)."""
    model = poisoned(float("nan"))
    structinit.impulse_init_(model, seed=0)
    torch.testing.assert_close(model.pos_embed[0], structinit.sincos_2d((4, 4), 32))
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


# ---------------------------------------------------------------------------------------------
# numeric options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mass", [0, 0.0, 1.0, 1.5, -0.2, 0.05])  # 0.05 < 1/N = 1/16
def test_target_mass_out_of_range(mass):
    check_rejected(small(), lambda m: impulse(m, target_mass=mass, seed=0), ValueError, rf"target_mass={mass}\b")


@pytest.mark.parametrize("opts, match", [
    (dict(pe_scale=0.0), r"pe_scale=0\.0"),
    (dict(pe_scale=-1.0), r"pe_scale=-1\.0"),
    (dict(ridge=0.0), r"ridge=0\.0"),
    (dict(ridge=-1e-3), r"ridge=-0\.001"),
    (dict(solver="gd", steps=-1), r"steps=-1"),
    (dict(content=-0.1), r"content=-0\.1"),
    (dict(content=float("nan")), r"content=nan"),
    (dict(frequencies=0), r"frequencies=0"),
    (dict(frequencies=2.5), r"frequencies=2\.5"),
    (dict(signed="yes"), r"signed='yes'.*True or False"),
])
def test_bad_numeric_solver_options(opts, match):
    check_rejected(small(), lambda m: impulse(m, seed=0, **opts), ValueError, match)


def test_pos_embed_argument_of_wrong_shape():
    check_rejected(small(), lambda m: impulse(m, pos_embed=torch.zeros(15, 32), pe_scale=None, seed=0),
                   ValueError, r"pos_embed has shape \(15, 32\).*\(16, 32\)")


# ---------------------------------------------------------------------------------------------
# layers, seed, generator
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers, shown", [([5], "5"), ([0, 2], "2"), ([-3], "-3"), (["0"], "'0'"), ([True], "True")])
@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_layers_out_of_range(scheme, layers, shown):
    msg = check_rejected(small(), lambda m: structinit.init_(m, scheme, layers=layers, seed=0), ValueError,
                         rf"layers contains {shown}")
    assert "0 … 1" in msg


def test_fidelity_layers_out_of_range():
    model = small()
    structinit.impulse_init_(model, seed=0)
    with pytest.raises(ValueError, match=r"layers contains 7.*0 … 1"):
        structinit.impulse_fidelity(model, layers=[7])


@pytest.mark.parametrize("seed", ["0", 1.5, True, [0]])
@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_seed_of_wrong_type(scheme, seed):
    check_rejected(small(), lambda m: structinit.init_(m, scheme, seed=seed), TypeError, r"seed=")


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_generator_of_wrong_type(scheme):
    check_rejected(small(), lambda m: structinit.init_(m, scheme, generator=0), TypeError, r"generator=0")


def test_fidelity_without_impulse_init_asks_for_offsets():
    model = small()
    with pytest.raises(ValueError, match=r"offsets="):
        structinit.impulse_fidelity(model)
    structinit.init_(model, "mimetic", seed=0)  # mimetic records no offsets either
    with pytest.raises(ValueError, match=r"offsets="):
        structinit.impulse_fidelity(model)


def test_fidelity_offsets_count_mismatch():
    with pytest.raises(ValueError, match=r"2 heads but 3 offsets"):
        structinit.impulse_fidelity(small(), offsets=[(0, 0), (0, 1), (1, 0)])


# ---------------------------------------------------------------------------------------------
# requests that fail late in planning leave nothing half-done
# ---------------------------------------------------------------------------------------------


def test_mimetic_clears_stale_impulse_record_only_on_success():
    model = small()
    structinit.impulse_init_(model, seed=0)
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    records = [getattr(m, RECORD) for m in model.modules() if hasattr(m, RECORD)]
    assert len(records) == 2
    with pytest.raises(ValueError, match=r"noise="):
        structinit.init_(model, "mimetic", noise="bad", seed=0)
    assert all(torch.equal(snap[k], v) for k, v in model.state_dict().items())
    assert [getattr(m, RECORD) for m in model.modules() if hasattr(m, RECORD)] == records


def test_value_init_error_after_qk_and_pe_were_planned():
    # pe_scale=2 plans a PE rewrite, q/k are planned for both layers, then value_init fails
    model = small()
    check_rejected(model, lambda m: impulse(m, pe_scale=2.0, value_init="random", seed=0), ValueError,
                   r"value_init='random'")


def test_failure_on_second_layer_leaves_first_layer_untouched():
    """Layer 0 (head_dim 16) plans fine; layer 1 (16 heads of dim 2) is too small for the
    analytic structure and fails — nothing of layer 0, nor the PE, may have been written."""
    model = small()
    model.blocks[1].attn = Attention(32, 16)
    check_rejected(model, lambda m: impulse(m, seed=0), ValueError, r"head_dim=2\b")


def test_previous_impulse_state_survives_a_failed_reinit():
    model = small()
    structinit.impulse_init_(model, seed=1)
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    records = [dict(getattr(m, RECORD)) for m in model.modules() if hasattr(m, RECORD)]
    with pytest.raises(ValueError, match=r"target_mass=1\.0"):
        structinit.impulse_init_(model, seed=2, target_mass=1.0)
    assert all(torch.equal(snap[k], v) for k, v in model.state_dict().items())
    assert [getattr(m, RECORD) for m in model.modules() if hasattr(m, RECORD)] == records
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


def test_a_projection_two_layers_share_is_refused_when_they_plan_different_values_for_it():
    """Mimetic plans each layer's own projections: one Linear in two blocks would keep only the
    last, and the first layer's maps would be built on the other's weights, unseen. Impulse plans
    the same values for both here (the same offsets), which the one Linear holds for both."""
    model = small()
    model.blocks[1].attn.qkv = model.blocks[0].attn.qkv
    check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"^scheme 'mimetic' would write 'blocks\.0\.attn\.qkv\.weight' \(one parameter with "
                   r"'blocks\.1\.attn\.qkv\.weight'\) twice with different values.*own copy.*layers=")
    structinit.init_(model, "impulse", seed=0)  # checked in the model's own forward, both layers
    assert structinit.get_record(model.blocks[0].attn)["offsets"] == structinit.get_record(model.blocks[1].attn)[
        "offsets"]


def test_an_attention_module_every_block_calls_is_one_layer_and_is_written():
    model = small()
    model.blocks[1].attn = model.blocks[0].attn
    structinit.init_(model, "mimetic", seed=0)
    assert structinit.get_record(model, "init")["layers"] == ["blocks.0.attn"]


@pytest.mark.parametrize("scheme", ["impulse", "mimetic", "timm"])
def test_a_torchscript_model_is_refused_saying_to_initialise_it_before_scripting(scheme):
    model = torch.jit.trace(small().eval(), torch.randn(1, 3, 8, 8))
    check_rejected(model, lambda m: structinit.init_(m, scheme, seed=0), ValueError,
                   r"^model: <root> is a TorchScript module .*Initialise the nn.Module first, then script or trace it")
