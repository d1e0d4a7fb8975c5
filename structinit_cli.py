"""The ``structinit`` command's entry point, kept outside the package on purpose.

Importing :mod:`structinit` loads torch, which takes a second or two; the package cannot catch
a Ctrl-C that arrives while its own ``__init__`` runs. This module imports nothing heavy, so
the command's ``main`` is here: a Ctrl-C during start-up ends with one line and exit status
130, as it does once a command runs (:func:`structinit.harness.cli.main.main`), instead of a
traceback from deep inside an import.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

INTERRUPTED = "structinit: interrupted while starting; nothing was run"


def main(argv: list[str] | None = None) -> int:
    """Import the command line and run it with ``argv`` (default: ``sys.argv[1:]``)."""
    try:
        from structinit.harness.cli.main import main as run
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
