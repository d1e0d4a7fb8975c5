#!/usr/bin/env bash
# Create .venv (if missing) and install structinit with pinned dependencies (extras harness, dev
# and docs). Idempotent.
# On a machine with a GPU (`nvidia-smi -L` lists one, or STRUCTINIT_CUDA=1; STRUCTINIT_CUDA=0
# forces the CPU install) torch is the CUDA build 2.14.1 instead of the CPU wheel 2.13.0, with
# ci/constraints.txt's other pins, and check_cpu_only.sh is skipped. Then: bash scripts/gpu_check.sh.
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
    .venv/bin/python -m pip install -q --disable-pip-version-check -c "$constraints" "torch==$CUDA_TORCH"
    .venv/bin/python -m pip install -q --disable-pip-version-check -c "$constraints" -e ".[harness,dev,docs]"
    echo "setup: GPU host ($GPU_WHY): installed torch==$CUDA_TORCH, a CUDA build, with ci/constraints.txt's" \
        "other pins; skipped check_cpu_only.sh (it refuses CUDA packages)"
    .venv/bin/python -c 'import torch; ok = torch.cuda.is_available(); print(f"setup: torch {torch.__version__},",
        f"CUDA {torch.version.cuda}, torch.cuda.is_available() {ok}" + ("" if ok else
        ": torch cannot use the GPU (is the driver new enough for this CUDA? see nvidia-smi)"))'
    exit 0
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c ci/constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c ci/constraints.txt -e ".[harness,dev,docs]"
bash scripts/check_cpu_only.sh
