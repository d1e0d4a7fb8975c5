"""Fuzz every option of every registered init scheme: whatever value an option gets (valid,
edge, out of range, of the wrong type, NaN, ±inf, huge), ``init_`` either succeeds with finite
weights, or refuses with a ValueError/TypeError in one line that names the option and leaves the
model bit-identical. Nothing else: no other exception type, no traceback from deep in the maths.

Written against the public API only (``structinit.init_``, ``structinit.schemes``,
``get_scheme``'s signature, ``structinit.IMPULSE_SOLVERS``); the hand-picked bad values of each
option are in tests/test_option_checks.py.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import structinit
from rejection import assert_untouched, snapshot
from structinit.schemes import TARGETS, get_scheme

NAN, INF = float("nan"), float("inf")


@functools.cache
def template(target: str) -> torch.nn.Module:
    """A small model with the layers ``target`` schemes initialise (built once, copied per call)."""
    torch.manual_seed(0)
    if target in ("model", "attention"):  # 4×4 grid, D 32, 2 heads, one block
        return structinit.create_model("vit_micro_patch2_16", img_size=8, depth=1)
    if target == "conv":
        return structinit.create_model("convmixer_256_8", dim=8, depth=2, kernel_size=3, channels_last=False)
    if target == "token_mixing":
        return structinit.create_model("mixer_cpu_patch4_32", img_size=16, embed_dim=32, num_blocks=2)  # 16 tokens
    if target == "ssm":
        mamba = pytest.importorskip("mambapy.mamba")
        return mamba.Mamba(mamba.MambaConfig(d_model=8, n_layers=2, d_state=4))
    raise AssertionError(f"no small model for target {target!r}: add one")


def registrations() -> list[tuple[str, str]]:
    """(target, scheme) of every registration."""
    return [(target, name) for target in TARGETS for name in structinit.schemes(target)]


def targets_of(name: str) -> list[str]:
    return [t for t, n in registrations() if n == name]


def named_options(fn) -> dict[str, object]:
    """The options of ``fn(model, ...)`` that are passed by name, and their defaults."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def takes_more(fn) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


# What an option needs beside it to be read at all (an option of the value/projection init only
# matters with value_init='mimetic'; a gd solver's options with a short run).
REACH = {("impulse", "vo_gamma"): {"value_init": "mimetic"}, ("impulse", "vo_delta"): {"value_init": "mimetic"},
         ("impulse", "pos_embed"): {"pe_scale": None}, ("impulse", "num_prefix_tokens"): {"pe_scale": None}}


def cases():
    """(target, scheme, option, default, other options) for every option of every registration,
    the impulse solvers' options (``**solver_options``) each with its solver."""
    for target, name in registrations():
        fn = get_scheme(name, target=target)
        for option, default in named_options(fn).items():
            yield pytest.param(target, name, option, default, REACH.get((name, option), {}),
                               id=f"{target}-{name}-{option}")
        if takes_more(fn) and name == "impulse" and target == "attention":
            for solver, cls in structinit.IMPULSE_SOLVERS.items():
                for option, param in inspect.signature(cls).parameters.items():
                    extra = {"solver": solver, **({"steps": 1} if solver == "gd" and option != "steps" else {})}
                    yield pytest.param(target, name, option, param.default, extra,
                                       id=f"{target}-{name}-{solver}-{option}")


EDGES = [
    None, True, False, 0, 1, -1, 2, 3, 4, 7, 0.0, -0.0, 0.5, 1.0, -1.0, 0.999999, 1e-300, 5e-324, 1e300, -1e300,
    1e39, 3.5e38, 65504.0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400, NAN, INF, -INF, "", "x", "0", "1.5", "nan",
    "analytic", "closed_form", "gd", "mimetic", "random", "circular", "uniform", "sum", "delta", "fan_in", "relu",
    "diagonal", "exclude", [], [0], [1], [0, 1], [-1], [5], [0.5], [NAN], [(0, 0)], [(0, 0), (1, 1)], [(0, 1), (1, 0)],
    (4, 4), (0, 0), (4,), (2, 2), (-1, 4), (4.0, 4), {}, {"a": 1}, range(2), range(0), object(), b"x", 1 + 2j,
    Fraction(1, 3), Decimal("0.5"), Decimal("nan"), np.float32(0.5), np.float64(NAN), np.int64(3), np.bool_(True),
    np.array([1.0]), torch.tensor(0.5), torch.tensor(3), torch.tensor(NAN), torch.zeros(1), torch.zeros(16, 32),
    torch.full((16, 32), NAN), torch.zeros(15, 32), torch.Generator(), print, lambda *a, **k: None,
]


