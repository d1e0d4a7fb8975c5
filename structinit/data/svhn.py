"""SVHN (cropped digits, "format 2") from the official ``train_32x32.mat`` / ``test_32x32.mat``.

http://ufldl.stanford.edu/housenumbers/: MATLAB v5 files with ``X`` uint8 (32, 32, 3, N) —
height, width, channel, image — and ``y`` (N, 1) with labels 1–10, where 10 is the digit 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from structinit.data.datasets import (
    DATASET_STATS,
    ArrayDataset,
    DatasetFormatError,
    DatasetNotFoundError,
    check_split,
)
from structinit.data.download import file_md5
from structinit.data.identity import describe, identify

__all__ = ["SVHN_FILES", "load_svhn", "parse_svhn"]

SVHN_FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}


def parse_svhn(mat: dict, path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 3, 32, 32) and labels int64 (N,) in 0..9 from a loaded ``.mat`` dict."""
    for key in ("X", "y"):
        if key not in mat:
            keys = ", ".join(k for k in mat if not k.startswith("__"))
            raise DatasetFormatError(f"{path}: no variable {key!r} (found {keys}); expected SVHN's X and y")
    x, y = mat["X"], np.asarray(mat["y"])
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        found = f"{x.dtype} array of shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise DatasetFormatError(f"{path}: X is a {found}, expected uint8 (32, 32, 3, N)")
    n = x.shape[3]
    if y.size != n or y.ndim not in (1, 2) or y.dtype.kind not in "iuf":
        raise DatasetFormatError(f"{path}: y has shape {y.shape} ({y.dtype}), expected ({n}, 1) numeric labels")
    y = y.reshape(-1).astype(np.int64)
    if n and (y.min() < 1 or y.max() > 10):
        bad = int(y.min()) if y.min() < 1 else int(y.max())
        raise DatasetFormatError(f"{path}: labels out of range: found {bad}, expected 1..10 (10 is the digit 0)")
    y[y == 10] = 0
    # (H, W, C, N) -> (N, C, H, W)
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), y


def load_svhn(root: str | Path, split: str = "train") -> ArrayDataset:
    """SVHN split (``root/svhn/<file>`` or ``root/<file>``): images uint8 (N, 3, 32, 32), classes "0".."9"."""
    check_split(split)
    root = Path(root).expanduser()
    filename = SVHN_FILES[split]
    candidates = [root, root / "svhn"] if root.name == "svhn" else [root / "svhn", root]
    path = next((c / filename for c in candidates if (c / filename).is_file()), None)
    if path is None:
        tried = " or ".join(str(c / filename) for c in candidates)
        raise DatasetNotFoundError(
            f"{tried} not found: expected the official SVHN {filename}; "
            "pass download=True (--download) or root= the folder that contains it"
        )
    import scipy.io  # here, not at the top: a fifth of a second of every command that never reads SVHN

    try:
        mat = scipy.io.loadmat(path)
    except NotImplementedError as exc:  # scipy raises this for MATLAB v7.3 (HDF5) files
        raise DatasetFormatError(
            f"{path}: is a MATLAB v7.3 file, expected the official v5 {filename}; re-download it (download=True)"
        ) from exc
    except Exception as exc:  # scipy reports truncation/corruption as ValueError, TypeError, OSError, …
        raise DatasetFormatError(
            f"{path}: cannot read it as a MATLAB file ({type(exc).__name__}: {exc}); it is corrupted or truncated "
            "— delete it and re-download (download=True)"
        ) from exc
    images, labels = parse_svhn(mat, path)
    kinds = {filename: identify(str(path), file_md5(path), labels, "SVHN", filename)}
    digits = [str(i) for i in range(10)]
    return ArrayDataset(torch.from_numpy(images), torch.from_numpy(labels), digits, "svhn", *DATASET_STATS["svhn"],
                        describe(str(path), "SVHN", split, kinds))
