"""Golden fingerprints of every registered init scheme: seed-0 weights on small models must
match the stored reference (``tests/golden/scheme_weights.json``), so a silent change of a
scheme's defaults (a constant, a scale, the order of random draws) fails here, naming the case,
the tensor and the statistic. Float noise across machines and thread counts does not (see
:mod:`golden_helpers`).

After an intended change, regenerate the reference, review its diff and commit it::

    OMP_NUM_THREADS=1 .venv/bin/python tests/test_golden_weights.py --regenerate
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import structinit
from golden_helpers import (
    CASES,
    MODEL_SEED,
    differences,
    expected_scheme,
    failure,
    fingerprints,
    load,
    regenerate,
    scheme_weights,
)
from structinit.schemes.registry import TARGETS


@pytest.fixture(scope="module")
def golden() -> dict:
    return load()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_scheme_weights_match_the_golden_fingerprints(case, golden):
    assert case.id in golden["schemes"], f"no reference for case {case.id!r}; regenerate the golden file"
    diffs = differences(expected_scheme(golden, case), fingerprints(scheme_weights(case)))
    assert not diffs, failure("scheme case", f"{case.id}: init_({case.model}, {case.scheme!r}, {case.options})", diffs)


# The CPU code paths a machine can take: MKL's instruction sets and ATen's vectorised kernels.
# A machine with another CPU takes another path; each of these does on this machine.
CODE_PATHS = {
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
}


@pytest.mark.parametrize("path", CODE_PATHS)
def test_the_golden_fingerprints_hold_on_every_cpu_code_path(path):
    """The same seed gives the same weights whatever BLAS, LAPACK and vector kernels compute
    them: the fingerprints above, in a fresh process on another code path."""
    env = {**os.environ, **CODE_PATHS[path]}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "match_the_golden_fingerprints or runs_on_the_code_path"], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{path} ({CODE_PATHS[path]}):\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    assert f"{len(CASES) + 1} passed" in done.stdout, done.stdout[-2000:]


def test_this_process_runs_on_the_code_path_asked_for():
    # What makes the test above able to fail: its processes really take the other path.
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"


def test_every_registered_scheme_has_a_golden_case(golden):
    """A newly registered scheme (or one registered for a new target) needs a case here."""
    covered = {(c.scheme, c.target) for c in CASES}
    registered = {(name, target) for target in TARGETS for name in structinit.schemes(target)}
    assert registered <= covered, f"schemes without a golden case: {sorted(registered - covered)}"
    assert set(golden["schemes"]) == {c.id for c in CASES}, "the golden file's cases differ from CASES: regenerate"


def test_a_changed_default_is_reported_by_scheme_tensor_and_statistic(golden):
    """The comparison itself: mimetic with another alpha than its default is caught, and the
    message names the case, the tensor and the statistic."""
    case = next(c for c in CASES if c.id == "vit/mimetic")
    torch.manual_seed(MODEL_SEED)
    model = structinit.create_model(case.model)
    structinit.init_(model, "mimetic", seed=0, alpha=0.69)
    diffs = differences(expected_scheme(golden, case), fingerprints(model.state_dict()))
    assert any(d.startswith("blocks.0.attn.qkv.weight: sum_sq expected") for d in diffs), diffs
    assert "'vit/mimetic" in failure("scheme case", case.id, diffs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regenerate", action="store_true", help="recompute and write the golden file")
    if parser.parse_args().regenerate:
        regenerate()
    else:
        parser.print_help()
