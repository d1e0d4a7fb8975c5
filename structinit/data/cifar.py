"""CIFAR-10 / CIFAR-100 from the official "python version" (pickled batches).

Layout (https://www.cs.toronto.edu/~kriz/cifar.html): ``cifar-10-batches-py/`` holds
``data_batch_1`` … ``data_batch_5``, ``test_batch`` and ``batches.meta``; ``cifar-100-python/``
holds ``train``, ``test`` and ``meta``. Each batch is a pickled dict: ``b'data'`` is uint8
(N, 3072), a row being the 1024 red, then 1024 green, then 1024 blue values of a row-major
32×32 image, so ``reshape(N, 3, 32, 32)`` is already (N, C, H, W); ``b'labels'`` (CIFAR-100:
``b'fine_labels'`` / ``b'coarse_labels'``) is a list of ints. ``b'filenames'`` is not needed.
"""

from __future__ import annotations

import hashlib
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from structinit.data.datasets import (
    DATASET_STATS,
    ArrayDataset,
    DatasetFormatError,
    DatasetNotFoundError,
    check_split,
)
from structinit.data.identity import describe, identify
from structinit.data.safe_pickle import load_pickle

__all__ = ["CIFAR10", "CIFAR100", "CifarSpec", "load_cifar", "locate_cifar"]

_ROW = 3 * 32 * 32


@dataclass(frozen=True)
class CifarSpec:
    """Where a CIFAR variant keeps its files, and what they are called."""

    name: str  # "cifar10"
    title: str  # "CIFAR-10", for messages
    folder: str  # extracted folder
    archive: str  # official archive name
    train: tuple[str, ...]
    test: tuple[str, ...]
    meta: str

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.train, *self.test, self.meta)


CIFAR10 = CifarSpec(
    "cifar10", "CIFAR-10", "cifar-10-batches-py", "cifar-10-python.tar.gz",
    tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "batches.meta",
)  # fmt: skip
CIFAR100 = CifarSpec(
    "cifar100", "CIFAR-100", "cifar-100-python", "cifar-100-python.tar.gz", ("train",), ("test",), "meta"
)


def _expected(spec: CifarSpec) -> str:
    return f"the {spec.title} python batches ({spec.files[0]} … {', '.join(spec.files[-2:])})"


def locate_cifar(root: str | Path, spec: CifarSpec) -> Path:
    """The folder or ``.tar.gz`` archive under ``root`` that holds ``spec``'s files.

    Accepts ``root`` = the folder itself, its parent (folder or archive inside), or the archive.
    Raises :class:`DatasetNotFoundError` when none of these exist.
    """
    root = Path(root).expanduser()
    if root.is_file():
        if root.name != spec.archive and not _looks_compressed(root):
            raise DatasetNotFoundError(
                f"{root} is a file, not a folder, and not {spec.title}'s archive ({spec.archive}); pass root= "
                f"(--data-dir) the folder that holds {spec.folder}/ or {spec.archive}, or the archive itself")
        return root  # an archive; opening it checks that it is one
    if root.is_dir() and (root.name == spec.folder or any((root / f).exists() for f in spec.files)):
        return root
    if (root / spec.folder).is_dir():
        return root / spec.folder
    if (root / spec.archive).is_file():
        return root / spec.archive
    raise DatasetNotFoundError(
        f"{root / spec.folder} not found: expected {_expected(spec)} in that folder, or {spec.archive} in {root}; "
        "pass download=True (--download) or root= the folder that contains them"
    )