def values(default: object) -> st.SearchStrategy:
    numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.floats(-10, 10))
    shaped = st.one_of(st.lists(st.integers(-2, 6), max_size=3), st.tuples(st.integers(-1, 9), st.integers(-1, 9)))
    drawn = st.one_of(st.sampled_from(EDGES), numbers, st.text(max_size=4), shaped)
    return drawn if default is inspect.Parameter.empty else st.one_of(st.just(default), drawn)


def names(option: str, message: str) -> bool:
    """The message names the option: ``option=…``, ``option: …``, ``option contains/has …``
    (an unknown solver is named by the solver registry)."""
    if option == "solver" and "unknown impulse solver" in message:
        return True
    return re.search(rf"(?<![\w.]){re.escape(option)}(=|:| contains | has | must )", message) is not None


def number(value: object) -> float | None:
    try:
        return float(value) if isinstance(value, (int, float, np.number)) and not isinstance(value, bool) else None
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def matrix(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2


# Values the fuzz does not draw, each for a reason. SLOW: a valid request that takes long by design.
# KNOWN_BUGS: values a scheme is known to mishandle, each to be fixed (none today; the ones this fuzz
# found are fixed and kept below as FOUND). (description, (scheme, option, value) -> bool)
SLOW = [
    ("solver='gd' runs its default thousands of steps", lambda s, o, v: o == "solver" and v == "gd"),
    ("gd's steps= has no upper bound: steps=10**6 runs for minutes",
     lambda s, o, v: o == "steps" and (number(v) or 0) > 50),
]
KNOWN_BUGS: list = []  # (what, predicate) of values the schemes are known to mishandle; none today


def excluded(scheme: str, option: str, value: object) -> bool:
    return any(known(scheme, option, value) for _, known in SLOW + KNOWN_BUGS)


CASES = list(cases())


def test_every_registered_scheme_has_cases_and_a_small_model():
    assert {(c.values[0], c.values[1]) for c in CASES} == {r for r in registrations() if named_options(
        get_scheme(r[1], target=r[0]))}
    assert {t for t, _ in registrations()} <= set(TARGETS)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("target, scheme, option, default, extra", CASES)
@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_any_value_of_any_option_is_used_or_refused_in_one_line(target, scheme, option, default, extra, data):
    value = data.draw(values(default).filter(lambda v: not excluded(scheme, option, v)), label=option)
    check(target, scheme, option, value, extra)


def check(target: str, scheme: str, option: str, value: object, extra: dict) -> None:
    """``init_`` with ``option=value`` succeeds with finite weights or refuses in one line naming
    ``option``, the model untouched."""
    model = copy.deepcopy(template(target))
    options = {**({} if option in ("seed", "generator") else {"seed": 0}), **extra, option: value}
    if len(targets_of(scheme)) > 1:
        options["target"] = target
    if scheme == "covariance_transfer" and option != "source":
        options["source"] = template("conv")
    before = snapshot(model)
    try:
        structinit.init_(model, scheme, **options)
    except (ValueError, TypeError) as err:
        message = str(err)
        assert "\n" not in message.strip(), f"{type(err).__name__} in more than one line: {message}"
        assert names(option, message), f"{type(err).__name__} does not name {option}: {message}"
        assert_untouched(model, before)
        return
    bad = [n for n, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, f"{scheme}({option}={value!r}) wrote NaN/inf into {bad}"


def test_the_values_reach_every_kind():
    """The pool holds valid and invalid values of each kind the options take."""
    kinds = {type(v) for v in EDGES}
    assert {int, float, str, list, tuple, bool, type(None), torch.Tensor, torch.Generator} <= kinds
    assert any(isinstance(v, float) and math.isnan(v) for v in EDGES) and INF in EDGES and 10**400 in EDGES


FOUND = [  # one call of each bug this fuzz found, each failed before its fix: (target, scheme, option, value, others)
    ("model", "pytorch", "seed", np.int64(3), {}),
    ("model", "kaiming_uniform", "a", np.float32(0.5), {}),
    ("model", "trunc_normal", "a", 0.02, {}),
    ("attention", "mimetic", "alpha", Fraction(1, 3), {}),
    ("model", "kaiming_uniform", "mode", torch.zeros(2, 2), {}),
    ("attention", "mimetic", "layers", torch.tensor(0), {}),
    ("attention", "impulse", "pos_embed", torch.zeros(16, 32), {"pe_scale": None}),
    ("conv", "random", "num_filters", 2**63, {}),
    ("conv", "covariance", "sigma0", 1e-300, {}),
    ("conv", "softmax", "std", 1e39, {}),
    ("conv", "gaussian", "sigma", 1e-300, {}),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("target, scheme, option, value, extra", FOUND, ids=[f"{s}-{o}" for _, s, o, _, _ in FOUND])
def test_the_values_the_fuzz_found_are_used_or_refused_in_one_line(target, scheme, option, value, extra):
    check(target, scheme, option, value, extra)
