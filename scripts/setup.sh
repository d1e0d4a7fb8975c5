#!/usr/bin/env bash
# Create .venv (if missing) and install structinit with pinned dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c ci/constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c ci/constraints.txt -e ".[dev]"
# A CUDA build of torch would drag these in; the CPU pin must have kept them out.
if .venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|triton|cuda-)'; then
    echo "error: CUDA packages were installed; torch must come from the CPU wheel (ci/constraints.txt)" >&2
    exit 1
fi
