"""Every field of every run config declares its value rule, and the rules hold at the edges:
a value that would train to a wrong result is refused before anything runs, in one ValueError
that names the field, whatever the value is (a fuzz over all fields)."""

import dataclasses
import math
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structinit.harness.config import RULES, check_config, facts
from structinit.harness.tasks import KINDS
from structinit.utils.checks import matches_annotation

FIELDS = [(kind.config, field) for kind in KINDS.values() for field in dataclasses.fields(kind.config)]


@pytest.mark.parametrize("config,field", FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FIELDS])
def test_every_field_declares_a_rule_and_its_default_keeps_it(config, field):
    rule = facts(config, field.name).check
    assert rule is not None, f"{config.__name__}.{field.name} declares no check= rule"
    assert isinstance(rule, tuple) or rule in RULES or callable(rule)  # a function: a check owned elsewhere
    check_config(config())


EDGES = {  # field → values its rule must refuse (each trained wrong, or crashed, before it had one)
    "grad_clip": [-1.0, 0.0, math.inf, math.nan], "ema_decay": [0.0, 1.0, 2.0, math.nan],
    "label_smoothing": [-0.1, 1.0, 1.5], "betas": [(2.0, 0.9), (0.9,), (0.9, math.nan)],
    "lr": [0.0, -1e-3, math.inf, 1e308], "seed": [-1, 2**63, 10**23], "batch_size": [0, 1.5, True],
    "epochs": [0, -1], "weight_decay": [-0.1, math.inf], "eps": [0.0], "min_lr": [math.nan],
    "warmup_epochs": [-1.0], "compile": [1, "yes"], "out_dir": ["", "  "], "model_kwargs": [[], "x"],
}


@pytest.mark.parametrize("name,value", [(n, v) for n, values in EDGES.items() for v in values])
def test_the_edges_are_refused_naming_the_field(name, value):
    config = KINDS["image"].config
    with pytest.raises(ValueError, match=rf"^{name}="):
        check_config(config(**{name: value}))


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                   st.text(max_size=8), st.tuples(st.floats(), st.floats()), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_value_of_any_field_is_accepted_by_its_rule_or_refused_in_one_value_error(data):
    config, field = data.draw(st.sampled_from(FIELDS))
    value = data.draw(VALUES)
    try:
        check_config(config(**{field.name: value}))
    except ValueError as err:
        rule = facts(config, field.name).check
        # a check owned elsewhere (the scheme table's) names the value in its own words
        assert str(err).startswith(f"{field.name}=") or (callable(rule) and repr(value) in str(err)), str(err)
        return
    # accepted: then it is of the field's type, and its rule says yes (a None only where the field may be None)
    hint = typing.get_type_hints(config)[field.name]
    assert matches_annotation(value, hint), (field.name, value)
    rule = facts(config, field.name).check
    if value is not None and not isinstance(rule, tuple) and not callable(rule):
        assert RULES[rule][0](value), (field.name, value)


def test_a_kind_names_only_fields_of_its_config():
    """A kind's selector, data and budget are fields of its config: a misspelt one, or a default
    recipe it does not have, is refused when the kind is built (at import), not in a report."""
    image = KINDS["image"]
    for kind in KINDS.values():
        fields = {f.name for f in dataclasses.fields(kind.config)}
        assert {kind.data, kind.budget} | ({kind.selector} - {None}) <= fields
    with pytest.raises(ValueError, match="datasets not fields of ImageConfig"):
        dataclasses.replace(image, data="datasets")
    with pytest.raises(ValueError, match="default_recipe='nope'"):
        dataclasses.replace(image, default_recipe="nope")
    with pytest.raises(TypeError):  # built with names, never by position
        type(image)(*(getattr(image, f.name) for f in dataclasses.fields(image)))
