import sys

from structinit.cli import main

sys.exit(main())
