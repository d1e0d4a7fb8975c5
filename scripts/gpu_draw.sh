#!/usr/bin/env bash
# One GPU draw, call by call: a paper-cifar run (200 epochs, bf16, torch.compile) whose data
# travel in parts (scripts/gpu_parts.sh), with useful work in every call that carries a part.
#
#   bash scripts/gpu_draw.sh K N     # call K of a draw whose payload has N parts; carry .gpu_parts/partK
#
#   call 1      the device and the tests that need CUDA (scripts/gpu_check.sh's first two steps)
#   call 2      the throughput table (bench/gpu_throughput.py: the harness's step on a fixed batch, and
#               with its own batches, augmented on the device or on the CPU ahead of the step); with
#               GPU_DRAW_CONCURRENCY=1 also what 2 and 4 concurrent processes give in all, against one
#   call N      joins the parts and checks their md5 sums, unpacks CIFAR-10 into .gpu_data (and the run
#               to resume, if the payload has one), starts the run in its own session so that it trains
#               on between calls, and watches it
#   call > N    watches the run; if it is not running (a fresh machine, or it was stopped), resumes it
#               from its checkpoint
#
# What comes back is under $OUT, at most 8 files: draw.md (what this call did), the run's
# metrics.jsonl, copied every GPU_DRAW_POLL seconds so that it returns even when the time runs
# out, and result.json once it is finished. A finished run also sends model.safetensors in
# pieces (model.safetensors.00, …, and model.md5). An unfinished one, with GPU_DRAW_KEEP=1 (the
# last call of a draw), sends its checkpoint in pieces (checkpoint.pt.00, …, checkpoint.md5):
# RESUME=<that folder> bash scripts/gpu_parts.sh puts it in the next draw's payload.
#
# Environment (all optional):
#   OUT                 what comes back (default runs/gpu_draw/out)
#   GPU_DRAW_PYTHON     the interpreter with torch (default python3: a GPU image's own)
#   GPU_DRAW_INIT       the init of the run (default: the resumed run's where the payload holds one,
#                       else impulse); past N it may name another, to start the next run
#   GPU_DRAW_SECONDS    how long a call watches the run before it returns (default 540)
#   GPU_DRAW_POLL       seconds between copies of metrics.jsonl (default 10)
#   GPU_DRAW_KEEP=1     send the checkpoint of an unfinished run back (the last call of a draw)
#   GPU_DRAW_STOP=1     stop the run when the call returns (its checkpoint is kept)
#   GPU_DRAW_CARRY_ONLY=1  calls before N only carry their part: a draw that resumes a run needs
#                       its minutes for training
#   GPU_DRAW_QUICK=1    CPU sizes: a micro ViT for 3 epochs of batch 16 in fp32, tiny benchmarks
#   GPU_DRAW_TRAIN_ARGS more arguments of `structinit train` (they must be the same in every call)
#   GPU_DRAW_PARTS, GPU_DRAW_WORK, GPU_DRAW_DATA
#                       the parts (.gpu_parts), the working folder (runs/gpu_draw) and the unpacked
#                       data (.gpu_data); the run's folder and data folder are in its checkpoint's
#                       config, so a run resumes only where they are the same
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
if [ $# != 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ && $2 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: bash scripts/gpu_draw.sh K N  (call K of a draw whose payload is N parts, .gpu_parts/part1 … partN)" >&2
    exit 2
fi
K=$1 N=$2
OUT=${OUT:-$ROOT/runs/gpu_draw/out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${GPU_DRAW_PYTHON:-python3}
SECONDS_LIMIT=${GPU_DRAW_SECONDS:-540}
POLL=${GPU_DRAW_POLL:-10}
QUICK=${GPU_DRAW_QUICK:-0}
PARTS=${GPU_DRAW_PARTS:-.gpu_parts}  # where the carried parts land
WORK=${GPU_DRAW_WORK:-runs/gpu_draw} # kept on a warm machine between calls (ignored by git)
DATA_DIR=${GPU_DRAW_DATA:-.gpu_data} # relative, as in the checkpoint's config: the same in every draw
PIECE_BYTES=$((15 * 1024 * 1024))    # files that come back are at most 16 MiB each
mkdir -p "$WORK"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! command -v "$PY" >/dev/null; then
    echo "error: GPU_DRAW_PYTHON=$PY: no such interpreter; name the python that holds torch" >&2
    exit 2
fi
# The run a payload resumes decides the init: its checkpoint only resumes under its own config.
RESUME_JSON=$(find "$PARTS" -maxdepth 2 -name resume.json 2>/dev/null | sort | head -n 1)
RESUMED_INIT=
if [ -n "$RESUME_JSON" ]; then
    RESUMED_INIT=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["config"]["init"])' "$RESUME_JSON")
fi
INIT=${GPU_DRAW_INIT:-${RESUMED_INIT:-impulse}}
if [ -n "$RESUMED_INIT" ] && [ "$INIT" != "$RESUMED_INIT" ] && [ "$K" -le "$N" ]; then
    echo "error: GPU_DRAW_INIT=$INIT, but the payload resumes a run of init $RESUMED_INIT: unset GPU_DRAW_INIT" \
        "(or name $RESUMED_INIT); another init can start past call $N, once that run is finished" >&2
    exit 2
fi
RUN=$WORK/paper-cifar-$INIT          # relative, as in the checkpoint's config: the same in every draw
REPORT=$OUT/draw.md
{
    echo "# GPU draw, call $K of $N ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    echo
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
} >"$REPORT"
say() { echo "$*" | tee -a "$REPORT"; }
FAILED=0

# ------------------------------------------------------------------ this call's part
if [ "$K" -le "$N" ]; then
    if [ ! -f "$PARTS/part$K/MD5SUMS" ]; then
        say "FAILED: $PARTS/part$K is not here: carry it in this call (bash scripts/gpu_parts.sh makes it)"
        exit 1
    fi
    say "part $K of $N is here ($(du -sh "$PARTS/part$K" | cut -f1))"
fi
# A run to resume must start from the same initial weights here: checked in the first call, in
# seconds, before the draw spends its minutes on a run this machine would refuse.
if [ "$K" = 1 ] && [ -f "$PARTS/part1/resume.json" ]; then
    if "$PY" - "$PARTS/part1/resume.json" >>"$REPORT" 2>&1 <<'EOF'
import json
import sys

from structinit.harness.config import ImageConfig
from structinit.harness.run.checkpoint import init_fingerprint
from structinit.harness.run.lifecycle import construct_and_plan
from structinit.harness.tasks.image import ImageTask

saved = json.loads(open(sys.argv[1]).read())
config = {**ImageTask.added_fields, **saved["config"]}
model, plan = construct_and_plan(ImageConfig(**config), {"num_classes": 10, "in_chans": 3, "img_size": 32})
plan.commit()
here = init_fingerprint(model)
print(f"resume check: epoch {saved['epoch']}; initial weights here {here[:12]}…, in the checkpoint "
      f"{saved['init_fingerprint'][:12]}…")
raise SystemExit(0 if here == saved["init_fingerprint"] else 1)
EOF
    then
        say "resume check: the same initial weights here: the run can resume on this machine"
    else
        say "FAILED resume check: this machine makes other initial weights (another torch build or CPU):" \
            "the run cannot resume here; make the parts without RESUME and start the run afresh"
        FAILED=1
    fi
fi

# ------------------------------------------------------------------ the call's own work
if [ -n "${GPU_DRAW_CARRY_ONLY:-}" ] && [ "$K" -lt "$N" ]; then
    say "GPU_DRAW_CARRY_ONLY: this call only carries its part"
elif [ "$K" = 1 ]; then
    say "## call 1: the device and the CUDA tests"
    OUT="$(cd "$WORK" && pwd)/check" GPU_CHECK_ONLY=device,cuda-tests GPU_CHECK_PYTHON=$PY GPU_CHECK_QUICK=$QUICK \
        bash scripts/gpu_check.sh >"$WORK/check.log" 2>&1 || FAILED=1
    cat "$WORK/check/summary.md" >>"$REPORT"
    [ -f "$WORK/check/cuda-tests.log" ] && tail -n 30 "$WORK/check/cuda-tests.log" >"$OUT/cuda-tests.log"
elif [ "$K" = 2 ]; then
    say "## call 2: throughput"
    if [ "$QUICK" = 1 ]; then
        BENCH=(--device cpu --models vit_micro_patch2_16:8 --steps 2 --warmup 1 --no-compile --pipeline flip)
    else
        BENCH=(--device cuda --models vit_tiny_patch2_32 --steps 30 --warmup 3 --pipeline flip,ra2-9-0.5)
    fi
    timeout 240 "$PY" bench/gpu_throughput.py "${BENCH[@]}" --out "$OUT/throughput.md" --json "$OUT/throughput.json" \
        >>"$WORK/throughput.log" 2>&1 || { say "FAILED: the throughput table (log: $WORK/throughput.log)"; FAILED=1; }
    # the same row with the augmentation on the CPU, in a background thread (cpu_prefetch)
    timeout 120 "$PY" bench/gpu_throughput.py "${BENCH[@]}" --pipeline-only --cpu-prefetch 4 \
        --out "$OUT/throughput-cpu-prefetch.md" >>"$WORK/throughput.log" 2>&1 \
        || { say "FAILED: the cpu_prefetch row (log: $WORK/throughput.log)"; FAILED=1; }
    # Measured once (docs/results/data/gpu/h100-concurrency.md: 1.13× for two): GPU_DRAW_CONCURRENCY=1 again.
    if [ -n "${GPU_DRAW_CONCURRENCY:-}" ]; then
        # What concurrent runs give in all: each process warms up (compiling), then all time the same
        # window; the sum of their images/s against one process's (the table's '+ pipeline' row, timed
        # the same way).
        one=$("$PY" -c 'import json, sys; print(next((r["images_per_s"] for r in json.load(open(sys.argv[1]))["rows"]
            if "+ pipeline" in r["mode"] and "images_per_s" in r), ""))' "$OUT/throughput.json" 2>/dev/null)
        {
            echo
            echo "Concurrent processes, each timing the harness's step with its own batches (the '+ pipeline' row):"
            echo
            echo "| processes | images/s each | images/s in all | against one |"
            echo "|---:|---|---:|---:|"
            [ -n "$one" ] && printf '| 1 | %.0f (the table) | %.0f | 1.00× |\n' "$one" "$one"
        } >"$OUT/concurrency.md"
        for procs in 2 4; do
            dir=$(mktemp -d)
            for i in $(seq "$procs"); do
                timeout 200 "$PY" bench/gpu_throughput.py "${BENCH[@]}" --pipeline-only --start-file "$dir/go" \
                    --json "$dir/rows$i.json" >"$dir/log$i" 2>&1 &
            done
            for _ in $(seq 1800); do  # all warm (or exited), then the window opens
                ready=$(find "$dir" -name 'go.ready.*' | wc -l)
                [ "$ready" -ge "$procs" ] || [ -z "$(jobs -pr)" ] && break
                sleep 0.1
            done
            touch "$dir/go"
            wait
            # one row of the table; prints the total images/s (nothing when a process measured nothing)
            total=$("$PY" - "$dir" "$procs" "${one:-0}" "$OUT/concurrency.md" <<'EOF'
import json
import sys
from pathlib import Path

folder, procs, one, table = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4])
rates = []
for path in sorted(folder.glob("rows*.json")):
    rates += [r["images_per_s"] for r in json.loads(path.read_text())["rows"] if "images_per_s" in r]
