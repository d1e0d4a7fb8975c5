#!/usr/bin/env bash
# Create .venv-zoo (if missing): torch 2.14.1 with the public ViT packages (timm, torchvision,
# vit-pytorch, open-clip-torch, transformers, x-transformers) pinned by ci/zoo-constraints.txt, and structinit
# editable with its harness and dev extras. Idempotent; the main .venv is not touched. pip runs
# with --no-compile, as in scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-zoo/bin/python ] || "$PY" -m venv .venv-zoo
PIP=(.venv-zoo/bin/python -m pip install -q --no-compile --disable-pip-version-check -c ci/zoo-constraints.txt)
"${PIP[@]}" torch==2.14.1 torchvision timm vit-pytorch open-clip-torch transformers x-transformers
"${PIP[@]}" -e ".[harness,dev]"
