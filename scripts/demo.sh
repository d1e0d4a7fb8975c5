#!/usr/bin/env bash
# Set everything up and run the main job (for now: the init fidelity demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m structinit demo "$@"
