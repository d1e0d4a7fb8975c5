import sys

from structinit.harness.cli import main

sys.exit(main())
