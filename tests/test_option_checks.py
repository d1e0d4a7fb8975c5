"""Every option of every built-in scheme (and of every impulse solver) is checked before anything
is written: an unknown name lists the valid ones, a wrong type, a NaN/inf or an out-of-range
value raises a ValueError/TypeError naming the option, and the model stays bit-identical."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
from torch import nn

import structinit
from rejection import check_rejected
from structinit.functional import IMPULSE_SOLVERS
from structinit.schemes import SCHEMES
from structinit.utils import OptionError

NAN, INF = float("nan"), float("inf")


def small(**kw):
    """4×4 grid, D = 32, 2 heads (head_dim 16), depth 2, fixed sin-cos PE."""
    return structinit.create_model("vit_micro_patch2_16", img_size=8, **kw)


# Bad values by kind of option.
ANY_NUMBER = ["0.7", True, None, [0.7], NAN, INF, -INF, 1e300]  # 1e300: finite, but inf in the model
POSITIVE = [0, -1.0, "1", True, None, [1.0], NAN, INF]
FLAG = ["yes", 1, 0, None, [True]]
SEED = ["0", 1.5, True, [0], 2**64, -(2**63) - 1]
GENERATOR = [0, "gen", [1], torch.zeros(1)]
LAYERS = [True, 3.0, "0", [5], [-3], [], ["0"], [0.5]]
RESERVE = ["bogus", 3, True]
SEEDED = {"generator": GENERATOR, "seed": SEED}

# scheme → option → bad values (every option of every built-in scheme; see the coverage test)
BAD = {
    "impulse": {
        "solver": ["newton", 3, None, ["analytic"]],
        "kernel_size": [4, 0, -3, 3.0, True, "3", None, 9],
        "offsets": [3, "diagonal", {0: 1}, [(0, 0)], [(0.5, 0), (0, 0)], [3, 4], [(2, 0), (0, 0)], [(0, 0), (1,)]],
        "layers": LAYERS,
        "per_layer_offsets": FLAG,
        "grid": [3, "ab", (4,), (4.0, 4), (0, 4), (True, 4), (8, 8)],  # (8, 8): not the PE's rows
        "num_prefix_tokens": [True, 1.5, -1, "1", 5],
        "pos_embed": [[[0.0]], "pe", torch.zeros(15, 32), torch.full((16, 32), NAN)],
        "value_init": ["bogus", 3, True],
        "vo_gamma": ANY_NUMBER,
        "vo_delta": ANY_NUMBER,
        "reserve": RESERVE,
        **SEEDED,
    },
    "mimetic": {
        "alpha": ANY_NUMBER, "beta": ANY_NUMBER, "gamma": ANY_NUMBER, "delta": ANY_NUMBER,
        "noise": ["laplace", 3, None],
        "layers": LAYERS,
        "reference_layout": FLAG,
        "reserve": RESERVE,
        **SEEDED,
    },
    "default": SEEDED,  # writes nothing, but checks its options like every scheme
    "pytorch": SEEDED, "timm": SEEDED, "jax": SEEDED, "xavier": SEEDED, "xavier_fused": SEEDED,
    "trunc_normal": {
        "std": POSITIVE,
        "a": ["x", True, None, NAN, -INF, 3.0],  # 3.0: not below b = 2
        "b": ["x", True, None, NAN, INF, -3.0],  # -3.0: not above a = -2
        **SEEDED,
    },
    "kaiming_uniform": {
        "a": ["x", True, None, [0.0], NAN, INF, 1e200],  # 1e200: a² overflows
        "mode": ["fan", 3, None],
        "nonlinearity": ["swish", 3, None],
        **SEEDED,
    },
}

NUM_FILTERS = [0, -1, 1.5, True, "2"]
NORM = ["l2", 3, None]
CONV_COMMON = {"frozen": FLAG, **SEEDED}
# conv scheme (target 'conv', on a ConvMixer) → option → bad values
CONV_BAD = {
    "orthogonal": {"variant": ["qr", 3, None], "gain": POSITIVE, "std": POSITIVE, "n": [0, -1, 1.5, True, "3"],
                   **CONV_COMMON},
    "impulse": {"num_filters": NUM_FILTERS, "norm": NORM, **CONV_COMMON},
    "box": {"taps": [0, 10, 1.5, True, "3", None], "num_filters": NUM_FILTERS, "norm": NORM, **CONV_COMMON},
    "gaussian": {"sigma": POSITIVE, "num_filters": NUM_FILTERS, "norm": NORM, **CONV_COMMON},
    "random": {"num_filters": NUM_FILTERS, **CONV_COMMON},
    "softmax": {"std": [-1.0, "1", True, None, NAN, INF], **CONV_COMMON},
    "covariance": {"sigma0": POSITIVE, "v_sigma": ["x", True, None, NAN, INF, -5.0], "trace": POSITIVE,
                   **CONV_COMMON},
    "covariance_transfer": {"source": [None, 3, "missing.safetensors", {"w": torch.ones(3)}],
                            "trace": [0, -1.0, "1", True, NAN, INF], "resize": FLAG, **CONV_COMMON},
}


# SSM scheme (target 'ssm', on a mambapy Mamba) → option → bad values
SSM_BAD = {
    "mimetic": {
        # None is valid for a_log and delta: it switches that part off
        "a_log": ["-8", True, NAN, -INF, 100.0, -100.0],
        "delta": [*(v for v in POSITIVE if v is not None), 1e300],  # 1e300: softplus⁻¹ is inf in float32
        "dt_weight_scale": [-0.1, "0", True, None, NAN, INF, 1e300],
        "bc": FLAG, "conv_identity": FLAG,
        "alpha": ANY_NUMBER[:-1], "beta": ANY_NUMBER[:-1],
        "noise": ["laplace", 3, None],
        "layers": [True, 3.0, "0", [5], [-3], [], ["0"], [0.5]],
        **SEEDED,
    },
}


def ssm_small():
    mamba = pytest.importorskip("mambapy.mamba")
    torch.manual_seed(0)
    return mamba.Mamba(mamba.MambaConfig(d_model=8, n_layers=2, d_state=4))


def _ssm_cases():
    for scheme, options in SSM_BAD.items():
        for option, values in options.items():
            for i, value in enumerate(values):
                yield pytest.param(scheme, option, value, id=f"ssm-{scheme}-{option}-{i}")


@pytest.mark.parametrize("scheme, option, value", list(_ssm_cases()))
def test_bad_ssm_value_is_rejected_naming_the_option(scheme, option, value):
    _rejected(ssm_small(), lambda m: structinit.init_(m, scheme, **{"seed": 0, option: value}), option)


@pytest.mark.parametrize("scheme", sorted(SSM_BAD))
def test_unknown_ssm_option_lists_the_valid_ones(scheme):
    from structinit.schemes.registry import get_scheme

    for fn in (lambda m, **kw: structinit.init_(m, scheme, **kw), get_scheme(scheme, target="ssm")):
        msg = check_rejected(ssm_small(), lambda m, fn=fn: fn(m, foo=1, seed=0), OptionError,
                             r"unknown option\(s\) foo")
        assert all(name in msg for name in SSM_BAD[scheme]), msg


def conv_small():
    """ConvMixer-8/2, k3 p2, contiguous weights (see tests/test_conv_filters.py: tiny)."""
    return structinit.create_model("convmixer_256_8", dim=8, depth=2, kernel_size=3, channels_last=False)


# impulse solver → option → bad values
SOLVER_BAD = {
    "analytic": {
        "target_mass": [0, 1.0, 1.5, -0.2, 0.05, "0.5", True, None, NAN, INF],  # 0.05 < 1/N
        "pe_scale": [0.0, -1.0, "2", True, [1.0], NAN, INF, 1e39, 1e-300],
        "ridge": [*POSITIVE, 1.0],  # 1.0: so much ridge the structure is lost
        "signed": FLAG,
        "content": [-0.1, "0.1", True, None, NAN, INF, 1e300],
        "frequencies": [0, -1, 2.5, True, "2"],
    },
    "closed_form": {
        "pe_scale": [0, -1.0, "18", True, NAN, INF],
        "qk_norm": [*POSITIVE, 1e300],
        "logit_scale": POSITIVE,
        "noise": [-1.0, "3", True, None, NAN, INF],
        "pinv_rank": [0, -1, 1.5, True, "4"],
    },
    "gd": {
        "steps": [-1, 2.5, True, "10", None],
        "lr": [*POSITIVE, 1e300],
        "renorm_every": [0, -1, 1.5, True, "100"],
        "pseudo": ["nope", 3, None],
        "share_solution": FLAG,
        "callback": [3, "print"],
    },
}

# what the option needs to be reached (an option of v/proj only matters with value_init='mimetic')
REACH = {("impulse", "vo_gamma"): {"value_init": "mimetic"}, ("impulse", "vo_delta"): {"value_init": "mimetic"},
         ("impulse", "pos_embed"): {"pe_scale": None}, ("impulse", "num_prefix_tokens"): {"pe_scale": None}}


def _named(option: str, message: str) -> bool:
    """The message names the option: ``option=…``, ``option: …``, ``option contains/has …``
    (an unknown solver is named by the solver registry: ``unknown impulse solver …``)."""
    if option == "solver" and "unknown impulse solver" in message:
        return True
    return re.search(rf"(?<![\w.]){re.escape(option)}(=|:| contains | has )", message) is not None


def _cases():
    for scheme, options in BAD.items():
        for option, values in options.items():
            for i, value in enumerate(values):
                yield pytest.param(scheme, option, value, REACH.get((scheme, option), {}),
                                   id=f"{scheme}-{option}-{i}")
    for solver, options in SOLVER_BAD.items():
        for option, values in options.items():
            for i, value in enumerate(values):
                extra = {"solver": solver, **({"steps": 1} if solver == "gd" and option != "steps" else {})}
                yield pytest.param("impulse", option, value, extra, id=f"impulse-{solver}-{option}-{i}")


def _rejected(model, call, option):
    msg = check_rejected(model, call, (ValueError, TypeError), None)
    assert _named(option, msg), msg
    return msg


@pytest.mark.filterwarnings("ignore:.*reserves nothing")
@pytest.mark.parametrize("scheme, option, value, extra", list(_cases()))
def test_bad_value_is_rejected_naming_the_option(scheme, option, value, extra):
    _rejected(small(), lambda m: structinit.init_(m, scheme, **{"seed": 0, **extra, option: value}), option)


def _options(fn) -> set[str]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _conv_cases():
    for scheme, options in CONV_BAD.items():
        for option, values in options.items():
            for i, value in enumerate(values):
                yield pytest.param(scheme, option, value, id=f"conv-{scheme}-{option}-{i}")


@pytest.mark.parametrize("scheme, option, value", list(_conv_cases()))
def test_bad_conv_value_is_rejected_naming_the_option(scheme, option, value):
    extra = {"source": conv_small()} if scheme == "covariance_transfer" else {}
    _rejected(conv_small(), lambda m: structinit.init_(m, scheme, **{"seed": 0, **extra, option: value}), option)


@pytest.mark.parametrize("scheme", sorted(CONV_BAD))
def test_unknown_conv_option_lists_the_valid_ones(scheme):
    from structinit.schemes.registry import get_scheme

    for fn in (lambda m, **kw: structinit.init_(m, scheme, **kw), get_scheme(scheme, target="conv")):
        msg = check_rejected(conv_small(), lambda m, fn=fn: fn(m, foo=1, seed=0), OptionError,
                             r"unknown option\(s\) foo")
        assert all(name in msg for name in CONV_BAD[scheme]), msg


def _entry(name):
    """The scheme of ``name`` for attention, or else for the whole model."""
    return SCHEMES.get(("attention", name)) or SCHEMES[("model", name)]


def test_every_option_of_every_built_in_scheme_and_solver_has_bad_values():
    assert set(BAD) == set(structinit.schemes("model")) | set(structinit.schemes("attention"))
    for name in BAD:
        assert set(BAD[name]) == _options(_entry(name).plan), name
    assert set(CONV_BAD) == set(structinit.schemes("conv"))
    for name in CONV_BAD:
        assert set(CONV_BAD[name]) == _options(SCHEMES[("conv", name)].plan), name
    assert set(SSM_BAD) == set(structinit.schemes("ssm"))
    for name in SSM_BAD:
        assert set(SSM_BAD[name]) == _options(SCHEMES[("ssm", name)].plan), name
    assert set(SOLVER_BAD) == set(IMPULSE_SOLVERS.names())
    for name, cls in IMPULSE_SOLVERS.items():
        assert set(SOLVER_BAD[name]) == set(inspect.signature(cls).parameters), name


# --------------------------------------------------------------------------- unknown options

def _valid(scheme: str) -> set[str]:
    own = _options(_entry(scheme).plan)
    return own | set(inspect.signature(IMPULSE_SOLVERS.get("analytic")).parameters) if scheme == "impulse" else own


CALLS = {
    "init_": lambda scheme: lambda m, **kw: structinit.init_(m, scheme, **kw),
    "plan_init": lambda scheme: lambda m, **kw: structinit.plan_init(m, scheme, **kw).commit(),
    "direct": lambda scheme: getattr(structinit, f"{scheme}_init_"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("scheme", sorted(BAD))
def test_unknown_option_lists_the_valid_ones(scheme, call):
    fn = CALLS[call](scheme)
    msg = check_rejected(small(), lambda m: fn(m, foo=1, seed=0), OptionError, r"unknown option\(s\) foo")
    assert all(name in msg for name in _valid(scheme)), msg


def test_direct_functions_and_planners_are_the_registered_ones():
    for scheme in BAD:
        assert _entry(scheme).init is getattr(structinit, f"{scheme}_init_")
    from structinit.schemes import plan_mimetic

    assert SCHEMES[("attention", "mimetic")].plan is plan_mimetic


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("scheme", sorted(BAD))
def test_every_entry_point_checks_types(scheme, call):
    msg = check_rejected(small(), lambda m: CALLS[call](scheme)(m, seed="0"), OptionError, r"seed='0'")
    assert "expected an int" in msg


@pytest.mark.parametrize("scheme", ["pytorch", "mimetic", "trunc_normal"])
def test_options_are_keyword_only(scheme):
    check_rejected(small(), lambda m: getattr(structinit, f"{scheme}_init_")(m, 3), OptionError,
                   r"positional.*by name: .*seed")


def test_non_module_is_rejected_by_every_entry_point():
    for scheme in BAD:
        for call in CALLS.values():
            with pytest.raises(TypeError, match=r"nn\.Module.*dict"):
                call(scheme)({}, seed=0)


# --------------------------------------------------------------------------- the reported cases

def test_reported_cases():
    msg = check_rejected(small(), lambda m: structinit.init_(m, "impulse", pe_scale="2"), OptionError,
                         r"pe_scale='2'")
    assert "(0, ∞) or None" in msg
    check_rejected(small(), lambda m: structinit.init_(m, "mimetic", alpha=NAN), ValueError, r"alpha=nan")
    msg = check_rejected(small(), lambda m: structinit.init_(m, "impulse", pe_scale=INF), ValueError, r"pe_scale=inf")
    assert "embed" not in msg
    for fn in (structinit.mimetic_init_, structinit.pytorch_init_):
        check_rejected(small(), lambda m, fn=fn: fn(m, foo=1), OptionError, r"foo; valid: .*seed")


def test_a_value_too_large_for_the_model_dtype_is_rejected():
    """α = 1e12 is fine in float32 but overflows float16: the plan is checked in the model's dtype."""
    structinit.init_(small(), "mimetic", alpha=1e12, seed=0)
    half = small().half()
    check_rejected(half, lambda m: structinit.init_(m, "mimetic", alpha=1e12, seed=0), ValueError,
                   r"NaN/inf into blocks\.0\..*float16.*alpha=1000000000000\.0")


