"""Shared by the kill-and-resume tests of image and sequence runs."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wait_for_rows(metrics: Path, rows: int, timeout: float = 120.0) -> list[dict]:
    """Poll a run's ``metrics.jsonl`` until it holds ``rows`` rows (or ``timeout`` passes);
    return the rows it has."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < rows):
        time.sleep(0.01)
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def kill_then_resume(command, tmp_path: Path, cwd: Path, pause: float = 0.0):
    """Run ``command(folder)`` (a training command line) to the end in ``tmp_path/reference``;
    run it again in ``tmp_path/victim``, SIGKILL it ``pause`` × (one chunk's seconds) after its
    second metric row, and resume it with ``--resume``. Returns the victim's checkpoint at the
    kill, its final checkpoint and the reference's, read with ``load_checkpoint``."""
    import os
    import signal
    import subprocess

    from structinit.harness.run.checkpoint import load_checkpoint

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference, victim = tmp_path / "reference", tmp_path / "victim"
    subprocess.run(command(reference), check=True, env=env, cwd=cwd, capture_output=True)
    proc = subprocess.Popen(command(victim), env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = wait_for_rows(victim / "metrics.jsonl", 2)
    time.sleep(pause * (rows[1]["wall_s"] - rows[0]["wall_s"]))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = load_checkpoint(victim / "checkpoint.pt")
    subprocess.run([*command(victim), "--resume"], check=True, env=env, cwd=cwd, capture_output=True)
    return killed, load_checkpoint(victim / "checkpoint.pt"), load_checkpoint(reference / "checkpoint.pt")
