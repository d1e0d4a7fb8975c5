#!/usr/bin/env bash
# One GPU draw, call by call: the paper-cifar column (200 epochs each, bf16, torch.compile,
# augmentation in worker processes), whose data travel in parts (scripts/gpu_parts.sh), with useful
# work in every call that carries a part.
#
#   bash scripts/gpu_draw.sh K N     # call K of a draw whose payload has N parts; carry .gpu_parts/partK
#
#   call 1, 2   the jobs of GPU_DRAW_JOBS, one a call (default: tests, then throughput):
#               tests       the device and the tests that need CUDA (scripts/gpu_check.sh's first two steps)
#               throughput  the throughput table (bench/gpu_throughput.py: the harness's step on a fixed
#                           batch, with its own batches augmented on the device or in 8 worker processes,
#                           and as CUDA graphs)
#   call N      joins the parts and checks their md5 sums, unpacks CIFAR-10 into .gpu_data (and the run
#               to resume, if the payload has one), starts the run in its own session so that it trains
#               on between calls, and watches it
#   call > N    watches the run; if it is not running (a fresh machine, or it was stopped), resumes it
#               from its checkpoint
#
# The runs follow the column, GPU_DRAW_COLUMN: a payload's run to resume first, else the first init
# with no finished run on this machine. When a run finishes with GPU_DRAW_NEXT_MIN_S or more left in
# the call, the next init of the column starts, and the call watches it.
#
# What comes back is under $OUT, at most 8 files: draw.md (what this call did) and runs.tar, each
# watched run's metrics.jsonl and result.json (once finished) under its folder's name, packed every
# GPU_DRAW_POLL seconds so that it returns even when the time runs out. With GPU_DRAW_KEEP=1 (the
# last call of a draw) an unfinished run sends its checkpoint in pieces (checkpoint.pt.00, …,
# checkpoint.md5): RESUME=<that folder> bash scripts/gpu_parts.sh puts it in the next draw's payload.
# With GPU_DRAW_WEIGHTS=1 the finished runs' weights come back too (<run>.safetensors.00, …), as far
# as the limit on what a call returns allows.
#
# Environment (all optional):
#   OUT                 what comes back (default runs/gpu_draw/out)
#   GPU_DRAW_PYTHON     the interpreter with torch (default python3: a GPU image's own)
#   GPU_DRAW_COLUMN     the inits of the column, in order (default: mimetic timm pytorch
#                       impulse:kernel_size=5)
#   GPU_DRAW_INIT       the init of the run (default: the resumed run's where the payload holds one,
#                       else the column's first unfinished); past N it may name another
#   GPU_DRAW_NEXT_MIN_S the least time left in a call to start the column's next init (default 60)
#   GPU_DRAW_JOBS       the jobs of calls 1, 2, … (default "tests throughput"; a call past them only
#                       carries its part)
#   GPU_DRAW_SECONDS    how long a call watches the runs before it returns (default 540)
#   GPU_DRAW_POLL       seconds between packings of runs.tar (default 10)
#   GPU_DRAW_KEEP=1     send the checkpoint of an unfinished run back (the last call of a draw)
#   GPU_DRAW_STOP=1     stop the run when the call returns (its checkpoint is kept)
#   GPU_DRAW_WEIGHTS=1  send the finished runs' weights back, where they fit
#   GPU_DRAW_CARRY_ONLY=1  calls before N only carry their part: a draw that resumes a run needs
#                       its minutes for training
#   GPU_DRAW_QUICK=1    CPU sizes: a small ViT for 3 epochs of batch 16 in fp32, tiny benchmarks
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
PIECE_BYTES=$((16 * 1024 * 1024 - 65536))  # files that come back are at most 16 MiB each
mkdir -p "$WORK"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! command -v "$PY" >/dev/null; then
    echo "error: GPU_DRAW_PYTHON=$PY: no such interpreter; name the python that holds torch" >&2
    exit 2
fi
# The column's inits, in the order its runs are made; each run's folder is named after its init.
COLUMN=${GPU_DRAW_COLUMN:-mimetic timm pytorch impulse:kernel_size=5}
NEXT_MIN_S=${GPU_DRAW_NEXT_MIN_S:-60}
JOBS=${GPU_DRAW_JOBS:-tests throughput}  # the work of the calls that carry a part, one job a call, in order
for job in $JOBS; do
    case $job in
        tests|throughput) ;;
        *) echo "error: GPU_DRAW_JOBS=$JOBS: unknown job '$job'; choose from tests, throughput" >&2; exit 2 ;;
    esac
