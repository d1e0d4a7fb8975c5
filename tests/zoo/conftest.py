"""The zoo tests need the zoo venv (``bash scripts/test_zoo.sh``); the main suite does not
collect them (``norecursedirs``). The catalogue lives in ``bench/zoo_catalogue.py``."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from zoo_catalogue import PACKAGES  # bench/ is on the path from the line above

# In the zoo venv a missing package is a broken install, not a reason to skip.
missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
if missing:
    pytest.fail(f"the zoo venv lacks {', '.join(missing)}: run bash scripts/setup_zoo.sh (ci/zoo-constraints.txt "
                "pins them); tests/zoo runs only there", pytrace=False)
