"""MNIST and Fashion-MNIST from their official IDX files (gzip-compressed or not).

IDX (http://yann.lecun.com/exdb/mnist/): a big-endian header — two zero bytes, a type byte
(0x08 = unsigned byte), the number of dimensions, then each dimension as a uint32 — followed by
the values, row-major. Images are magic 2051 (0x00000803: uint8, 3 dims N×28×28), labels magic
2049 (0x00000801: uint8, 1 dim N).
"""

from __future__ import annotations

import gzip
import hashlib
import math
import struct
import zlib
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

__all__ = ["FASHION_MNIST_CLASSES", "IMAGES_MAGIC", "LABELS_MAGIC", "load_idx_dataset", "read_idx"]

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_SUBDIRS = {"mnist": ("mnist", "MNIST/raw"), "fashion_mnist": ("fashion-mnist", "FashionMNIST/raw")}
# The md5 of each official label file's content (the IDX bytes, uncompressed: a copy may be
# gzipped anew), which tells the datasets apart; their file names are the same.
KNOWN_LABELS = {
    "a25bea736e30d166cdddb491f175f624": ("mnist", "train"),
    "27ae3e4e09519cfbb04c329615203637": ("mnist", "test"),
    "9018921c3c673c538a1fc5bad174d6f9": ("fashion_mnist", "train"),
    "15d484375f8d13e6eb1aabb0c3f46965": ("fashion_mnist", "test"),
}
# The same for the image files (published md5s of the uncompressed IDX files).
KNOWN_IMAGES = {
    "6bbc9ace898e44ae57da46a324031adb": ("mnist", "train"),
    "2646ac647ad5339dbf082846283269ea": ("mnist", "test"),
    "f4a8712d7a061bf5bd6d2ca38dc4d50a": ("fashion_mnist", "train"),
    "8181f5470baa50b63fa0f6fddb340f0a": ("fashion_mnist", "test"),
}
_NAMES = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(2)
    if head != b"\x1f\x8b":  # gzip magic; sniffed so a mis-named file still reads
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, OSError, zlib.error) as exc:
        raise DatasetFormatError(
            f"{path}: the gzip stream is truncated or corrupted ({type(exc).__name__}: {exc}); "
            "delete it and re-download (download=True)"
        ) from exc


