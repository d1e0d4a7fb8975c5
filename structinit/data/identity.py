"""Which copy of a dataset a file is, known by its content, not its name.

A known dataset's file is one of:

- **official**: its bytes have the md5 published with the dataset (CIFAR's python batches as
  the CIFAR page distributes them and torchvision checks them; SVHN's ``.mat`` files);
- **a copy**: other bytes, but the labels of the official file, in the official order (a copy
  that re-encodes its images, or pickles them anew without the ``filenames`` key). Loaded, and
  said in one line: its images may differ from the published ones, and so may its scores;
- **another file of a known dataset** (another split, another dataset under the same file
  name): refused, naming what it is;
- **unknown** (a subset, your own data): loaded as it is.

The label sequences are the md5 of the official files' labels as uint8 in file order, read from
the official files.
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np

from structinit.data.datasets import DatasetFormatError

OFFICIAL, COPY, UNKNOWN = "official", "copy", "unknown"

# md5 of the official files (https://www.cs.toronto.edu/~kriz/cifar.html, python version; the
# sums torchvision checks) → (dataset, file).
OFFICIAL_FILES = {
    "c99cafc152244af753f735de768cd75f": ("CIFAR-10", "data_batch_1"),
    "d4bba439e000b95fd0a9bffe97cbabec": ("CIFAR-10", "data_batch_2"),
    "54ebc095f3ab1f0389bbae665268c751": ("CIFAR-10", "data_batch_3"),
    "634d18415352ddfa80567beed471001a": ("CIFAR-10", "data_batch_4"),
    "482c414d41f54cd18b22e5b47cb7c3cb": ("CIFAR-10", "data_batch_5"),
    "40351d587109b95175f43aff81a1287e": ("CIFAR-10", "test_batch"),
    "16019d7e3df5f24257cddd939b257f8d": ("CIFAR-100", "train"),
    "f0ef6b0ae62326f3e7ffdfab6717acfc": ("CIFAR-100", "test"),
    "e26dedcc434d2e4c54c9b2d4a06d8373": ("SVHN", "train_32x32.mat"),
    "eb5a983be6a315427106f1b164d9cef3": ("SVHN", "test_32x32.mat"),
    "a93ce644f1a588dc4d68dda5feec44a7": ("SVHN", "extra_32x32.mat"),
}

# md5 of each official file's label sequence (uint8, in file order) → (dataset, file).
OFFICIAL_LABELS = {
    "30f55b79f7954f592721267e37ffcbcf": ("CIFAR-10", "data_batch_1"),
    "bdca50851f742064551c3fa947e975d6": ("CIFAR-10", "data_batch_2"),
    "23228d18cd9f4c032bb8cfa72996e3ef": ("CIFAR-10", "data_batch_3"),
    "61be7314d261d42101f429408af67a28": ("CIFAR-10", "data_batch_4"),
    "8ca6bc10f4bd0e81fba552f724423842": ("CIFAR-10", "data_batch_5"),
    "251f18ce75337ae9ca5d0dbd7ea62cf4": ("CIFAR-10", "test_batch"),
}


def labels_md5(labels: np.ndarray) -> str:
    """The md5 :data:`OFFICIAL_LABELS` keys: the labels as uint8, in order."""
    return hashlib.md5(np.asarray(labels, dtype=np.uint8).tobytes(), usedforsecurity=False).hexdigest()


def identify(path: str, digest: str | None, labels: np.ndarray, dataset: str, file: str) -> str:
    """Which copy ``path`` is (module doc): :data:`OFFICIAL`, :data:`COPY` or :data:`UNKNOWN`;
    a :class:`DatasetFormatError` naming what it is when its bytes or its labels are another
    known file's. ``digest`` is the file's md5 (None: judged by its labels alone); ``dataset``
    and ``file`` what was asked for ("CIFAR-10", "test_batch")."""
    if digest is not None:
        known = OFFICIAL_FILES.get(digest)
        if known is not None:
            _check_is(path, known, dataset, file, "the official file")
            return OFFICIAL
    known = OFFICIAL_LABELS.get(labels_md5(labels))
    if known is None:
        return UNKNOWN
    _check_is(path, known, dataset, file, "its labels, in the official order")
    return COPY


def _check_is(path: str, known: tuple[str, str], dataset: str, file: str, how: str) -> None:
    if known != (dataset, file):
        raise DatasetFormatError(f"{path}: this is {known[0]}'s {known[1]} (by {how}), and {dataset}'s {file} was "
                                 f"asked for; point the data folder at {dataset}'s files, or ask for the dataset it "
                                 "holds")


def describe(location: str, dataset: str, split: str, kinds: dict[str, str]) -> str:
    """The words a run records for the copy it read: ``kinds`` maps each file to what
    :func:`identify` said; a copy is also said once as a warning."""
    copies = [f for f, k in kinds.items() if k == COPY]
    if all(k == OFFICIAL for k in kinds.values()):
        return f"{dataset} {split}: the official files"
    if copies and all(k in (OFFICIAL, COPY) for k in kinds.values()):
        words = (f"{dataset} {split}: a copy of the official files ({', '.join(copies)}: the official labels in the "
                 "official order, other bytes: images re-encoded or pickled anew)")
        warnings.warn(f"{location}: {words}; scores on it may differ from published ones", UserWarning, stacklevel=3)
        return words
    unknown = ", ".join(f for f, k in kinds.items() if k == UNKNOWN)
    return f"{dataset} {split}: files that are no published copy ({unknown})"
