import sys

from structinit.harness.cli.main import main

try:  # the start-up guard the package set for `python -m structinit` (structinit_cli): the command takes over
    from structinit_cli import release_startup
except ImportError:  # the package without its launcher module
    pass
else:
    release_startup()

sys.exit(main())