def test_good_values_of_every_kind_still_pass():
    model = small()
    structinit.init_(model, "impulse", layers=0, grid=[4, 4], offsets=[(0, 0), (1, 1)], seed=torch.tensor(3).item(),
                     per_layer_offsets=False, vo_gamma=1, value_init="mimetic")
    structinit.init_(model, "mimetic", layers=range(2), alpha=1, generator=torch.Generator().manual_seed(0))
    structinit.init_(model, "kaiming_uniform", a=0, mode="fan_out", nonlinearity="relu", seed=2**63 - 1)
    structinit.trunc_normal_init_(model, std=1, a=-1, b=1, seed=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63, 2**64 - 1])
def test_a_seed_outside_what_the_command_line_takes_is_refused(seed):
    """torch reads −1 as 2⁶⁴ − 1: the API takes the command line's seeds, [0, 2⁶³), and no alias."""
    check_rejected(small(), lambda m: structinit.init_(m, "mimetic", seed=seed), ValueError,
                   rf"seed={seed}: expected a whole number in \[0, 2\*\*63\)")


@pytest.mark.parametrize("option", ["alpha", "beta", "gamma", "delta"])
def test_a_negative_mimetic_scale_is_refused(option):
    check_rejected(small(), lambda m: structinit.init_(m, f"mimetic:{option}=-1", seed=0), ValueError,
                   rf"{option}=-1: expected a number in \[0, ∞\)")