with table.open("a") as f:
    if len(rates) != procs:
        f.write(f"| {procs} | {len(rates)} of {procs} measured | – | – |\n")
    else:
        total = sum(rates)
        ratio = f"{total / one:.2f}×" if one else "–"
        f.write(f"| {procs} | {', '.join(f'{r:,.0f}' for r in rates)} | {total:,.0f} | {ratio} |\n")
        print(total)
EOF
    )
            rm -rf "$dir"
        done
    fi
    cat "$OUT/throughput.md" "$OUT/throughput-cpu-prefetch.md" "$OUT/concurrency.md" >>"$REPORT" 2>/dev/null
fi

# ------------------------------------------------------------------ the payload, once every part is here
if [ "$K" = "$N" ]; then
    say "## call $K: the payload"
    missing=()
    for k in $(seq "$N"); do
        [ -f "$PARTS/part$k/MD5SUMS" ] || missing+=("$k")
    done
    if [ "${#missing[@]}" != 0 ]; then
        say "FAILED: parts ${missing[*]} are not on this machine (a fresh machine does not keep the earlier calls'" \
            "parts): carry them again, one a call"
        exit 1
    fi
    stage=$WORK/payload
    rm -rf "$stage" && mkdir -p "$stage"
    cp "$PARTS/part1/MD5SUMS" "$stage/"
    for k in $(seq "$N"); do  # in order: part10 sorts before part2
        cat "$PARTS/part$k"/payload.tar.[0-9]* >>"$stage/payload.tar"
        cp "$PARTS/part$k"/payload.tar.[0-9]* "$stage/"
    done
    if ! (cd "$stage" && md5sum --quiet -c MD5SUMS) >>"$REPORT" 2>&1; then
        say "FAILED: the md5 sums of the payload do not match (see above): make the parts again and carry them"
        exit 1
    fi
    say "md5 sums match: $(wc -l <"$stage/MD5SUMS") files"
    rm -rf "$DATA_DIR" && mkdir -p "$DATA_DIR"
    tar -C "$DATA_DIR" -xf "$stage/payload.tar"
    if [ -f "$DATA_DIR/resume/checkpoint.pt" ] && [ ! -f "$RUN/checkpoint.pt" ]; then
        mkdir -p "$RUN"
        mv "$DATA_DIR/resume/checkpoint.pt" "$RUN/checkpoint.pt"
        say "resuming the run from the checkpoint in the payload"
    fi
    rm -rf "$stage" "$DATA_DIR/resume"
