#!/usr/bin/env bash
# What to run first on a machine with a GPU (after `bash scripts/setup.sh`), in under 10 minutes
# on an H100: the device; the tests that need CUDA; 2-epoch paper-cifar runs in bf16, eager and
# with torch.compile, through the CLI (images/s per epoch and the final accuracy); and a
# throughput table (bench/gpu_throughput.py: images/s, FLOPs, TFLOP/s, share of the bf16 peak).
# Everything it writes goes under $OUT (default runs/gpu_check): one log per step, device.txt,
# paper-cifar.md, throughput.md (and .json), and summary.md.
#
# Without CUDA it says so and skips what needs it, and measures a tiny CPU throughput instead.
# Every step runs even when one before it failed; the exit status is 1 when any step failed.
#
# Environment (all optional):
#   OUT                 where results go (default runs/gpu_check)
#   DATA                the folder holding cifar-10-batches-py (default ../shared/datasets)
#   GPU_CHECK_QUICK=1   small sizes: a smoke run of the script itself in seconds
#   GPU_CHECK_ONLY      the steps to run, comma-separated (default all: device,cuda-tests,paper-cifar,
#                       throughput); the device is always recorded
#   GPU_CHECK_DEVICE    auto (default: cuda when torch sees it), cuda (fail without it), or cpu
#   GPU_CHECK_EPOCHS    paper-cifar epochs (2; 1 with QUICK)
#   GPU_CHECK_MODELS, GPU_CHECK_STEPS, GPU_CHECK_WARMUP, GPU_CHECK_COMPILE (1/0), GPU_CHECK_PIPELINE
#                       bench/gpu_throughput.py's --models, --steps, --warmup, --pipeline (on CUDA,
#                       default flip,ra2-9-0.5: paper-cifar's augmentation), and whether it
#                       compiles (on CUDA: its default models, 20, 3, 1; on the CPU or with QUICK:
#                       vit_micro_patch2_16, 2 or 3 steps, 1, 0)
#   GPU_CHECK_PYTHON    the interpreter, a path or a command on PATH (default .venv/bin/python); this
#                       checkout goes on PYTHONPATH, so it needs torch but not structinit installed
#   GPU_CHECK_LIMIT_{DEVICE,TESTS,TRAIN,TRAIN_COMPILE,BENCH}
#                       each step's time limit in seconds (40, 80, 120, 150, 170: 560 in all); the
#                       throughput step starts no new cell after its limit less 75 s
set -uo pipefail  # no -e: a failed step is recorded and the next one runs
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/runs/gpu_check}
DATA=${DATA:-$ROOT/../shared/datasets}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
DATA=$(cd "$DATA" 2>/dev/null && pwd || echo "$DATA")
cd "$ROOT" || exit 1
PY=${GPU_CHECK_PYTHON:-.venv/bin/python}
QUICK=${GPU_CHECK_QUICK:-0}
ONLY=${GPU_CHECK_ONLY:-device,cuda-tests,paper-cifar,throughput}
for step in ${ONLY//,/ }; do
    case $step in
        device|cuda-tests|paper-cifar|throughput) ;;
        *) echo "error: GPU_CHECK_ONLY=$ONLY: unknown step '$step'; choose from device,cuda-tests,paper-cifar,throughput" >&2
           exit 2 ;;
    esac
done
wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
WANT=${GPU_CHECK_DEVICE:-auto}
# Limits per step (seconds): together under 10 minutes, whatever hangs.
LIMIT_DEVICE=${GPU_CHECK_LIMIT_DEVICE:-40} LIMIT_TESTS=${GPU_CHECK_LIMIT_TESTS:-80}
LIMIT_TRAIN=${GPU_CHECK_LIMIT_TRAIN:-120} LIMIT_TRAIN_COMPILE=${GPU_CHECK_LIMIT_TRAIN_COMPILE:-150}
LIMIT_BENCH=${GPU_CHECK_LIMIT_BENCH:-170}

declare -a ROWS=() FAILED=()
record() {  # record STEP STATUS SECONDS NOTE: one row of summary.md
    ROWS+=("| $1 | $2 | $3 | $4 |")
    if [ "$2" = failed ]; then FAILED+=("$1"); fi
}
fail_after() {  # fail_after STEP NOTE: the step that just ran exited 0, but its output shows a failure
    echo "FAILED $1: $2"
    unset 'ROWS[-1]'
    record "$1" failed – "$2; log: $1.log"
}
skip() {  # skip STEP REASON
    echo "SKIPPED $1: $2"
    record "$1" skipped – "$2"
}
run_step() {  # run_step STEP LIMIT CMD…: CMD's output to the terminal and $OUT/STEP.log, within LIMIT s
    local name=$1 limit=$2 start=$SECONDS rc note
    shift 2
    echo
    echo "== $name"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    note="log: $name.log"
    case $rc in
        0) record "$name" ok $((SECONDS - start)) "$note" ;;
        124|137) echo "FAILED $name: stopped after its limit of $limit s"
                 record "$name" failed $((SECONDS - start)) "timed out after $limit s; $note" ;;
        *) echo "FAILED $name: exit status $rc"
           record "$name" failed $((SECONDS - start)) "exit status $rc; $note" ;;
    esac
    return "$rc"
}