def test_the_api_takes_the_command_lines_spec_and_refuses_an_option_given_twice():
    torch.manual_seed(0)
    a = small()
    torch.manual_seed(0)
    b = small()
    structinit.init_(a, "impulse:kernel_size=3,target_mass=0.3", seed=0)
    structinit.init_(b, "impulse", kernel_size=3, target_mass=0.3, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    check_rejected(small(), lambda m: structinit.init_(m, "impulse:kernel_size=3", kernel_size=5), ValueError,
                   "option 'kernel_size' is given both in the spec and as a keyword")


@pytest.mark.parametrize("scheme", ["impulse", "mimetic", "timm"])
def test_a_quantised_model_is_refused_naming_quantisation(scheme):
    """Its Linear layers hold packed integers: an attention scheme would call it attention it
    cannot read, and a whole-model scheme would skip them without a word."""
    model = structinit.create_model("vit_micro_patch2_16").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notes on its eager quantisation
        quantised = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    message = check_rejected(quantised, lambda m: structinit.init_(m, scheme, seed=0), ValueError,
                             r"layers are quantised \(blocks\.0\.attn\.qkv: torch\.ao\.nn\.quantized")
    assert "nothing was written" in message and "Initialise the float model, then quantise it" in message


@pytest.mark.parametrize("offsets, match", [([(5, 5)], r"offset \(5, 5\) lies outside the 3×3 kernel"),
                                            ([(0, 1, 2)], r"offset \(0, 1, 2\) is not a pair")])
def test_offsets_that_fit_no_kernel_are_refused_before_the_model_runs(offsets, match):
    """Explicit offsets are checked against the kernel before any probe: no forward, nothing written."""
    model = small()
    runs = []
    model.register_forward_pre_hook(lambda *_: runs.append(1))
    check_rejected(model, lambda m: structinit.init_(m, "impulse", offsets=offsets), (TypeError, ValueError), match)
    assert runs == []
