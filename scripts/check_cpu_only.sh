#!/usr/bin/env bash
# Fail if a CUDA build of torch dragged in nvidia-*, triton or cuda-* packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if .venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|triton|cuda-)'; then
    echo "error: CUDA packages were installed; torch must come from the CPU wheel (ci/constraints.txt)" >&2
    exit 1
fi
