"""scikit-learn's bundled 8×8 handwritten digits: the dataset that needs no download.

1,797 images with values 0..16 (``sklearn.datasets.load_digits``), scaled to uint8 by
``v * 255 // 16``. There is no official train/test split, so one is fixed here: per class, the
first 20% (rounded) of :func:`stable_permutation` (seed :data:`DIGITS_SPLIT_SEED`) of that
class's images is the test split and the rest the train split — disjoint, class-stratified, and
identical on every machine and library version.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from structinit.data.datasets import ArrayDataset, check_split, normalisation_stats
from structinit.data.splits import stable_permutation
from structinit.utils import derive_seed
from structinit.utils.optional_imports import require

__all__ = ["DIGITS_SPLIT_SEED", "DIGITS_TEST_FRACTION", "digits_arrays", "digits_split_indices", "load_digits"]

DIGITS_SPLIT_SEED = 0
DIGITS_TEST_FRACTION = 0.2


def digits_split_indices(labels: np.ndarray, split: str) -> np.ndarray:
    """Sorted indices of ``split`` ("train" / "test") in the full digits set with ``labels`` (N,)."""
    is_test = np.zeros(len(labels), dtype=bool)
    for k in np.unique(labels):
        members = np.flatnonzero(labels == k)
        perm = stable_permutation(len(members), derive_seed(DIGITS_SPLIT_SEED, int(k)))
        is_test[members[perm[: round(DIGITS_TEST_FRACTION * len(members))]]] = True
    return np.flatnonzero(is_test if split == "test" else ~is_test)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) int64 in 0..16, labels (1797,) int64): what
    ``sklearn.datasets.load_digits()`` returns, read from the file scikit-learn bundles.

    ``import sklearn`` takes over a second, paid again by every training process; the file is
    found without importing it and parsed as scikit-learn parses it. Where it is not there (a
    layout this reader does not know), scikit-learn itself loads it."""
    try:
        spec = importlib.util.find_spec("sklearn")  # None when absent, or blocked in sys.modules
    except (ImportError, ValueError):
        spec = None
    bundled = None if spec is None or not spec.submodule_search_locations else \
        Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if bundled is None or not bundled.is_file():
        bunch = require("sklearn.datasets", "the digits dataset").load_digits()
        return np.asarray(bunch.images).astype(np.int64), np.asarray(bunch.target).astype(np.int64)
    with gzip.open(bundled, "rt") as f:
        table = np.loadtxt(f, delimiter=",")  # 1797 rows: 64 pixel values, then the label
    return table[:, :-1].astype(np.int64).reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def load_digits(split: str = "train") -> ArrayDataset:
    """The digits ``split``: images uint8 (N, 1, 8, 8), classes "0".."9"; about 1,437 train / 360 test.

    mean/std are computed from the train split for both splits.
    """
    check_split(split)
    values, labels = digits_arrays()
    images = torch.from_numpy((values * 255 // 16).astype(np.uint8)[:, None])
    index = torch.from_numpy(digits_split_indices(labels, split))
    stats = normalisation_stats(images[torch.from_numpy(digits_split_indices(labels, "train"))])
    classes = [str(i) for i in range(10)]
    return ArrayDataset(images[index].contiguous(), torch.from_numpy(labels)[index], classes, "digits", *stats)
