import sys

from structinit.harness.cli.main import main

sys.exit(main())
