"""scripts/gpu_parts.sh and scripts/gpu_draw.sh on the CPU, with GPU_DRAW_QUICK's sizes: the
payload cut into parts and joined with its md5 sums checked, every call's work, a run that
trains on between calls, stops with its checkpoint brought back in pieces, and resumes from
them in the next draw to the same end."""

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fake_cifar10(parent: Path) -> Path:
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def batch(n):
        return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": rng.integers(0, 10, n).tolist()}

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(32), protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(40), protocol=2))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"c%d" % i for i in range(10)]}, protocol=2))
    return parent


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def draw(tmp_path):
    env = {**os.environ, "GPU_DRAW_QUICK": "1", "GPU_DRAW_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_DRAW_PARTS": str(tmp_path / "parts"), "GPU_DRAW_WORK": str(tmp_path / "work"),
           "GPU_DRAW_DATA": str(tmp_path / "data"), "GPU_DRAW_POLL": "1"}

    def parts(**extra) -> int:
        done = subprocess.run(["bash", "scripts/gpu_parts.sh"], cwd=ROOT, capture_output=True, text=True,
                              env={**env, "DATA": str(_fake_cifar10(tmp_path / "cifar")) if not
                                   (tmp_path / "cifar").exists() else str(tmp_path / "cifar"),
                                   "PARTS": env["GPU_DRAW_PARTS"], "PART_BYTES": "350000", "PY": sys.executable,
                                   **extra})
        assert done.returncode == 0, done.stderr
        return len(list((tmp_path / "parts").glob("part*")))

    def call(k: int, n: int, out: str, **extra) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/gpu_draw.sh", str(k), str(n)], cwd=ROOT, capture_output=True,
                              text=True, env={**env, "OUT": str(tmp_path / out), **extra}, timeout=300)

    yield parts, call
    for pid in (tmp_path / "work").glob("*.pid"):  # never leave a training process behind
        try:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _runs(out: Path) -> dict[str, str]:
    """The files of runs.tar under ``out``: {'<run>/<file>': text}."""
    with tarfile.open(out / "runs.tar") as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def _tar_rows(out: Path, run: str) -> list[dict]:
    return [json.loads(line) for line in _runs(out).get(f"{run}/metrics.jsonl", "").splitlines()]


