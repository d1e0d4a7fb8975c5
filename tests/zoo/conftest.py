"""The zoo tests need the zoo venv (``bash scripts/test_zoo.sh``); each test module skips
without its packages (``zoo.require_packages``), so the main venv never fails on them. The
catalogue lives in ``bench/zoo.py``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
