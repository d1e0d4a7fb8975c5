"""scikit-learn's bundled 8×8 handwritten digits: the dataset that needs no download.

1,797 images with values 0..16 (``sklearn.datasets.load_digits``), scaled to uint8 by
``v * 255 // 16``. There is no official train/test split, so one is fixed here: per class, the
first 20% (rounded) of :func:`stable_permutation` (seed :data:`DIGITS_SPLIT_SEED`) of that
class's images is the test split and the rest the train split — disjoint, class-stratified, and
identical on every machine and library version.
"""

from __future__ import annotations

import numpy as np
import torch

from structinit.data.datasets import ArrayDataset, check_split, normalisation_stats
from structinit.data.splits import stable_permutation
from structinit.utils import derive_seed
from structinit.utils.optional_imports import require

__all__ = ["DIGITS_SPLIT_SEED", "DIGITS_TEST_FRACTION", "digits_split_indices", "load_digits"]

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


def load_digits(split: str = "train") -> ArrayDataset:
    """The digits ``split``: images uint8 (N, 1, 8, 8), classes "0".."9"; about 1,437 train / 360 test.

    mean/std are computed from the train split for both splits.
    """
    check_split(split)
    # imported here: sklearn is slow to import and only the harness extra installs it
    bunch = require("sklearn.datasets", "the digits dataset").load_digits()
    values = np.asarray(bunch.images).astype(np.int64)  # (1797, 8, 8), 0..16
    images = torch.from_numpy((values * 255 // 16).astype(np.uint8)[:, None])
    labels = np.asarray(bunch.target).astype(np.int64)
    index = torch.from_numpy(digits_split_indices(labels, split))
    stats = normalisation_stats(images[torch.from_numpy(digits_split_indices(labels, "train"))])
    classes = [str(i) for i in range(10)]
    return ArrayDataset(images[index].contiguous(), torch.from_numpy(labels)[index], classes, "digits", *stats)
