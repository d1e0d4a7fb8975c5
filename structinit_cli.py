"""The ``structinit`` command's entry point, kept outside the package on purpose.

Importing :mod:`structinit` loads torch, which takes a second or two; the package cannot catch
a Ctrl-C or a SIGTERM that arrives while its own ``__init__`` runs. This module imports nothing
heavy, so the command's ``main`` is here: a Ctrl-C during start-up ends with one line and exit
status 130, a SIGTERM with one line and 143, as they do once a command runs
(:func:`structinit.harness.cli.main.main`), instead of a traceback from deep inside an import
or a silent exit. ``python -m structinit`` gets the same guard from the package's first line
(:func:`started_as_module`), released by ``structinit.__main__`` once the command line is loaded.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["guard_startup", "main", "release_startup", "started_as_module"]

INTERRUPTED = "structinit: interrupted while starting; nothing was run"
TERMINATED = "structinit: terminated (SIGTERM) while starting; nothing was run"

_saved: dict[int, object] = {}  # signal → the handler the guard replaced


def _stop_now(signum, frame) -> None:
    """One line and the exit status, at once: an exception raised inside an import would leave
    half-loaded modules (numpy's) whose teardown can end in a traceback of its own."""
    terminated = signum == signal.SIGTERM
    os.write(2, f"{TERMINATED if terminated else INTERRUPTED}\n".encode())
    os._exit(143 if terminated else 130)


def guard_startup() -> None:
    """Until :func:`release_startup`, SIGTERM, and Ctrl-C where it is not ignored (a job started in
    the background keeps ignoring it), end the process with one line. Main thread only."""
    if threading.current_thread() is not threading.main_thread() or _saved:
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        current = signal.getsignal(signum)
        if signum == signal.SIGTERM or current is signal.default_int_handler:
            _saved[signum] = signal.signal(signum, _stop_now)


def release_startup() -> None:
    """Put back the handlers :func:`guard_startup` replaced."""
    for signum, before in _saved.items():
        signal.signal(signum, before)
    _saved.clear()


def started_as_module(argv: list[str] | None = None) -> bool:
    """Whether the interpreter was started as ``python -m structinit`` (``argv``: its original
    command line, ``sys.orig_argv``)."""
    argv = getattr(sys, "orig_argv", []) if argv is None else argv
    if "-mstructinit" in argv:
        return True
    return "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["structinit"]


def main(argv: list[str] | None = None) -> int:
    """Import the command line and run it with ``argv`` (default: ``sys.argv[1:]``)."""
    guard_startup()
    try:
        from structinit.harness.cli.main import main as run
    finally:
        release_startup()
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
