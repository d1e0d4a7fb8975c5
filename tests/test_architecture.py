"""The package layout keeps its promises: imports flow one way, `import structinit` stays light,
one registry style, and plans that check and compute an init without writing it."""

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from rejection import check_rejected
from structinit.functional import IMPULSE_SOLVERS, AnalyticSolver, make_impulse_solver
from structinit.utils import OptionError, Registry

PACKAGE = Path(structinit.__file__).parent
# Layers from bottom to top; a module may import its own layer and the layers below it.
LAYERS = ["utils", "functional", "adapters", "schemes", "models", "analysis", "harness"]
BESIDE = {"data", "augment"}  # beside the stack: they may import utils only; the harness uses them


def module_name(path: Path) -> str:
    """``structinit/adapters/gated.py`` → ``structinit.adapters.gated`` (a package: its folder's)."""
    parts = ("structinit", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a ``from … import`` names, relative ones (``from ..harness import x``
    in ``structinit.utils.checks``) resolved against the importing module."""
    if node.level == 0:
        return node.module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path):
    """(kind, absolute module, names) for every import in the module at ``path``, wherever it
    sits: ``("from", "structinit.harness", ["config"])`` or ``("import", "structinit.data", [])``."""
    importer, is_package = module_name(path), path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            yield "from", imported_from(node, importer, is_package), [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield "import", alias.name, []


def package_imports(path: Path) -> set[str]:
    """Top-level structinit sub-packages imported by the module at ``path``."""
    found = set()
    for _, module, _ in imports_of(path):
        parts = module.split(".")
        if parts[0] == "structinit" and len(parts) > 1:
            found.add(parts[1])
    return found


def test_relative_imports_are_read_as_the_modules_they_name():
    """Written relatively, an upward import and a circle must still be seen."""
    upward = ast.parse("from ..harness import config").body[0]
    assert imported_from(upward, "structinit.utils.checks", is_package=False) == "structinit.harness"
    sibling = ast.parse("from .main import _parser").body[0]
    assert imported_from(sibling, "structinit.harness.cli.flags", is_package=False) == "structinit.harness.cli.main"
    own = ast.parse("from . import gated").body[0]
    assert imported_from(own, "structinit.adapters", is_package=True) == "structinit.adapters"


def test_no_module_at_the_package_root_but_init_and_main():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_imports_flow_one_way():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            continue  # the facade (__init__, __main__) may import anything
        layer = rel.parts[0]
        for target in package_imports(path) - {layer}:
            if layer in BESIDE:
                ok = target == "utils"
            elif target in BESIDE:
                ok = layer == "harness"
            else:
                ok = LAYERS.index(target) < LAYERS.index(layer)
            if not ok:
                upward.append(f"{rel} imports structinit.{target}")
    assert not upward, upward


def module_graph() -> dict[str, set[str]]:
    """Every module of the package → the package modules it imports, wherever in the file
    (top level, inside functions, under TYPE_CHECKING). ``from pkg import sub`` counts as an
    import of the module ``pkg.sub``. The root facade ``structinit`` (it re-exports the API,
    so everything reaches it) is left out."""
    names = {path: module_name(path) for path in PACKAGE.rglob("*.py")}
    modules = set(names.values())
    graph = {}
    for path, name in names.items():
        targets = set()
        for kind, module, imported in imports_of(path):
            if kind == "from":
                submodules = {f"{module}.{a}" for a in imported} & modules
                targets |= submodules
                if len(submodules) < len(imported):  # names defined by the module itself
                    targets.add(module)
            else:
                targets.add(module)
        graph[name] = {t for t in targets if t in modules and t != "structinit"} - {name}
    graph.pop("structinit")
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package():
    assert import_cycles(module_graph()) == []


def test_import_cycles_are_found():
    """The checker itself: a two-module circle and a three-module one are reported, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(import_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert module_graph()["structinit.harness.cli.main"] >= {"structinit.harness.cli.flags",
                                                              "structinit.harness.cli.ablate"}


def test_every_flag_of_every_command_has_help():
    import argparse

    from structinit.harness.cli.main import _parser

    missing = []
    for name, sub in _parser()._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"structinit {name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


HEAVY = ["PIL", "matplotlib", "sklearn", "scipy.io", "tqdm", "safetensors", "structinit.harness",
         "structinit.data", "structinit.augment"]


def test_import_structinit_and_init_do_not_load_the_harness_stack():
    """Users who only initialise models need torch, numpy and scipy. torch itself may import
    some of the heavy modules (it imports tqdm), so compare with what torch already loaded."""
    code = f"""
import json, sys
import numpy, scipy.optimize, torch
before = set(sys.modules)
import structinit
model = structinit.create_model("vit_micro_patch2_16")
structinit.init_(model, "impulse", seed=0)
structinit.impulse_fidelity(model)
new = set(sys.modules) - before
print(json.dumps(sorted(m for m in new if any(m == h or m.startswith(h + ".") for h in {HEAVY!r}))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_lazy_harness_names_resolve():
    from structinit.augment import Augment
    from structinit.data import load_dataset
    from structinit.harness.config import ImageConfig
    from structinit.harness.tasks import train

    assert structinit.ImageConfig is ImageConfig and structinit.train is train
    assert structinit.load_dataset is load_dataset and structinit.Augment is Augment
    assert set(structinit.__all__) <= set(dir(structinit))
    with pytest.raises(AttributeError, match=r"no attribute 'not_a_name'"):
        structinit.not_a_name  # noqa: B018


# --------------------------------------------------------------------------- the registry class
def test_registry_names_order_and_errors():
    reg = Registry("widget")
    reg.register("b", 2)
    reg.register("a", 1)
    reg.register("c", 3, first=True)
    assert list(reg) == ["c", "b", "a"] and reg.names() == ["a", "b", "c"] and reg["b"] == 2
    reg.register("b", 2)  # the same entry again: harmless
    with pytest.raises(ValueError, match=r"widget 'b' is already registered.*replace=True"):
        reg.register("b", 20)
    reg.register("b", 20, replace=True)
    assert reg.get("b") == 20
    with pytest.raises(ValueError, match=r"unknown widget 'z'; valid names: a, b, c"):
        reg.get("z")

    @reg.register()
    def named_by_function():
        pass

    assert reg.get("named_by_function") is named_by_function
    reg.remove("named_by_function")
    assert "named_by_function" not in reg


def test_every_name_registry_uses_the_registry_class():
    from structinit.adapters import ATTENTION_ADAPTERS
    from structinit.models import MODELS
    from structinit.schemes import SCHEMES

    for reg in (ATTENTION_ADAPTERS, MODELS, IMPULSE_SOLVERS):
        assert isinstance(reg, Registry)
    # the scheme table is one dict keyed by (target, name), as timm keys models by name
    assert all(s.target == target and s.name == name for (target, name), s in SCHEMES.items())
    assert {"analytic", "closed_form", "gd"} <= set(IMPULSE_SOLVERS)
    assert structinit.schemes("attention") == ["impulse", "mimetic"]
    assert {"pytorch", "timm", "jax"} <= set(structinit.schemes("model"))
    with pytest.raises(ValueError, match=r"target='token'.*attention"):
        structinit.schemes("token")


def test_register_model_entry_point():
    @structinit.register_model
    def tiny_test_vit(**kwargs):
        return structinit.VisionTransformer(**{"img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 1,
                                               "num_heads": 2, "num_classes": 3, **kwargs})

    try:
        assert "tiny_test_vit" in structinit.list_models()
        assert structinit.create_model("tiny_test_vit", num_classes=5).head.out_features == 5
    finally:
        structinit.models.MODELS.remove("tiny_test_vit")
    with pytest.raises(ValueError, match=r"unknown model 'tiny_test_vit'; valid names: .*vit_base_patch16_224"):
        structinit.create_model("tiny_test_vit")


# --------------------------------------------------------------------------- plans
SCHEME_OPTIONS = {"impulse": {}, "mimetic": {}, "default": {}, "pytorch": {}, "timm": {}, "jax": {}, "xavier": {},
                  "xavier_fused": {}, "trunc_normal": {"std": 0.05}, "kaiming_uniform": {"a": 0.0}}


@pytest.mark.parametrize("scheme", sorted(SCHEME_OPTIONS))
def test_plan_writes_nothing_and_commit_equals_init(scheme):
    assert set(SCHEME_OPTIONS) == set(structinit.schemes("model")) | set(structinit.schemes("attention"))
    planned = structinit.create_model("vit_micro_patch2_16", pos_embed="learn")
    direct = structinit.create_model("vit_micro_patch2_16", pos_embed="learn")
    direct.load_state_dict(planned.state_dict())
    before = {k: v.clone() for k, v in planned.state_dict().items()}
    plan = structinit.plan_init(planned, scheme, seed=3, **SCHEME_OPTIONS[scheme])
    assert all(torch.equal(v, before[k]) for k, v in planned.state_dict().items())
    assert all(structinit.get_record(m) is None for m in planned.modules())
    plan.commit()
    structinit.init_(direct, scheme, seed=3, **SCHEME_OPTIONS[scheme])
    for (k, a), b in zip(planned.state_dict().items(), direct.state_dict().values()):
        assert torch.equal(a, b), k
    assert [structinit.get_record(m) for m in planned.modules()] == [structinit.get_record(m) for m in direct.modules()]


@pytest.mark.parametrize("spec, match", [
    (dict(target_mas=0.3), r"unknown option\(s\) target_mas; valid: target_mass, pe_scale, ridge"),
    (dict(pe_scale="abc"), r"pe_scale='abc': expected a number in \(0, ∞\) or None"),
    (dict(solver="gd", steps=2.5), r"steps=2\.5: expected an int"),
])
def test_plan_rejects_a_bad_spec_with_a_value_error_naming_the_option(spec, match):
    check_rejected(structinit.create_model("vit_micro_patch2_16"),
                   lambda m: structinit.plan_init(m, "impulse", seed=0, **spec).commit(), ValueError, match)


def test_unknown_option_is_both_type_and_value_error():
    with pytest.raises(OptionError) as info:
        structinit.plan_init(structinit.create_model("vit_micro_patch2_16"), "mimetic", alpah=0.5)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_plan_of_a_user_scheme_without_planner_checks_options_and_defers():
    calls = []

    def halve_init_(model, *, factor=0.5, seed=None):
        calls.append(factor)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(factor)
        return model

    structinit.register_scheme("halve_test", halve_init_)
    try:
        model = structinit.create_model("vit_micro_patch2_16")
        with pytest.raises(OptionError, match=r"unknown option\(s\) factr; valid: factor, seed"):
            structinit.plan_init(model, "halve_test", factr=2)
        before = model.head.weight.clone()
        plan = structinit.plan_init(model, "halve_test", factor=0.25)
        assert calls == [] and torch.equal(model.head.weight, before)
        plan.commit()
        assert calls == [0.25] and torch.equal(model.head.weight, before * 0.25)
    finally:
        from structinit.schemes import SCHEMES  # (structinit.schemes is the function listing names)

        SCHEMES.pop(("model", "halve_test"))


def test_records_get_and_set():
    attn = structinit.create_model("vit_micro_patch2_16").blocks[0].attn
    assert structinit.get_record(attn) is None
    structinit.set_record(attn, "impulse", {"offsets": [(0, 0), (1, 1)]})
    assert structinit.get_record(attn, "impulse") == {"offsets": [(0, 0), (1, 1)]}
    assert attn.structinit_impulse == {"offsets": [(0, 0), (1, 1)]}  # the attribute users may know
    structinit.set_record(attn, "impulse", None)
    assert structinit.get_record(attn) is None
    with pytest.raises(ValueError, match=r"kind='not a name'"):
        structinit.get_record(attn, "not a name")


# --------------------------------------------------------------------------- impulse solvers
@settings(max_examples=40, deadline=None)
@given(mass=st.floats(-2, 3, allow_nan=False), scale=st.one_of(st.none(), st.floats(-2, 8, allow_nan=False)))
def test_analytic_options_are_checked_when_the_solver_is_built(mass, scale):
    valid = 0 < mass < 1 and (scale is None or scale > 0)
    if valid:
        solver = make_impulse_solver("analytic", target_mass=mass, pe_scale=scale)
        assert solver == AnalyticSolver(target_mass=mass, pe_scale=scale)
    else:
        with pytest.raises(ValueError, match=r"target_mass=|pe_scale="):
            make_impulse_solver("analytic", target_mass=mass, pe_scale=scale)


def test_a_registered_solver_is_usable_by_name():
    @IMPULSE_SOLVERS.register("sharp_test")
    @dataclass(frozen=True, kw_only=True)
    class SharpSolver(AnalyticSolver):
        """The analytic solver with a sharper default: a subclass changes defaults only."""

        target_mass: float = 0.9

    try:
        model = structinit.create_model("vit_micro_patch2_16")
        structinit.init_(model, "impulse", solver="sharp_test", seed=0)
        fid = structinit.impulse_fidelity(model)
        assert bool((fid["hit"] == 1).all()) and abs(fid["mass"].mean().item() - 0.9) < 1e-3
        assert structinit.get_record(model.blocks[0].attn)["solver"] == "sharp_test"
    finally:
        IMPULSE_SOLVERS.remove("sharp_test")


def test_adapter_registration_is_keyed_by_qualified_name():
    """A user class called MultiheadAttention neither collides with the built-in entry nor
    shadows it after unregistering; registering twice replaces instead of duplicating."""
    from structinit.adapters import ATTENTION_ADAPTERS, SeparateQKVAdapter

    class MultiheadAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.q, self.k, self.v, self.o = 2, *(nn.Linear(8, 8) for _ in range(4))

    n = len(ATTENTION_ADAPTERS)
    structinit.register_adapter(MultiheadAttention, SeparateQKVAdapter)
    structinit.register_adapter(MultiheadAttention, SeparateQKVAdapter)
    try:
        assert len(ATTENTION_ADAPTERS) == n + 1
        assert isinstance(structinit.adapters.adapter_for(MultiheadAttention()), SeparateQKVAdapter)
    finally:
        structinit.unregister_adapter(MultiheadAttention)
    assert len(ATTENTION_ADAPTERS) == n
    assert isinstance(structinit.adapters.adapter_for(nn.MultiheadAttention(8, 2)),
                      structinit.MultiheadAttentionAdapter)


# --------------------------------------------------------------------------- docstring examples
@pytest.mark.parametrize("module", [
    "structinit.utils.registry", "structinit.functional.attention", "structinit.functional.impulse_solvers",
    "structinit.schemes.records", "structinit.schemes.registry", "structinit.schemes.impulse",
    "structinit.schemes.mimetic", "structinit.models.registry", "structinit.functional.relative",
    "structinit.functional.mixer", "structinit.models.mixer", "structinit.schemes.token_mixing",
    "structinit.models.swin", "structinit.adapters.relative", "structinit.analysis.token_mixing",
    "structinit.functional.rope", "structinit.functional.position_mlp", "structinit.utils.state",
])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, extraglobs={"structinit": structinit, "torch": torch, **vars(mod)},
                             optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
