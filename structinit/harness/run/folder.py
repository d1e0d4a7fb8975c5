"""The run folder: checked before anything is loaded, locked while a run trains in it, and
cleared of the temporary files a killed run left behind.

One process at a time trains a run folder. :func:`lock_run` takes an advisory ``fcntl.flock``
on ``<folder>/.lock`` (released by the kernel when the process ends, even by SIGKILL, so a
crash never leaves a stale lock) and writes its pid there for the message the next process
gets. Without ``fcntl`` (Windows) there is no lock.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from structinit.harness.errors import RunLockedError, user_input
from structinit.harness.run.checkpoint import EMA_WEIGHTS, TEMPORARY, WEIGHTS

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

__all__ = ["LOCK_FILE", "RUN_FILES", "check_out_dir", "lock_run", "remove_stale_temporaries"]

LOCK_FILE = ".lock"
# The files a run writes atomically; only their temporaries are ever removed.
RUN_FILES = frozenset({"checkpoint.pt", "result.json", "metrics.jsonl", "metrics.csv", WEIGHTS, EMA_WEIGHTS})


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def check_out_dir(path: str | Path) -> None:
    """Raise if ``path`` cannot be a run folder: it is a file, or it (or the nearest folder
    that exists above it, where it would be created) is not writable. Creates nothing, so it
    can run before data is loaded and leave no trace when something else is wrong."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(f"out_dir={path} is a file, not a folder; choose another out_dir (--out)")
        if not _writable(path):
            raise PermissionError(f"out_dir={path}: no permission to write in that folder; "
                                  "choose another out_dir (--out) or fix its permissions")
        return
    if path.is_symlink():
        raise NotADirectoryError(f"out_dir={path} is a broken symbolic link; remove it or choose another "
                                 "out_dir (--out)")
    parent = next(p for p in path.absolute().parents if p.exists())  # "/" always exists
    if not parent.is_dir():
        raise NotADirectoryError(f"out_dir={path} cannot be created: {parent} is a file, not a folder; "
                                 "choose another out_dir (--out)")
    if not _writable(parent):
        raise PermissionError(f"out_dir={path} cannot be created: no permission to write in {parent}; "
                              "choose another out_dir (--out)")


def comparison_in(path: str | Path) -> str | None:
    """Why ``path`` is a comparison's folder (``compare --out``), or None: it holds the
    comparison's summary.json, or an ``<init>/seed<N>`` run folder."""
    path = Path(path)
    if (path / "summary.json").is_file():
        return "it holds a comparison's summary.json"
    if path.is_dir():
        for child in sorted(c for c in path.iterdir() if c.is_dir()):
            if any(g.is_dir() and re.fullmatch(r"seed\d+", g.name) for g in child.iterdir()):
                return f"it holds a comparison's runs ({child.name}/seed…)"
    return None


def inside_comparison(path: str | Path, seed: int) -> str | None:
    """Why a run of ``seed`` written at ``path`` would be read as one of a comparison's runs that
    it is not, or None: ``path`` lies up to three folders below a comparison's folder (one that
    holds its summary.json: a folder of other runs is not taken for one), and is not the
    ``<init>/seed<seed>`` folder a comparison gives it."""
    path = Path(path).expanduser().absolute()
    own = re.fullmatch(rf"seed{seed}", path.name) is not None
    for depth, ancestor in enumerate(path.parents[:3], start=1):
        if (ancestor / "summary.json").is_file() and not (depth == 2 and own):
            return f"{ancestor} is a comparison's folder (it holds a comparison's summary.json)"
    return None


def run_in(path: str | Path) -> str | None:
    """Why ``path`` is one run's folder (``train --out``), or None: it holds a run's result.json or checkpoint."""
    found = [name for name in ("result.json", "checkpoint.pt") if (Path(path) / name).is_file()]
    return f"it holds a run's {found[0]}" if found else None


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete the ``.<run file>.<8 characters>.tmp`` files in ``folder`` (what a kill during an
    atomic write leaves behind) and return them. Call it only while holding the folder's lock:
    another process's temporaries are in flight, not stale."""
    removed = []
    with os.scandir(folder) as entries:
        for entry in entries:
            found = TEMPORARY.fullmatch(entry.name)
            if found and found["name"] in RUN_FILES and entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)
                removed.append(Path(entry.path))
    return removed


@contextmanager
def lock_run(folder: str | Path, wait: bool = False, enabled: bool = True) -> Iterator[None]:
    """Create ``folder``, hold its lock for the block and clear its stale temporaries first.

    If another process holds the lock, raise :class:`RunLockedError` naming it, or with
    ``wait=True`` block until it is free. ``enabled=False`` (the other ranks of a distributed
    run, which write nothing) does nothing at all.
    """
    if not enabled:
        yield
        return
    folder = Path(folder)
    with user_input("out_dir"):  # only the setting up: errors of the block are the caller's
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:  # check_out_dir passed, so something changed since: say what
            raise type(err)(f"out_dir={folder}: cannot create the run folder or its lock file "
                            f"({err.strerror or err}); choose another out_dir (--out)") from err
    try:
        _acquire(fd, folder, wait)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            remove_stale_temporaries(folder)
            yield
        finally:
            os.ftruncate(fd, 0)  # no pid of a process that no longer holds it
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, folder: Path, wait: bool) -> None:
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    holder = f"another process (pid {pid})" if pid.isdigit() else "another process"
    if not wait:
        raise RunLockedError(f"{holder} is training the run in {folder}; let it finish, or pass "
                             "wait=True (--wait) to wait for it")
    print(f"waiting for {holder}, which is training the run in {folder} …", file=sys.stderr, flush=True)
    fcntl.flock(fd, fcntl.LOCK_EX)
