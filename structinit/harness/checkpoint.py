"""Run files: atomic checkpoints loaded without executing code, and metric logs.

A checkpoint is written to a temporary file in the same folder, flushed and fsync'ed, then
renamed over the old one (``os.replace`` is atomic on POSIX), and the folder is fsync'ed:
a run killed at any instant leaves either the previous checkpoint or the new one, never a
torn file. It is read back with ``torch.load(weights_only=True)``, which only rebuilds
tensors and plain containers, so a tampered file cannot run code.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_write_bytes(path: Path, write) -> None:
    """Call ``write(fileobj)`` on a temporary file and atomically move it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomically save ``state`` (tensors, state dicts, numbers, strings, lists, dicts)."""
    atomic_write_bytes(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` without executing code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupted or not a checkpoint at all
        raise ValueError(
            f"{path}: not a readable structinit checkpoint (expected a torch.save'd dict of "
            f"tensors and plain values): {type(err).__name__}: {err}"
        ) from err


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()))


class MetricsLog:
    """Per-epoch metrics as JSON lines (``metrics.jsonl``) and a CSV (``metrics.csv``).

    Both files are rewritten from the in-memory history whenever a row is added, atomically,
    so they always agree with the last checkpoint after a resume (no duplicated epochs).
    """

    def __init__(self, folder: Path, history: list[dict] | None = None):
        self.folder = Path(folder)
        self.history: list[dict] = list(history or [])

    def append(self, row: dict) -> None:
        self.history.append(row)
        self.flush()

    def flush(self) -> None:
        lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.history)
        atomic_write_bytes(self.folder / "metrics.jsonl", lambda f: f.write(lines.encode()))
        keys = sorted({k for r in self.history for k in r})

        def write_csv(f):
            import io

            text = io.StringIO()
            w = csv.DictWriter(text, fieldnames=keys)
            w.writeheader()
            w.writerows(self.history)
            f.write(text.getvalue().encode())

        atomic_write_bytes(self.folder / "metrics.csv", write_csv)
