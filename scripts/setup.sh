#!/usr/bin/env bash
# Create .venv (if missing) and install structinit with pinned dependencies (extras harness, dev
# and docs). Idempotent. It ends by saying which torch it installed (CPU or CUDA build) and how
# much disk it takes.
#
# torch is pinned to 2.13.0 (ci/constraints.txt). Which build that is depends on where pip looks:
# the public package index gives the CUDA build for Linux x86-64 (with its nvidia-* packages,
# several GB); STRUCTINIT_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU-only
# build from PyTorch's own index instead (a 190 MB download, 0.75 GB installed). Either runs the tests.
# On a machine with a GPU (`nvidia-smi -L` lists one, or STRUCTINIT_CUDA=1; STRUCTINIT_CUDA=0
# forces the default) torch is the CUDA build 2.14.1 instead, with ci/constraints.txt's other
# pins. Then: bash scripts/gpu_check.sh.
#
# pip runs with --no-compile: compiling every module of torch and the rest at install takes
# minutes on 2 cores, and Python compiles the few it imports on first use (unless
# PYTHONDONTWRITEBYTECODE is set; scripts/test.sh unsets it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CUDA_TORCH=2.14.1
GPU_WHY="STRUCTINIT_CUDA=${STRUCTINIT_CUDA:-}"
if [ -z "${STRUCTINIT_CUDA:-}" ]; then
    STRUCTINIT_CUDA=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        GPU_WHY=$(nvidia-smi -L 2>/dev/null | grep '^GPU ' | head -n 1 || true)
        [ -z "$GPU_WHY" ] || STRUCTINIT_CUDA=1
    fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ "$STRUCTINIT_CUDA" = 1 ]; then
    # ci/constraints.txt pins the CPU torch (2.13.0): the same pins with torch at the CUDA build.
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    sed "s/^torch==.*/torch==$CUDA_TORCH/" ci/constraints.txt >"$constraints"
    .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c "$constraints" "torch==$CUDA_TORCH"
    .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c "$constraints" -e ".[harness,dev,docs]"
    echo "setup: GPU host ($GPU_WHY): installed torch==$CUDA_TORCH, a CUDA build, with ci/constraints.txt's" \
        "other pins"
    .venv/bin/python -c 'import torch; ok = torch.cuda.is_available(); print(f"setup: torch {torch.__version__},",
        f"CUDA {torch.version.cuda}, torch.cuda.is_available() {ok}" + ("" if ok else
        ": torch cannot use the GPU (is the driver new enough for this CUDA? see nvidia-smi)"))'
    exit 0
fi
INDEX=()
[ -z "${STRUCTINIT_TORCH_INDEX:-}" ] || INDEX=(--index-url "$STRUCTINIT_TORCH_INDEX")
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c ci/constraints.txt "${INDEX[@]}" torch==2.13.0
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c ci/constraints.txt -e ".[harness,dev,docs]"
# Which torch this is, and what it costs on disk (torch with the CUDA libraries it brought).
.venv/bin/python - <<'PY'
import importlib.metadata as md
from pathlib import Path

import torch

site = Path(torch.__file__).parents[1]
parts = [site / "torch"] + [p for p in site.iterdir() if p.name.startswith(("nvidia", "triton", "cuda"))
                              and p.is_dir() and not p.name.endswith("-info")]
size = sum(f.stat().st_size for part in parts for f in part.rglob("*") if f.is_file()) / 2**30
build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "the CPU-only build"
extra = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith(("nvidia-", "triton"))]
print(f"setup: torch {torch.__version__}, {build}, {size:.1f} GiB installed"
      + (f" (with {len(extra)} nvidia/triton packages)" if extra else ""))
if torch.version.cuda:
    print("setup: for a CPU-only torch (0.75 GB installed): "
          "rm -rf .venv && STRUCTINIT_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh")
PY