def read_idx(path: str | Path, magic: int, shape: tuple[int | None, ...], what: str = "values") -> np.ndarray:
    """Read a uint8 IDX file and check its header.

    Args:
        path: the file, gzip-compressed or not.
        magic: expected magic number (2051 images, 2049 labels).
        shape: expected dimensions; ``None`` matches any size (e.g. the count N).
        what: noun for messages ("pixels", "labels").

    Returns:
        uint8 array of the header's shape.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DatasetFormatError(f"{path}: {len(data)} bytes, shorter than the 4-byte IDX magic number")
    (found_magic,) = struct.unpack(">I", data[:4])
    if found_magic != magic:
        raise DatasetFormatError(
            f"{path}: IDX magic number is {found_magic}, expected {magic} (uint8, {len(shape)}-D {what}); "
            "this is not the right IDX file, or it is corrupted"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetFormatError(f"{path}: {len(data)} bytes, shorter than its {header}-byte IDX header")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    if any(want is not None and got != want for got, want in zip(dims, shape)):
        want_s = "×".join("N" if w is None else str(w) for w in shape)
        raise DatasetFormatError(f"{path}: IDX dimensions are {'×'.join(map(str, dims))}, expected {want_s}")
    count = math.prod(dims)
    payload = len(data) - header
    if payload != count:
        raise DatasetFormatError(
            f"{path}: expected {'×'.join(map(str, dims))} = {count} bytes of {what} after the header, "
            f"found {payload} — the file is {'truncated' if payload < count else 'too long'}; "
            "delete it and re-download (download=True)"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _locate(root: Path, name: str, split: str) -> tuple[Path, Path]:
    stems = _FILES[split]
    folders = [root / sub for sub in _SUBDIRS[name]] + [root]
    for folder in folders:
        # the uncompressed file first: it is faster to read
        found = [next((p for p in (folder / s, folder / f"{s}.gz") if p.is_file()), None) for s in stems]
        if all(found):
            return found[0], found[1]
        if any(found):
            missing = stems[found.index(None)]
            raise FileNotFoundError(
                f"{folder / missing}[.gz] not found: {folder} has the {split} "
                f"{'labels' if found[1] else 'images'} but not the other file; restore it or re-download "
                "(download=True)"
            )
    tried = ", ".join(str(f) for f in folders)
    raise DatasetNotFoundError(
        f"{name} {split} files not found: expected {stems[0]}[.gz] and {stems[1]}[.gz] in one of {tried}; "
        "pass download=True (--download) or root= the folder that contains them"
    )


def check_known_labels(path: Path, labels: np.ndarray, name: str, split: str) -> bool:
    """Refuse the label file ``path`` (its ``labels``, as :func:`read_idx` read them) when it is,
    by its content (:data:`KNOWN_LABELS`: the IDX bytes, header and labels), another dataset's or
    another split's official one: MNIST and Fashion-MNIST share their file names, so a folder of
    the one passes for the other. A file that is no official one (a subset, your own) passes.
    Returns whether it is the official file asked for."""
    content = struct.pack(">II", LABELS_MAGIC, labels.shape[0]) + labels.tobytes()
    return _check_known(path, content, KNOWN_LABELS, "labels", name, split)


def check_known_images(path: Path, images: np.ndarray, name: str, split: str) -> bool:
    """:func:`check_known_labels` for the image file ``path`` (its ``images`` (N, 28, 28)), by
    :data:`KNOWN_IMAGES`."""
    content = struct.pack(">IIII", IMAGES_MAGIC, images.shape[0], 28, 28) + images.tobytes()
    return _check_known(path, content, KNOWN_IMAGES, "images", name, split)


def _check_known(path: Path, content: bytes, table: dict, kind: str, name: str, split: str) -> bool:
    known = table.get(hashlib.md5(content, usedforsecurity=False).hexdigest())
    if known is not None and known != (name, split):
        what, wanted = f"{_NAMES[known[0]]}'s {known[1]} {kind}", f"{_NAMES[name]}'s {split} files"
        raise DatasetFormatError(f"{path}: these are {what} (the official file), and {_NAMES[name]} {split} was "
                                 f"asked for; point the data folder at {wanted}, or ask for the dataset it holds")
    return known == (name, split)


def load_idx_dataset(root: str | Path, name: str = "mnist", split: str = "train") -> ArrayDataset:
    """MNIST (``name="mnist"``) or Fashion-MNIST (``"fashion_mnist"``): images uint8 (N, 1, 28, 28).

    Files are looked for in ``root/mnist`` (``root/fashion-mnist``), torchvision's
    ``root/MNIST/raw`` (``root/FashionMNIST/raw``), then ``root`` itself.
    """
    if name not in _SUBDIRS:
        raise ValueError(f"name={name!r}: expected 'mnist' or 'fashion_mnist'")
    check_split(split)
    images_path, labels_path = _locate(Path(root).expanduser(), name, split)
    images = read_idx(images_path, IMAGES_MAGIC, (None, 28, 28), "pixels")
    labels = read_idx(labels_path, LABELS_MAGIC, (None,), "labels")
    official = check_known_labels(labels_path, labels, name, split)
    official_images = check_known_images(images_path, images, name, split)
    if labels.shape[0] != images.shape[0]:
        raise DatasetFormatError(
            f"{labels_path}: {labels.shape[0]} labels but {images_path} has {images.shape[0]} images; "
            "expected one label per image (are the files from the same split?)"
        )
    if labels.size and labels.max() >= 10:
        raise DatasetFormatError(f"{labels_path}: labels out of range: found {int(labels.max())}, expected 0..9")
    classes = list(FASHION_MNIST_CLASSES) if name == "fashion_mnist" else [str(i) for i in range(10)]
    images = torch.from_numpy(images.reshape(-1, 1, 28, 28).copy())
    source = (f"{_NAMES[name]} {split}: the official files" if official and official_images else
              f"{_NAMES[name]} {split}: the official label file, images that are no published copy" if official else
              f"{_NAMES[name]} {split}: the official image file, labels that are no published copy"
              if official_images else f"{_NAMES[name]} {split}: files that are no published copy")
    return ArrayDataset(images, torch.from_numpy(labels.astype(np.int64)), classes, name, *DATASET_STATS[name],
                        source)
