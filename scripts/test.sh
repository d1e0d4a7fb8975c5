#!/usr/bin/env bash
# Set everything up, lint, and run the test suite (slow tests excluded; add -m slow to run them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check structinit tests bench
.venv/bin/python -m pytest -q "$@"
