#!/usr/bin/env bash
# Cut what a GPU draw needs on the device into parts that each travel with one call of the
# device tool (a call carries the working tree and at most 64 MiB in all): CIFAR-10's
# cifar-10-batches-py (176 MiB: three parts), and optionally a stopped run to resume there (its
# checkpoint, as scripts/gpu_draw.sh brought it back in pieces: one part more).
#
#   bash scripts/gpu_parts.sh                      # CIFAR-10 from $DATA, into .gpu_parts/part1 … part3
#   RESUME=<folder> bash scripts/gpu_parts.sh      # and the run that <folder> holds (checkpoint.pt.* pieces,
#                                                  # checkpoint.md5 and metrics.jsonl, as gpu_draw.sh wrote them)
#
# Each part folder holds one piece of the payload (a tar) and MD5SUMS, the sums of every piece
# and of the whole tar; gpu_draw.sh's last data call joins the pieces and checks both. The parts
# folder is ignored by git; call K of a draw names .gpu_parts/partK in the device tool's carry.
#
# Environment (all optional):
#   DATA        the folder that holds cifar-10-batches-py (default ../shared/datasets)
#   PARTS       where the parts go (default .gpu_parts; emptied first)
#   PART_BYTES  the largest piece (default: 64 MiB less what else a call carries, the checkout's
#               tracked and untracked files and half a MiB; the pieces are then cut even)
#   RESUME      a folder with a run's checkpoint pieces to resume on the device
#   PY          the python that reads that checkpoint (default .venv/bin/python)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DATA=${DATA:-$ROOT/../shared/datasets}
PARTS=${PARTS:-$ROOT/.gpu_parts}
LIMIT=$((64 * 1024 * 1024))
if [ -z "${PART_BYTES:-}" ]; then
    CHECKOUT=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
    PART_BYTES=$((LIMIT - CHECKOUT - 512 * 1024))
fi
RESUME=${RESUME:-}
PY=${PY:-$ROOT/.venv/bin/python}  # reads the checkpoint to resume (needs torch)

if [ ! -f "$DATA/cifar-10-batches-py/data_batch_1" ]; then
    echo "error: DATA=$DATA: no cifar-10-batches-py/data_batch_1 there; set DATA to the folder that holds CIFAR-10" >&2
    exit 1
fi
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/payload"
cp -r "$DATA/cifar-10-batches-py" "$STAGE/payload/"
if [ -n "$RESUME" ]; then
    # The pieces a draw brought back, joined and checked against the sum taken on the device.
    shopt -s nullglob
    pieces=("$RESUME"/checkpoint.pt.*)
    shopt -u nullglob
    if [ "${#pieces[@]}" = 0 ] || [ ! -f "$RESUME/checkpoint.md5" ]; then
        echo "error: RESUME=$RESUME: expected checkpoint.pt.00, .01, … and checkpoint.md5 there (what" \
             "scripts/gpu_draw.sh leaves under \$OUT when its run is not finished)" >&2
        exit 1
    fi
    mkdir -p "$STAGE/payload/resume"
    cat "${pieces[@]}" >"$STAGE/payload/resume/checkpoint.pt"
    want=$(cut -d' ' -f1 "$RESUME/checkpoint.md5")
    got=$(md5sum "$STAGE/payload/resume/checkpoint.pt" | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
        echo "error: RESUME=$RESUME: the joined checkpoint's md5 is $got, the device's was $want: a piece is" \
             "missing or damaged" >&2
        exit 1
    fi
    [ -f "$RESUME/metrics.jsonl" ] && cp "$RESUME/metrics.jsonl" "$STAGE/payload/resume/"
    # What the device checks in the first call, before the draw spends its minutes: the run's
    # config, epoch and the fingerprint of its initial weights (a torch build or CPU whose
    # arithmetic differs makes other initial weights, and the run cannot resume there).
    "$PY" - "$STAGE/payload/resume/checkpoint.pt" >"$STAGE/resume.json" <<'EOF'
import json
import sys

import torch

state = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
print(json.dumps({"config": state["config"], "epoch": state["epoch"], "init_fingerprint": state["init_fingerprint"]}))
EOF
fi
tar -C "$STAGE/payload" -cf "$STAGE/payload.tar" .
rm -rf "$PARTS"
mkdir -p "$PARTS"
TOTAL=$(stat -c %s "$STAGE/payload.tar")
COUNT=$(((TOTAL + PART_BYTES - 1) / PART_BYTES))
split -b $(((TOTAL + COUNT - 1) / COUNT)) -d -a 2 "$STAGE/payload.tar" "$STAGE/payload.tar."  # even pieces
(cd "$STAGE" && md5sum payload.tar payload.tar.[0-9]*) >"$STAGE/MD5SUMS"
k=0
for piece in "$STAGE"/payload.tar.[0-9]*; do
    k=$((k + 1))
    mkdir -p "$PARTS/part$k"
    mv "$piece" "$PARTS/part$k/"
    cp "$STAGE/MD5SUMS" "$PARTS/part$k/"
    [ -f "$STAGE/resume.json" ] && cp "$STAGE/resume.json" "$PARTS/part$k/"
done
echo "$k parts in $PARTS ($(du -sh "$STAGE/payload.tar" | cut -f1) in all$([ -n "$RESUME" ] && echo ", with the run in $RESUME")):"
for part in "$PARTS"/part*; do
    echo "  $(basename "$part"): $(du -sh "$part" | cut -f1)"
done
echo "call K of the draw: carry [\".gpu_parts/partK\"], command: bash scripts/gpu_draw.sh K $k"