def _looks_compressed(path: Path) -> bool:
    """Whether ``path`` starts as a gzip file or holds a tar header (an archive under another name)."""
    try:
        with path.open("rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head[:2] == b"\x1f\x8b" or head[257:262] == b"ustar"


def _read_folder(folder: Path, names: list[str], spec: CifarSpec) -> dict[str, tuple[bytes, str]]:
    missing = [folder / name for name in names if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{missing[0]} not found: the {spec.title} folder {folder} is incomplete (expected {_expected(spec)}); "
            "delete it and re-download (download=True)"
        )
    return {name: ((folder / name).read_bytes(), str(folder / name)) for name in names}


def _read_archive(archive: Path, names: list[str], spec: CifarSpec) -> dict[str, tuple[bytes, str]]:
    """Read ``spec.folder/<name>`` members straight from the tar (one sequential pass)."""
    out: dict[str, tuple[bytes, str]] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                parts = [p for p in PurePosixPath(member.name).parts if p != "."]
                if len(parts) == 2 and parts[0] == spec.folder and parts[1] in names and member.isfile():
                    f = tar.extractfile(member)  # never None for a regular file
                    out[parts[1]] = (f.read(), f"{archive}:{member.name}")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise DatasetFormatError(
            # tarfile lists each method it tried on a line of its own: one line here, the fix last
            f"{archive}: cannot read it as a tar archive ({type(exc).__name__}: {' '.join(str(exc).split())}); "
            f"expected {spec.archive}, the official archive — it is corrupted or truncated: delete it and "
            "download it again (download=True)"
        ) from exc
    missing = [n for n in names if n not in out]
    if missing:
        raise FileNotFoundError(
            f"{archive}: no member {spec.folder}/{missing[0]}; expected {_expected(spec)} under {spec.folder}/ — "
            "this is not the official python-version archive, or it is incomplete"
        )
    return out


def _field(batch: dict, key: str, path: str) -> Any:
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    keys = ", ".join(repr(k) for k in batch)
    raise DatasetFormatError(f"{path}: no {key.encode()!r} entry (found {keys}); expected a CIFAR python batch")


def parse_batch(obj: Any, path: str, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 3, 32, 32) and labels int64 (N,) of one unpickled batch dict."""
    if not isinstance(obj, dict):
        raise DatasetFormatError(f"{path}: unpickled a {type(obj).__name__}, expected a dict (a CIFAR python batch)")
    data = _field(obj, "data", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _ROW:
        found = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DatasetFormatError(f"{path}: b'data' is a {found}, expected uint8 (N, {_ROW}) — rows of 3×32×32 pixels")
    labels = np.asarray(_field(obj, label_key, path))
    if labels.ndim != 1 or labels.shape[0] != data.shape[0] or (labels.size and labels.dtype.kind not in "iu"):
        raise DatasetFormatError(
            f"{path}: b'{label_key}' has shape {labels.shape} ({labels.dtype}), expected {data.shape[0]} integer "
            "labels, one per row of b'data'"
        )
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
        raise DatasetFormatError(f"{path}: labels out of range: found {bad}, expected 0..{num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels


def _class_names(meta: Any, path: str, key: str) -> list[str]:
    if not isinstance(meta, dict):
        raise DatasetFormatError(f"{path}: unpickled a {type(meta).__name__}, expected the CIFAR meta dict")
    names = _field(meta, key, path)
    if not isinstance(names, (list, tuple)) or not names:
        raise DatasetFormatError(f"{path}: {key!r} is {type(names).__name__}, expected a non-empty list of names")
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names]


def load_cifar(root: str | Path, spec: CifarSpec, split: str = "train", label: str = "fine") -> ArrayDataset:
    """Load a CIFAR split as an :class:`ArrayDataset`: images uint8 (N, 3, 32, 32).

    Args:
        root: the extracted folder, its parent, or the ``.tar.gz`` archive (read in place, nothing is extracted).
        spec: :data:`CIFAR10` or :data:`CIFAR100`.
        split: ``"train"`` (CIFAR-10: batches 1–5 in order, 50,000 images) or ``"test"``.
        label: CIFAR-100 only: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).
    """
    check_split(split)
    if spec is CIFAR100:
        if label not in ("fine", "coarse"):
            raise ValueError(f"label={label!r}: expected 'fine' (100 classes) or 'coarse' (20 superclasses)")
        label_key, names_key = f"{label}_labels", f"{label}_label_names"
    else:
        label_key, names_key = "labels", "label_names"
    location = locate_cifar(root, spec)
    names = [spec.meta, *(spec.train if split == "train" else spec.test)]
    read = _read_folder if location.is_dir() else _read_archive
    raw = read(location, names, spec)

    meta_bytes, meta_path = raw[spec.meta]
    classes = _class_names(load_pickle(meta_bytes, meta_path), meta_path, names_key)
    batches, kinds = [], {}
    for name in names[1:]:
        blob, path = raw.pop(name)
        batches.append(parse_batch(load_pickle(blob, path), path, label_key, len(classes)))
        kinds[name] = identify(path, hashlib.md5(blob, usedforsecurity=False).hexdigest(),
                               batches[-1][1], spec.title, name)
        del blob
    images, labels = zip(*batches)
    name = spec.name if label == "fine" else f"{spec.name}_coarse"
    images = torch.from_numpy(np.ascontiguousarray(np.concatenate(images)))
    return ArrayDataset(images, torch.from_numpy(np.concatenate(labels)), classes, name, *DATASET_STATS[spec.name],
                        describe(str(location), spec.title, split, kinds))
