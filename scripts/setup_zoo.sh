#!/usr/bin/env bash
# Create .venv-zoo (if missing): torch 2.14.1 with the public ViT packages (timm, torchvision,
# vit-pytorch, open-clip-torch, transformers, x-transformers) pinned by ci/zoo-constraints.txt, and structinit
# editable with its harness and dev extras. Idempotent; the main .venv is not touched. pip runs
# with --no-compile, as in scripts/setup.sh. A venv this script finished with the same pins, extras
# and script is left as it is (pip would take 20 s to say so); delete .venv-zoo/.setup-done to
# install again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv-zoo/.setup-done
WANT=$(cat ci/zoo-constraints.txt pyproject.toml scripts/setup_zoo.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv-zoo/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
    echo "setup_zoo: .venv-zoo is installed with these pins (delete $STAMP to install again)"
    exit 0
fi
[ -x .venv-zoo/bin/python ] || "$PY" -m venv .venv-zoo
rm -f "$STAMP"
PIP=(.venv-zoo/bin/python -m pip install -q --no-compile --disable-pip-version-check -c ci/zoo-constraints.txt)
"${PIP[@]}" torch==2.14.1 torchvision timm vit-pytorch open-clip-torch transformers x-transformers
"${PIP[@]}" -e ".[harness,dev]"
echo "$WANT" >"$STAMP"
