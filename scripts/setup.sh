#!/usr/bin/env bash
# Create .venv (if missing) and install structinit with pinned dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c ci/constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c ci/constraints.txt -e ".[harness,dev]"
bash scripts/check_cpu_only.sh
