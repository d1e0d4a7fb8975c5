"""The in-memory dataset type shared by every loader, and per-channel statistics.

A split is small enough (CIFAR: 50,000 × 3 × 32 × 32 bytes = 150 MB) to live in memory as one
uint8 tensor, so there is no per-item file access, no worker processes and no PIL in the
training loop: augmentation and normalisation run batched on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ArrayDataset", "DatasetFormatError", "DatasetNotFoundError", "DATASET_STATS", "SPLITS", "channel_stats",
           "check_split"]

SPLITS = ("train", "test")


class DatasetFormatError(ValueError):
    """A dataset file exists but is not what its format promises (truncated, corrupted, wrong shape)."""


class DatasetNotFoundError(FileNotFoundError):
    """None of a dataset's files were found where they were looked for (``download=True`` can fetch them)."""


def check_split(split: object) -> str:
    """``split`` if it is one of :data:`SPLITS` ("train", "test"); a ``ValueError`` naming it otherwise."""
    if not isinstance(split, str) or split not in SPLITS:
        raise ValueError(f"split={split!r}: expected 'train' or 'test'")
    return split


# Per-channel mean / std in [0, 1] units of the *training* split, the constants that the
# literature normalises with (population std over all training pixels of a channel).
DATASET_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
}


@dataclass
class ArrayDataset:
    """A whole split in memory.

    Attributes:
        images: uint8 (N, C, H, W).
        labels: int64 (N,), values in ``[0, num_classes)``.
        classes: class names; ``len(classes) == num_classes``.
        name: dataset name, e.g. ``"cifar10"``.
        mean, std: per-channel statistics in [0, 1] units (length C) to normalise with; for a
            test split or a subset these are still the *training* statistics.
        source: which copy of the dataset the files were, in words (the official files, a copy,
            files of no published copy: :mod:`structinit.data.identity`); "" when not known.
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str = ""

    def __post_init__(self) -> None:
        where = f"ArrayDataset {self.name!r}"
        if not isinstance(self.images, torch.Tensor) or self.images.dtype != torch.uint8 or self.images.ndim != 4:
            found = _describe(self.images)
            raise DatasetFormatError(f"{where}: images is {found}, expected a uint8 tensor (N, C, H, W)")
        if not isinstance(self.labels, torch.Tensor) or self.labels.dtype != torch.int64 or self.labels.ndim != 1:
            raise DatasetFormatError(f"{where}: labels is {_describe(self.labels)}, expected an int64 tensor (N,)")
        n = self.images.shape[0]
        if self.labels.shape[0] != n:
            raise DatasetFormatError(
                f"{where}: {n} images but {self.labels.shape[0]} labels; expected one label per image"
            )
        self.classes = [str(c) for c in self.classes]
        if len(self.classes) == 0:
            raise DatasetFormatError(f"{where}: classes is empty; expected at least one class name")
        if n > 0:
            lo, hi = int(self.labels.min()), int(self.labels.max())
            if lo < 0 or hi >= len(self.classes):
                raise DatasetFormatError(
                    f"{where}: labels out of range: found {lo if lo < 0 else hi}, expected 0..{len(self.classes) - 1} "
                    f"({len(self.classes)} classes)"
                )
        c = self.images.shape[1]
        self.mean = tuple(float(m) for m in self.mean)
        self.std = tuple(float(s) for s in self.std)
        if len(self.mean) != c or len(self.std) != c:
            raise DatasetFormatError(
                f"{where}: mean has {len(self.mean)} and std {len(self.std)} values, expected {c} (one per channel)"
            )
        if not all(s > 0 for s in self.std):
            raise DatasetFormatError(f"{where}: std={self.std}, expected every channel's std > 0")

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Image ``i`` as uint8 (C, H, W) and its label."""
        return self.images[i], int(self.labels[i])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W)."""
        return tuple(self.images.shape[1:])

    def subset(self, index: torch.Tensor | Sequence[int] | np.ndarray) -> ArrayDataset:
        """The images at ``index`` (int indices (K,), or a bool mask (N,)), in that order.

        Keeps ``classes``, ``mean`` and ``std``: a subset is normalised like its parent.
        """
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            if index.shape != (len(self),):
                raise IndexError(f"subset: bool mask has shape {tuple(index.shape)}, expected ({len(self)},)")
        elif index.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            index = index.long().reshape(-1)
            if index.numel() and (int(index.min()) < -len(self) or int(index.max()) >= len(self)):
                bad = int(index.max()) if int(index.max()) >= len(self) else int(index.min())
                raise IndexError(f"subset: index {bad} out of range for {len(self)} images")
        else:
            raise TypeError(f"subset: index has dtype {index.dtype}, expected integer indices or a bool mask")
        return ArrayDataset(self.images[index], self.labels[index], list(self.classes), self.name, self.mean, self.std,
                            self.source)

    def normalised(self, n: int | None = None) -> torch.Tensor:
        """The first ``n`` images (all by default) as float32 in training's normalisation:
        (x / 255 − mean) / std per channel, shape (n, C, H, W)."""
        x = self.images[:n].float() / 255
        mean, std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (self.mean, self.std))
        return (x - mean) / std

    def class_counts(self) -> torch.Tensor:
        """int64 (num_classes,): how many images each class has."""
        return torch.bincount(self.labels, minlength=self.num_classes)


def _describe(x: object) -> str:
    return f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def channel_stats(images: torch.Tensor, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 images (N, C, H, W), in [0, 1] units.

    Accumulates sums in float64 over chunks of ``chunk`` images, so memory stays bounded and
    the result does not drift with N (float32 sums over 10^8 pixels lose digits).
    """
    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        raise ValueError(f"channel_stats: images is {_describe(images)}, expected a (N, C, H, W) tensor")
    n, c = images.shape[:2]
    if n == 0:
        raise ValueError("channel_stats: images is empty (N = 0); need at least one image")
    total = torch.zeros(c, dtype=torch.float64)
    total_sq = torch.zeros(c, dtype=torch.float64)
    for start in range(0, n, chunk):
        x = images[start : start + chunk].to(torch.float64)
        total += x.sum(dim=(0, 2, 3))
        total_sq += x.square().sum(dim=(0, 2, 3))
    count = n * images.shape[2] * images.shape[3]
    scale = 255.0 if images.dtype == torch.uint8 else 1.0
    mean = total / count
    var = (total_sq / count - mean.square()).clamp_min(0.0)
    return tuple((mean / scale).tolist()), tuple((var.sqrt() / scale).tolist())


def normalisation_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """:func:`channel_stats` with each std floored at 1/255, so that normalising by it is always
    finite (a constant channel, e.g. a blank border everywhere, has std 0)."""
    mean, std = channel_stats(images)
    return mean, tuple(max(s, 1.0 / 255.0) for s in std)
