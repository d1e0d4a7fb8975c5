"""A run's folder: locked while a run trains (another process is refused, or waits with
--wait), stale temporaries of a killed write removed at the next start, files created with the
mode the umask gives."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
from test_cli_errors import COMMON, FAST, error_line, train_fails

from structinit.harness.cli.main import main
from structinit.harness.run import folder as runfolder
from structinit.harness.run.checkpoint import atomic_write_bytes


# ----------------------------------------------------------------------------- the lock
def hold_lock(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / runfolder.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def test_run_locked_by_another_process_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    fd = hold_lock(out)
    try:
        line = train_fails(capsys, *FAST, "--out", str(out))
    finally:
        os.close(fd)
    assert line == (f"structinit train: error: another process (pid {os.getpid()}) is training the run in {out}; "
                    "let it finish, or pass --wait to wait for it")
    assert not (out / "checkpoint.pt").exists()


def test_wait_blocks_until_the_lock_is_free(tmp_path, capsys):
    out = tmp_path / "run"
    fd = hold_lock(out)
    threading.Timer(0.5, os.close, (fd,)).start()
    start = time.monotonic()
    assert main(["train", *FAST, "--out", str(out), "--wait"]) == 0
    assert time.monotonic() - start >= 0.5 and (out / "result.json").exists()
    assert f"waiting for another process (pid {os.getpid()})" in capsys.readouterr().err


def test_compare_stops_at_a_run_another_process_trains(tmp_path, capsys):
    fd = hold_lock(tmp_path / "cmp" / "pytorch" / "seed0")
    try:
        assert main(["compare", *COMMON, "--inits", "pytorch", "--seeds", "1", "--out", str(tmp_path / "cmp")]) == 2
    finally:
        os.close(fd)
    assert "is training the run in" in error_line(capsys, "compare")
    assert not (tmp_path / "cmp" / "summary.json").exists()


# ----------------------------------------------------------------------------- run files
def test_stale_temporaries_are_removed_at_the_next_start(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    stale = [".checkpoint.pt.k2_x9q0a.tmp", ".result.json.0123abcd.tmp", ".model.safetensors.deadbeef.tmp"]
    kept = [".notes.0123abcd.tmp", "checkpoint.pt.0123abcd.tmp", ".checkpoint.pt.tmp", "mine.txt"]
    for name in stale + kept:
        (out / name).write_bytes(b"partial")
    (out / ".metrics.csv.aaaabbbb.tmp").symlink_to(out / "mine.txt")  # never followed, never removed
    assert main(["train", *FAST, "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert not names & set(stale) and set(kept) | {".metrics.csv.aaaabbbb.tmp", ".lock"} <= names
    assert (out / "mine.txt").read_bytes() == b"partial"


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_atomic_writes_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        atomic_write_bytes(tmp_path / "f.json", lambda f: f.write(b"{}"))
    finally:
        os.umask(old)
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_run_files_follow_the_umask(tmp_path):
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        assert main(["train", *FAST, "--out", str(out)]) == 0
    finally:
        os.umask(old)
    for name in ("result.json", "checkpoint.pt", "model.safetensors", "metrics.jsonl", "metrics.csv"):
        assert (out / name).stat().st_mode & 0o777 == 0o644, name
