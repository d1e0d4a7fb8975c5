#!/usr/bin/env bash
# Set everything up and run the main job: compare inits (PyTorch default, timm, mimetic, impulse)
# on the embedded digits set, 3 seeds each; writes runs/compare-digits/{summary.md,summary.json,
# accuracy.png,report.html} and prints where the report is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m structinit compare --recipe digits --inits pytorch,timm,mimetic,impulse --seeds 3 \
    --out runs/compare-digits --no-progress "$@"
if [ -f runs/compare-digits/report.html ]; then
    echo "report: $(pwd)/runs/compare-digits/report.html (open it in a web browser)"
fi
