"""The ``structinit`` command's entry point, kept outside the package on purpose.

Importing :mod:`structinit` loads torch, which takes a second or two; the package cannot catch
a Ctrl-C or a SIGTERM that arrives while its own ``__init__`` runs. This module imports nothing
heavy, so the command's ``main`` is here: a Ctrl-C during start-up ends with one line and exit
status 130, a SIGTERM with one line and 143, as they do once a command runs
(:func:`structinit.harness.cli.main.main`), instead of a traceback from deep inside an import
or a silent exit.
"""

from __future__ import annotations

import signal
import sys
import threading

__all__ = ["main"]

INTERRUPTED = "structinit: interrupted while starting; nothing was run"
TERMINATED = "structinit: terminated (SIGTERM) while starting; nothing was run"


class _Terminated(KeyboardInterrupt):
    """SIGTERM while the command line loads."""


def _terminate(signum, frame) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    """Import the command line and run it with ``argv`` (default: ``sys.argv[1:]``)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        from structinit.harness.cli.main import main as run
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, _Terminated)
        print(TERMINATED if terminated else INTERRUPTED, file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, before)
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
