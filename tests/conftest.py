import sys
from pathlib import Path

import torch

# bench/ holds research code that the tests check but the package does not ship
# (bench/proposition1.py): importable by module name. Appended, so it shadows nothing.
sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))

torch.set_num_threads(2)