done
slug() { echo "paper-cifar-$(echo "$1" | sed 's/:/-/; s/[=,]//g')"; }  # impulse:kernel_size=5 → …-impulse-kernel_size5
next_init() {  # the column's first init with no finished run on this machine (none: the column is done)
    for init in $COLUMN; do
        [ -f "$WORK/$(slug "$init")/result.json" ] || { echo "$init"; return; }
    done
}
# The run a payload resumes decides the init: its checkpoint only resumes under its own config.
RESUME_JSON=$(find "$PARTS" -maxdepth 2 -name resume.json 2>/dev/null | sort | head -n 1)
RESUMED_INIT=
if [ -n "$RESUME_JSON" ]; then
    RESUMED_INIT=$("$PY" -c 'import json, sys
c = json.load(open(sys.argv[1]))["config"]
options = ",".join(f"{k}={v}" for k, v in sorted(c.get("init_options", {}).items()))
print(c["init"] + (":" + options if options else ""))' "$RESUME_JSON")
fi
INIT=${GPU_DRAW_INIT:-${RESUMED_INIT:-$(next_init)}}
if [ -n "$RESUMED_INIT" ] && [ "$INIT" != "$RESUMED_INIT" ] && [ "$K" -le "$N" ]; then
    echo "error: GPU_DRAW_INIT=$INIT, but the payload resumes a run of init $RESUMED_INIT: unset GPU_DRAW_INIT" \
        "(or name $RESUMED_INIT); another init can start past call $N, once that run is finished" >&2
    exit 2
fi
RUN=$WORK/$(slug "${INIT:-none}")  # relative, as in the checkpoint's config: the same in every draw
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
JOB=$(echo "$JOBS" | awk -v k="$K" '{ print $k }')  # call K's job: the K-th of GPU_DRAW_JOBS
if [ -n "${GPU_DRAW_CARRY_ONLY:-}" ] && [ "$K" -lt "$N" ]; then
    say "GPU_DRAW_CARRY_ONLY: this call only carries its part"
elif [ "$JOB" = tests ]; then
    say "## call $K: the device and the CUDA tests"
    OUT="$(cd "$WORK" && pwd)/check" GPU_CHECK_ONLY=device,cuda-tests GPU_CHECK_PYTHON=$PY GPU_CHECK_QUICK=$QUICK \
        bash scripts/gpu_check.sh >"$WORK/check.log" 2>&1 || FAILED=1
    cat "$WORK/check/summary.md" >>"$REPORT"
    [ -f "$WORK/check/cuda-tests.log" ] && tail -n 30 "$WORK/check/cuda-tests.log" >"$OUT/cuda-tests.log"
elif [ "$JOB" = throughput ]; then
    say "## call $K: throughput"
    # The step alone, with its batches augmented on the device and in 8 worker processes, then the step
    # as CUDA graphs: one compiled model each, the compiler's cache shared (and kept for the run after).
    if [ "$QUICK" = 1 ]; then
        BENCH=(--device cpu --models vit_micro_patch2_16:8 --steps 2 --warmup 1 --no-compile --pipeline flip
               --aug-workers 0,2)
    else
        BENCH=(--device cuda --models vit_tiny_patch2_32 --steps 50 --warmup 5 --no-eager --pipeline flip,ra2-9-0.5
               --aug-workers 0,8 --compile-modes default,reduce-overhead --budget-s 150)
    fi
    timeout 300 "$PY" bench/gpu_throughput.py "${BENCH[@]}" --out "$OUT/throughput.md" --json "$OUT/throughput.json" \
        >>"$WORK/throughput.log" 2>&1 || { say "FAILED: the throughput table (log: $WORK/throughput.log)"; FAILED=1; }
    cat "$OUT/throughput.md" >>"$REPORT" 2>/dev/null
elif [ "$K" -lt "$N" ]; then
    say "no job for call $K (GPU_DRAW_JOBS=$JOBS): this call only carries its part"
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

# ------------------------------------------------------------------ the runs of the column
if [ "$K" -ge "$N" ]; then
    if [ ! -f "$DATA_DIR/cifar-10-batches-py/data_batch_1" ]; then
        say "FAILED: no CIFAR-10 in $DATA_DIR on this machine (a fresh one): carry the parts again, from call 1"
        exit 1
    fi
    if [ "$QUICK" = 1 ]; then
        TRAIN=(--model vit_cpu_patch4_32 --epochs 3 --batch-size 16 --precision fp32 --set warmup_epochs=1
               --set aug_workers=2)
        BATCH=16
    else
        # bf16, compiled, augmented on the CPU in 8 of the machine's 16 cores
        TRAIN=(--precision bf16 --compile --set aug_workers=8)
        BATCH=512  # paper-cifar's
    fi
    # The shared copy of CIFAR-10 is exact in test images 0–1016 only (the rest are JPEG re-encodings):
    # those are scored every epoch, the whole test set every 10 epochs and at the end.
    TRAIN+=(--set test_prefix=1017 --set test_every=10 --set eval_every=1)
    # shellcheck disable=SC2206  # word splitting of the extra arguments is intended
    TRAIN+=(${GPU_DRAW_TRAIN_ARGS:-})
    alive() { [ -f "$RUN.pid" ] && kill -0 "$(cat "$RUN.pid")" 2>/dev/null; }
    DEADLINE=$((SECONDS + SECONDS_LIMIT))
    WATCHED=()  # the runs this call saw, each once
    pack_small() {  # the watched runs' metrics and results, one small file under $OUT
        local names=()
        for run in "${WATCHED[@]}"; do
            for f in metrics.jsonl result.json; do
                [ -f "$run/$f" ] && names+=("$(basename "$run")/$f")
            done
        done
        if [ "${#names[@]}" != 0 ]; then  # replaced whole: a call cut off returns the last complete one
            tar -C "$WORK" -cf "$OUT/runs.tar.tmp" "${names[@]}" && mv "$OUT/runs.tar.tmp" "$OUT/runs.tar"
        fi
    }
    while [ -n "$INIT" ]; do
        RUN=$WORK/$(slug "$INIT")  # relative, as in the checkpoint's config: the same in every draw
        WATCHED+=("$RUN")
        say "## the run: $RUN (init $INIT)"
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
        while alive && [ "$SECONDS" -lt "$DEADLINE" ]; do
            sleep "$POLL"
            pack_small
        done
        pack_small
        # A finished run leaves the rest of the call to the column's next init.
        NEXT=$(next_init)
        if [ -f "$RUN/result.json" ] && [ -z "$NEXT" ]; then
            say "the column is finished on this machine: $COLUMN"
        elif [ -f "$RUN/result.json" ] && [ $((DEADLINE - SECONDS)) -ge "$NEXT_MIN_S" ]; then
            say "finished; $((DEADLINE - SECONDS)) s left in this call: the column's next init, $NEXT"
            INIT=$NEXT
            continue
        fi
        break
    done
    if [ -z "$INIT" ]; then
        say "the column is finished on this machine: $COLUMN"
    else
        if [ -n "${GPU_DRAW_STOP:-}" ] && alive; then
            say "stopping the run (its checkpoint is kept)"
            kill -TERM "$(cat "$RUN.pid")"
            for _ in $(seq 600); do alive || break; sleep 0.1; done
        fi
        pack_small
        # The big files, as many as come back: the unfinished run's checkpoint (with GPU_DRAW_KEEP), then the
        # finished runs' weights (GPU_DRAW_WEIGHTS=1). At most 8 files of 16 MiB, 64 MiB in all, come back.
        big=()
        if [ -n "${GPU_DRAW_KEEP:-}" ] && [ ! -f "$RUN/result.json" ] && [ -f "$RUN/checkpoint.pt" ]; then
            cp "$RUN/checkpoint.pt" "$WORK/checkpoint.copy"  # one consistent file: the run may replace its own
            big+=("$WORK/checkpoint.copy:checkpoint.pt")
        fi
        if [ "${GPU_DRAW_WEIGHTS:-0}" = 1 ]; then
            for run in "${WATCHED[@]}"; do
                [ -f "$run/result.json" ] && big+=("$run/model.safetensors:$(basename "$run").safetensors")
            done
        fi
        for item in "${big[@]}"; do
            file=${item%%:*} name=${item#*:}
            size=$(stat -c %s "$file")
            pieces=$(((size + PIECE_BYTES - 1) / PIECE_BYTES))
            have=$(find "$OUT" -maxdepth 1 -type f | wc -l)
            used=$(du -cb "$OUT"/* 2>/dev/null | tail -n 1 | cut -f1)
            if [ $((have + pieces + 1)) -gt 8 ] || [ $((used + size + 4096)) -gt $((64 * 1024 * 1024)) ]; then
                say "not sent back: $name ($size bytes in $pieces pieces: over what a call returns)"
                continue
            fi
            split -b "$PIECE_BYTES" -d -a 2 "$file" "$OUT/$name."
            (cd "$(dirname "$file")" && md5sum "$(basename "$file")") | sed "s/ .*/  $name/" >"$OUT/${name%.*}.md5"
            say "$name is under \$OUT in $pieces pieces$([ "$name" = checkpoint.pt ] && echo \
                ": RESUME=<that folder> bash scripts/gpu_parts.sh")"
        done
        rm -f "$WORK/checkpoint.copy"
    fi
    for run in "${WATCHED[@]}"; do
        "$PY" - "$run" "$BATCH" <<'EOF' | tee -a "$REPORT"
import json
import statistics
import sys
from pathlib import Path

run, batch = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
    if (run / "metrics.jsonl").exists() else []
if not rows:
    print(f"{run.name}: no epoch finished yet")
    raise SystemExit
last = rows[-1]
rates = [r["images_per_s"] for r in rows[1:]] or [rows[0]["images_per_s"]]  # the first epoch compiles
print(f"{run.name}: epochs done: {last['epoch']}, wall {last['wall_s'] / 60:.1f} min; training images/s (median of "
      f"the epochs after the first) {statistics.median(rates):,.0f}; in all, evaluation and checkpoints included, "
      f"{last['step'] * batch / last['wall_s']:,.0f}")
print("last row: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.endswith("_acc")))
if (run / "result.json").exists():
    print("finished: " + json.dumps(json.loads((run / "result.json").read_text())["final"]))
EOF
        tail -n 3 "$run.log" >>"$REPORT" 2>/dev/null
    done
fi
exit "$FAILED"
