"""The README's "Your own model" examples run as written (the timm one where timm imports)."""

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

import structinit

README = Path(__file__).resolve().parents[1] / "README.md"


def _examples() -> list[str]:
    text = README.read_text()
    section = text.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


EXAMPLES = _examples()


def _needs(code: str) -> str | None:
    for module in ("timm", "transformers"):
        if re.search(rf"^(import|from) {module}\b", code, flags=re.M) and importlib.util.find_spec(module) is None:
            return module
    return None


def test_the_section_has_the_four_examples():
    assert len(EXAMPLES) == 4
    assert "transformers" in EXAMPLES[0] and "timm" in EXAMPLES[1] and "register_adapter" in EXAMPLES[3]


@pytest.mark.parametrize("index", range(len(EXAMPLES)), ids=["huggingface", "timm", "hand_written", "register"])
def test_example_runs_and_keeps_the_structure(index, capsys):
    code = EXAMPLES[index]
    missing = _needs(code)
    if missing:
        pytest.skip(f"{missing} is not importable here")
    torch.manual_seed(0)
    scope: dict = {"__name__": f"readme_example_{index}"}
    registered = set(structinit.adapters.ATTENTION_ADAPTERS) | set(structinit.adapters.POSITION_FINDERS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. reserve='auto' finding nothing to reserve
            exec(compile(code, f"README.md example {index}", "exec"), scope)
    finally:  # the register example must not leak its adapter and finder into other tests
        for name in set(structinit.adapters.ATTENTION_ADAPTERS) - registered:
            structinit.adapters.ATTENTION_ADAPTERS.remove(name)
        for name in set(structinit.adapters.POSITION_FINDERS) - registered:
            structinit.adapters.POSITION_FINDERS.remove(name)
    fid = scope["fid"]
    assert bool((fid["hit"] == 1).all()), fid["hit"]
    out = capsys.readouterr().out
    if index == 0:
        assert "TokenLayout(grid=(8, 8), num_prefix_tokens=1)" in out