fi

# ------------------------------------------------------------------ the run
if [ "$K" -ge "$N" ]; then
    say "## the run: $RUN"
    if [ ! -f "$DATA_DIR/cifar-10-batches-py/data_batch_1" ]; then
        say "FAILED: no CIFAR-10 in $DATA_DIR on this machine (a fresh one): carry the parts again, from call 1"
        exit 1
    fi
    if [ "$QUICK" = 1 ]; then
        TRAIN=(--model vit_cpu_patch4_32 --epochs 3 --batch-size 16 --precision fp32 --set warmup_epochs=1)
        BATCH=16
    else
        TRAIN=(--precision bf16 --compile)
        BATCH=512  # paper-cifar's
    fi
    # shellcheck disable=SC2206  # word splitting of the extra arguments is intended
    TRAIN+=(${GPU_DRAW_TRAIN_ARGS:-})
    alive() { [ -f "$RUN.pid" ] && kill -0 "$(cat "$RUN.pid")" 2>/dev/null; }
    if [ -f "$RUN/result.json" ]; then
        say "the run is finished"
    elif alive; then
        say "the run is training (pid $(cat "$RUN.pid"))"
    else
        say "starting the run$([ -f "$RUN/checkpoint.pt" ] && echo ", resumed from its checkpoint")"
        # its own session: it trains on between calls, while the machine is held
        setsid bash -c 'echo $$ >"$0.pid"; exec "$@"' "$RUN" "$PY" -m structinit train --recipe paper-cifar \
            --data-dir "$DATA_DIR" --init "$INIT" "${TRAIN[@]}" --no-progress --out "$RUN" --resume \
            >>"$RUN.log" 2>&1 </dev/null &
        for _ in $(seq 50); do [ -f "$RUN.pid" ] && break; sleep 0.1; done
    fi
    start=$SECONDS
    while alive && [ $((SECONDS - start)) -lt "$SECONDS_LIMIT" ]; do
        sleep "$POLL"
        [ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$OUT/"
    done
    if [ -n "${GPU_DRAW_STOP:-}" ] && alive; then
        say "stopping the run (its checkpoint is kept)"
        kill -TERM "$(cat "$RUN.pid")"
        for _ in $(seq 600); do alive || break; sleep 0.1; done
    fi
    [ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$OUT/"
    if [ -f "$RUN/result.json" ]; then
        cp "$RUN/result.json" "$OUT/"
        split -b "$PIECE_BYTES" -d -a 2 "$RUN/model.safetensors" "$OUT/model.safetensors."
        md5sum "$RUN/model.safetensors" >"$OUT/model.md5"
    elif [ -n "${GPU_DRAW_KEEP:-}" ] && [ -f "$RUN/checkpoint.pt" ]; then
        cp "$RUN/checkpoint.pt" "$WORK/checkpoint.copy"  # one consistent file: the run may replace its own
        split -b "$PIECE_BYTES" -d -a 2 "$WORK/checkpoint.copy" "$OUT/checkpoint.pt."
        md5sum "$WORK/checkpoint.copy" >"$OUT/checkpoint.md5"
        rm -f "$WORK/checkpoint.copy"
        say "the checkpoint is under \$OUT in pieces: RESUME=<that folder> bash scripts/gpu_parts.sh"
    fi
    "$PY" - "$RUN" "$BATCH" <<'EOF' | tee -a "$REPORT"
import json
import statistics
import sys
from pathlib import Path

run, batch = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
    if (run / "metrics.jsonl").exists() else []
if not rows:
    print("no epoch finished yet")
    raise SystemExit
last = rows[-1]
rates = [r["images_per_s"] for r in rows[1:]] or [rows[0]["images_per_s"]]  # the first epoch compiles
print(f"epochs done: {last['epoch']}, wall {last['wall_s'] / 60:.1f} min; training images/s (median of the epochs "
      f"after the first) {statistics.median(rates):,.0f}; in all, evaluation and checkpoints included, "
      f"{last['step'] * batch / last['wall_s']:,.0f}")
print("last row: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.endswith("_acc")))
if (run / "result.json").exists():
    print("finished: " + json.dumps(json.loads((run / "result.json").read_text())["final"]))
EOF
    tail -n 5 "$RUN.log" >>"$REPORT" 2>/dev/null
fi
exit "$FAILED"
