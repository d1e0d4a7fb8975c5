"""The documentation's examples that need a zoo package (timm, torchvision, vit-pytorch,
open_clip) run as written here, in the zoo venv; the main suite skips them
(``tests/test_docs_examples.py``)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helper
from docs_examples import examples, missing_packages, run_example

ZOO_EXAMPLES = [e for e in examples() if e.packages() and not e.skip]


def test_the_docs_have_zoo_examples():
    assert ZOO_EXAMPLES


@pytest.mark.parametrize("example", ZOO_EXAMPLES, ids=[e.name for e in ZOO_EXAMPLES])
def test_zoo_example_runs(example, tmp_path):
    missing = missing_packages(example)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: run it in the zoo venv (bash scripts/test_zoo.sh)")
    run_example(example, tmp_path)
