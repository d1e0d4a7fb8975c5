#!/usr/bin/env bash
# Set up .venv-zoo and run the zoo tests: structinit's inits on ViTs built by timm, torchvision,
# vit-pytorch, open_clip and transformers, with no hints (tests/zoo, outside the main suite).
set -euo pipefail
cd "$(dirname "$0")/.."
# The setup scripts install without compiling bytecode (pip --no-compile: minutes on 2 cores);
# each module is compiled once, when first imported, so writing bytecode must be on here.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_zoo.sh
# two workers, one torch thread each, as in scripts/test.sh
.venv-zoo/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist load tests/zoo "$@"