def test_a_draw_stops_brings_its_checkpoint_back_and_the_next_draw_resumes_it(tmp_path, draw):
    parts, call = draw
    column = {"GPU_DRAW_COLUMN": "impulse mimetic", "GPU_DRAW_TRAIN_ARGS": "--epochs 6 --set test_every=4"}
    n = parts()
    assert n == 3 and all((tmp_path / "parts" / f"part{k}" / "MD5SUMS").exists() for k in (1, 2, 3))
    one = call(1, n, "out1")
    assert one.returncode == 0, one.stdout + one.stderr
    assert "| cuda-tests | skipped |" in (tmp_path / "out1" / "draw.md").read_text()
    two = call(2, n, "out2")  # the default jobs: tests, then throughput
    assert two.returncode == 0, two.stdout + two.stderr
    table = (tmp_path / "out2" / "throughput.md").read_text()
    assert "+ pipeline |" in table and "+ pipeline, 2 workers |" in table

    # call 3 joins the parts and starts a 6-epoch run that trains on after the call returns
    three = call(3, n, "out3", GPU_DRAW_SECONDS="0", **column)
    assert three.returncode == 0, three.stdout + three.stderr
    assert "md5 sums match: 4 files" in three.stdout and "starting the run" in three.stdout
    metrics = tmp_path / "work" / "paper-cifar-impulse" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while len(_rows(metrics)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_rows(metrics)) >= 2
    # call 4, the draw's last: the run is stopped and its checkpoint comes back in pieces
    four = call(4, n, "out4", GPU_DRAW_SECONDS="0", GPU_DRAW_STOP="1", GPU_DRAW_KEEP="1", **column)
    assert four.returncode == 0, four.stdout + four.stderr
    assert "the run is training" in four.stdout and "stopping the run" in four.stdout
    back = sorted(p.name for p in (tmp_path / "out4").iterdir())
    assert "checkpoint.md5" in back and "checkpoint.pt.00" in back and len(back) <= 8
    assert "paper-cifar-impulse/result.json" not in _runs(tmp_path / "out4")
    stopped_at = _tar_rows(tmp_path / "out4", "paper-cifar-impulse")[-1]["epoch"]
    assert 2 <= stopped_at < 6

    # The next draw, on a fresh machine: the payload carries the checkpoint, and the run resumes.
    for folder in ("work", "data"):
        subprocess.run(["rm", "-rf", str(tmp_path / folder)], check=True)
    n = parts(RESUME=str(tmp_path / "out4"), PART_BYTES="1000000")
    assert n > 10  # part10 and on: joined in order
    first = call(1, n, "out5", GPU_DRAW_CARRY_ONLY="1")  # the first call checks the initial weights at once
    assert first.returncode == 0 and "the same initial weights here" in first.stdout, first.stdout + first.stderr
    resume = tmp_path / "parts" / "part1" / "resume.json"
    saved = json.loads(resume.read_text())
    resume.write_text(json.dumps({**saved, "init_fingerprint": "0" * 64}))
    other = call(1, n, "out5", GPU_DRAW_CARRY_ONLY="1")
    assert other.returncode == 1 and "FAILED resume check: this machine makes other initial weights" in other.stdout
    resume.write_text(json.dumps(saved))
    # the payload's run decides the init: naming another before the run is done is refused, unchanged
    wrong = call(n, n, "out5", GPU_DRAW_INIT="mimetic", **column)
    assert wrong.returncode == 2 and "resumes a run of init impulse: unset GPU_DRAW_INIT" in wrong.stderr
    assert not (tmp_path / "work" / "paper-cifar-mimetic").exists() and not (tmp_path / "data").exists()
    # The resumed run finishes, and the column's next init starts in the time left and finishes too.
    last = call(n, n, "out5", GPU_DRAW_SECONDS="200", GPU_DRAW_NEXT_MIN_S="1", GPU_DRAW_WEIGHTS="1", **column)
    assert last.returncode == 0, last.stdout + last.stderr
    assert "resuming the run from the checkpoint in the payload" in last.stdout
    assert "the column's next init, mimetic" in last.stdout and "the column is finished" in last.stdout
    files = _runs(tmp_path / "out5")
    result = json.loads(files["paper-cifar-impulse/result.json"])
    assert result["epochs_done"] == 6 and result["starts"][0] == 0 and result["starts"][-1] == stopped_at * 10
    rows = _tar_rows(tmp_path / "out5", "paper-cifar-impulse")
    assert [r["epoch"] for r in rows] == list(range(1, 7))
    # the shared copy's exact test images every epoch, the whole (partly re-encoded) test set every 4
    assert all("test_first1017_acc" in r for r in rows) and [r["epoch"] for r in rows if "test_acc" in r] == [4, 6]
    other_run = json.loads(files["paper-cifar-mimetic/result.json"])
    assert other_run["config"]["init"] == "mimetic" and other_run["epochs_done"] == 6
    for run in ("paper-cifar-impulse", "paper-cifar-mimetic"):  # the weights, joined to the device's md5 sum
        pieces = sorted((tmp_path / "out5").glob(f"{run}.safetensors.*"))
        joined = b"".join(p.read_bytes() for p in pieces)
        assert hashlib.md5(joined).hexdigest() == (tmp_path / "out5" / f"{run}.md5").read_text().split()[0]


def test_a_call_without_its_part_or_with_a_damaged_part_says_so(tmp_path, draw):
    parts, call = draw
    n = parts()
    (tmp_path / "parts" / "part2" / "MD5SUMS").unlink()
    missing = call(2, n, "out")
    assert missing.returncode == 1 and "part2 is not here: carry it" in missing.stdout
    n = parts()
    piece = next((tmp_path / "parts" / "part2").glob("payload.tar.*"))
    piece.write_bytes(piece.read_bytes()[:-1] + b"\0")
    damaged = call(n, n, "out")
    assert damaged.returncode == 1 and "md5 sums of the payload do not match" in damaged.stdout
    assert not (tmp_path / "work" / "paper-cifar-mimetic").exists()


def test_the_calls_take_the_jobs_in_the_order_given(tmp_path, draw):
    parts, call = draw
    n = parts()
    one = call(1, n, "out1", GPU_DRAW_JOBS="throughput")
    assert one.returncode == 0 and "## call 1: throughput" in one.stdout, one.stdout + one.stderr
    two = call(2, n, "out2", GPU_DRAW_JOBS="throughput")
    assert two.returncode == 0 and "no job for call 2" in two.stdout and "tests" not in two.stdout
    bad = call(1, n, "out3", GPU_DRAW_JOBS="throughput benchmark")
    assert bad.returncode == 2 and "unknown job 'benchmark'" in bad.stderr
