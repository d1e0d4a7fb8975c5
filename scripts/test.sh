#!/usr/bin/env bash
# Set everything up, lint, build the documentation site (mkdocs --strict: a broken link, page or
# docstring fails), and run the test suite (slow tests excluded; add -m slow to run them).
set -euo pipefail
cd "$(dirname "$0")/.."
# The setup scripts install without compiling bytecode (pip --no-compile: minutes on 2 cores);
# each module is compiled once, when first imported, so writing bytecode must be on here.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
.venv/bin/ruff check structinit tests bench
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"  # not --quiet: it hides warnings from --strict
# tests/test_docs_render.py reads the site just built rather than building it again
# Two workers (pytest-xdist), one torch thread each (tests/conftest.py): most of a test's time is
# one Python thread (starting processes, importing torch), so one worker per core nearly halves
# the run. --dist load hands out single tests, so no long file holds a worker at the end.
STRUCTINIT_DOCS_SITE="$site" .venv/bin/python -m pytest -q -n 2 --dist load "$@"