# The interpreter may be a path or a command on PATH (a GPU image's own python3, say).
if ! PY_FOUND=$(command -v "$PY"); then
    echo "error: GPU_CHECK_PYTHON=$PY: no such interpreter (a path or a command on PATH); run bash scripts/setup.sh" \
         "first (on a GPU host it installs the CUDA build of torch), or name the python that holds torch" >&2
    exit 1
fi
PY=$PY_FOUND
# Every step imports this checkout's structinit, installed or not (bench/ scripts import it as a package).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ------------------------------------------------------------------ 1. the device
GPU_LISTED=""
if command -v nvidia-smi >/dev/null 2>&1; then
    GPU_LISTED=$(nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)
fi
device_info() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi || true
    else
        echo "nvidia-smi: not on PATH"
    fi
    "$PY" - <<'EOF'
import platform

import torch

import structinit

print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"structinit {structinit.__version__}")
print(f"torch.cuda.is_available(): {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    major, minor = torch.cuda.get_device_capability(i)
    memory = torch.cuda.get_device_properties(i).total_memory / 2**30
    print(f"cuda:{i}: {torch.cuda.get_device_name(i)}, compute capability {major}.{minor}, {memory:.1f} GiB, "
          f"bf16 {torch.cuda.is_bf16_supported()}, cuDNN {torch.backends.cudnn.version()}")
EOF
}
export -f device_info
export PY
run_step device "$LIMIT_DEVICE" bash -c device_info && cp "$OUT/device.log" "$OUT/device.txt"

TORCH_CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
CUDA=0 NO_CUDA_WHY=""
case $WANT in
    cpu) NO_CUDA_WHY="GPU_CHECK_DEVICE=cpu" ;;
    auto|cuda)
        if [ "$TORCH_CUDA" = 1 ]; then
            CUDA=1
        else
            NO_CUDA_WHY="torch.cuda.is_available() is False"
            if [ -n "$GPU_LISTED" ] || [ "$WANT" = cuda ]; then
                # A GPU this torch cannot use (a CPU build, or a driver too old for its CUDA) is a failure.
                echo "FAILED cuda: ${GPU_LISTED:-GPU_CHECK_DEVICE=cuda}, but $("$PY" -c 'import torch; print("torch", torch.__version__, "(CUDA build", torch.version.cuda, end=")")') cannot use it; bash scripts/setup.sh installs the CUDA build on a GPU host"
                record cuda failed – "nvidia-smi lists a GPU (or GPU_CHECK_DEVICE=cuda) but torch.cuda.is_available() is False"
            fi
        fi ;;
    *) echo "error: GPU_CHECK_DEVICE=$WANT: expected auto, cuda or cpu" >&2; exit 2 ;;
esac
[ "$CUDA" = 1 ] && echo "CUDA: yes" || echo "CUDA: no ($NO_CUDA_WHY): the steps that need it are skipped"

# ------------------------------------------------------------------ 2. the tests that need CUDA
# Those in the test files that mention cuda whose names say cuda (they skip without it: "needs CUDA").
if ! wanted cuda-tests; then
    skip cuda-tests "not in GPU_CHECK_ONLY"
elif [ "$CUDA" = 1 ]; then
    mapfile -t CUDA_TEST_FILES < <(grep -l -i cuda tests/test_*.py | grep -v 'tests/test_gpu_check.py')
    if [ "${#CUDA_TEST_FILES[@]}" = 0 ]; then
        echo "FAILED cuda-tests: no test file under tests/ mentions cuda"
        record cuda-tests failed – "no test file mentions cuda"
    elif run_step cuda-tests "$LIMIT_TESTS" "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda "${CUDA_TEST_FILES[@]}"; then
        if grep -q "SKIPPED.*CUDA" "$OUT/cuda-tests.log"; then
            fail_after cuda-tests "a test that needs CUDA skipped although torch sees CUDA"
        fi
    fi
else
    skip cuda-tests "needs CUDA ($NO_CUDA_WHY)"
fi

