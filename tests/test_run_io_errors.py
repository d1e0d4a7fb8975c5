"""A full disk or an unwritable folder while a run writes its files: one line naming the
file, the last good checkpoint kept, and the run resumes from it once there is space."""

from __future__ import annotations

import errno
import os

from structinit.harness.cli.main import main
from structinit.harness.run import checkpoint
from structinit.harness.run.checkpoint import load_checkpoint

ARGS = ["train", "--recipe", "digits", "--epochs", "3", "--set", "train_size=None", "--no-progress"]


def test_full_disk_during_a_checkpoint_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    # The second checkpoint finds the disk full: written in the background while epoch 3 trains, its
    # error still ends the run in one line, and the epoch-1 checkpoint is the one kept.
    out = tmp_path / "run"
    real_fsync, calls = os.fsync, []

    def full_disk(fd):
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(".checkpoint.pt."):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", full_disk)
    assert main([*ARGS, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{out / 'checkpoint.pt'}: could not be written (No space left on device)" in err
    assert "the last good checkpoint" in err and "--resume" in err and "Traceback" not in err
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] == 1  # the epoch-1 checkpoint, intact
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]

    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # the metrics are never ahead of it
    monkeypatch.setattr(checkpoint.os, "fsync", real_fsync)  # space freed
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    done = load_checkpoint(out / "checkpoint.pt")
    assert done["epoch"] == 3 and done["starts"] == [0, load_checkpoint(out / "checkpoint.pt")["starts"][1]]
    assert done["starts"][1] > 0


def test_no_space_for_the_exported_weights(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real_fsync = os.fsync

    def refuse_weights(fd):
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(".model.safetensors."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", refuse_weights)
    assert main([*ARGS, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors: could not be written (No space left on device)" in err
    assert not (out / "result.json").exists() and load_checkpoint(out / "checkpoint.pt")["finished"]
    monkeypatch.setattr(checkpoint.os, "fsync", real_fsync)
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0 and (out / "model.safetensors").exists()
