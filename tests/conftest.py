import os
import sys
from pathlib import Path

import torch

# bench/ holds research code that the tests check but the package does not ship
# (bench/proposition1.py): importable by module name. Appended, so it shadows nothing.
sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))

# Under pytest-xdist (`-n 2`, as scripts/test.sh runs) each worker has one core: one torch thread
# each, and the processes the tests start inherit it. Two threads per worker on two cores make the
# workers' thread pools spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)