# ------------------------------------------------------------------ 3. paper-cifar, 2 epochs, bf16
EPOCHS=${GPU_CHECK_EPOCHS:-$([ "$QUICK" = 1 ] && echo 1 || echo 2)}
paper_cifar() {  # paper_cifar NAME LIMIT [--compile]
    local name=$1 limit=$2
    shift 2
    rm -rf "${OUT:?}/$name"  # a fresh run, never a resumed or reused one
    run_step "$name" "$limit" "$PY" -m structinit train --recipe paper-cifar --data-dir "$DATA" --epochs "$EPOCHS" \
        --precision bf16 "$@" --init impulse --out "$OUT/$name" --no-progress
    # images/s of every epoch from metrics.jsonl and the final accuracies from result.json, as far as they got
    "$PY" - "$OUT/$name" "$@" >>"$OUT/paper-cifar.md" <<'EOF'
import json
import sys
from pathlib import Path

run, compiled = Path(sys.argv[1]), "--compile" in sys.argv[2:]
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
rates = ", ".join(f"{r['images_per_s']:,.0f}" for r in rows) or "–"
final = json.loads((run / "result.json").read_text())["final"] if (run / "result.json").exists() else {}
accuracy = ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items()) if k.endswith("_acc")) or "no result.json"
wall = f"{rows[-1]['wall_s']:.0f}" if rows else "–"
print(f"| {run.name} | {'yes' if compiled else 'no'} | {len(rows)} | {rates} | {accuracy} | {wall} |")
EOF
    tail -n 1 "$OUT/paper-cifar.md"
}
if ! wanted paper-cifar; then
    skip paper-cifar "not in GPU_CHECK_ONLY"
elif [ "$CUDA" != 1 ]; then
    skip paper-cifar-bf16 "needs CUDA ($NO_CUDA_WHY): the 2-epoch paper-cifar runs are a GPU check"
    skip paper-cifar-bf16-compile "needs CUDA ($NO_CUDA_WHY)"
elif [ ! -f "$DATA/cifar-10-batches-py/data_batch_1" ]; then
    echo "FAILED paper-cifar: CIFAR-10 is not in $DATA/cifar-10-batches-py (set DATA to the folder that holds it)"
    record paper-cifar failed – "no CIFAR-10 under $DATA"
else
    {
        echo "paper-cifar, epochs: $EPOCHS, bf16, init impulse, through the CLI: images/s of each epoch (metrics.jsonl; the"
        echo "first epoch with --compile includes compiling) and the final accuracies (result.json)."
        echo
        echo "| run | torch.compile | epochs done | images/s per epoch | final accuracy | wall s |"
        echo "|---|---|---|---|---|---|"
    } >"$OUT/paper-cifar.md"
    paper_cifar paper-cifar-bf16 "$LIMIT_TRAIN"
    paper_cifar paper-cifar-bf16-compile "$LIMIT_TRAIN_COMPILE" --compile
fi

# ------------------------------------------------------------------ 4. throughput table
if [ "$CUDA" = 1 ] && [ "$QUICK" != 1 ]; then
    BENCH=(--device cuda --models "${GPU_CHECK_MODELS:-vit_tiny_patch2_32,vit_small_patch16_224,vit_base_patch16_224}"
           --steps "${GPU_CHECK_STEPS:-20}" --warmup "${GPU_CHECK_WARMUP:-3}" --budget-s $((LIMIT_BENCH - 75))
           --pipeline "${GPU_CHECK_PIPELINE:-flip,ra2-9-0.5}")  # paper-cifar's whole step too
    COMPILE=${GPU_CHECK_COMPILE:-1}
else
    DEVICE=$([ "$CUDA" = 1 ] && echo cuda || echo cpu)
    [ "$CUDA" = 1 ] || echo "throughput: no CUDA ($NO_CUDA_WHY): a tiny CPU measurement instead, to exercise the script"
    BENCH=(--device "$DEVICE" --models "${GPU_CHECK_MODELS:-vit_micro_patch2_16:$([ "$QUICK" = 1 ] && echo 8 || echo 32)}"
           --steps "${GPU_CHECK_STEPS:-$([ "$QUICK" = 1 ] && echo 2 || echo 3)}" --warmup "${GPU_CHECK_WARMUP:-1}")
    COMPILE=${GPU_CHECK_COMPILE:-0}
fi
[ "$COMPILE" = 1 ] || BENCH+=(--no-compile)
if wanted throughput; then
    run_step throughput "$LIMIT_BENCH" "$PY" bench/gpu_throughput.py "${BENCH[@]}" \
        --out "$OUT/throughput.md" --json "$OUT/throughput.json"
else
    skip throughput "not in GPU_CHECK_ONLY"
fi

# ------------------------------------------------------------------ summary
{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    grep -E '^(python |cuda:0)' "$OUT/device.log" 2>/dev/null || true
    echo
    echo "| step | status | seconds | note |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    for part in paper-cifar throughput; do
        if [ -f "$OUT/$part.md" ]; then
            echo
            echo "## $part"
            echo
            cat "$OUT/$part.md"
        fi
    done
    echo
    if [ "${#FAILED[@]}" = 0 ]; then
        echo "All steps that ran passed."
    else
        echo "FAILED: ${FAILED[*]}"
    fi
} >"$OUT/summary.md"
echo
echo "== summary ($OUT/summary.md)"
cat "$OUT/summary.md"
[ "${#FAILED[@]}" = 0 ]
