"""A folder of images, one sub-folder per class (torchvision's ImageFolder layout), loaded into memory.

    root/[<split>/]<class name>/<image>.png|jpg|jpeg|bmp|webp

Class indices follow the sorted class-folder names. Every image must have the same size unless
``size=(h, w)`` is given; images are converted to RGB, or kept single-channel ("L") when all of
them are grayscale.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from structinit.data.datasets import (
    ArrayDataset,
    DatasetFormatError,
    DatasetNotFoundError,
    check_split,
    normalisation_stats,
)
from structinit.utils import is_int
from structinit.utils.optional_imports import require

__all__ = ["IMAGE_EXTENSIONS", "find_split_dir", "load_image_folder"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
_GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")
# Folder names tried for each split when root has split folders (ImageNet calls its test split "val").
_SPLIT_DIRS = {"train": ("train",), "test": ("test", "val")}


def find_split_dir(root: str | Path, split: str) -> Path:
    """``root/<split>`` when ``root`` has split folders, else ``root`` itself (only for split="train")."""
    check_split(split)
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetNotFoundError(
            f"{root} not found: expected a folder with one sub-folder of images per class; pass root= that folder"
        )
    has_splits = any((root / d).is_dir() for names in _SPLIT_DIRS.values() for d in names)
    if not has_splits:
        if split == "test":
            # Falling back to root would evaluate on the training images without a word.
            raise DatasetNotFoundError(
                f"{root} has no test/ (or val/) folder, so it has only one split; load split='train' and carve "
                "a test set with holdout_split(ds, n), or arrange the images as root/train/<class>, root/test/<class>"
            )
        return root
    for d in _SPLIT_DIRS[split]:
        if (root / d).is_dir():
            return root / d
    raise DatasetNotFoundError(
        f"{root / _SPLIT_DIRS[split][0]} not found: {root} has split folders but none for split={split!r}"
    )


def _class_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _read_image(path: Path, size: tuple[int, int] | None) -> np.ndarray:
    """uint8 (H, W) for grayscale files, (H, W, 3) otherwise."""
    Image = require("PIL.Image", "loading an image folder")  # only the harness extra installs pillow
    try:
        with Image.open(path) as im:
            im.load()
            im = im.convert("L" if im.mode in _GRAY_MODES else "RGB")
            if size is not None and im.size != (size[1], size[0]):
                im = im.resize((size[1], size[0]), Image.BILINEAR)  # PIL sizes are (W, H)
            return np.asarray(im, dtype=np.uint8)
    except (Image.UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise DatasetFormatError(
            f"{path}: cannot be read as an image ({type(exc).__name__}: {exc}); remove or replace the file"
        ) from exc


def _read_split(folder: Path, size: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    classes = _class_names(folder)
    if not classes:
        raise DatasetFormatError(
            f"{folder}: no class folders; expected {folder}/<class name>/<image> with one folder per class"
        )
    items = []
    for index, name in enumerate(classes):
        files = sorted(p for p in (folder / name).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        if not files:
            raise DatasetFormatError(
                f"{folder / name}: empty class folder; expected images with extensions {', '.join(IMAGE_EXTENSIONS)}"
            )
        items += [(f, index) for f in files]
    arrays = []
    for path, _ in items:
        a = _read_image(path, size)
        if arrays and a.shape[:2] != arrays[0].shape[:2]:
            (h, w), (h0, w0) = a.shape[:2], arrays[0].shape[:2]
            raise DatasetFormatError(
                f"{path}: image is {h}×{w} (H×W) but {items[0][0]} is {h0}×{w0}; all images must have the same "
                "size — pass size=(h, w) to resize them"
            )
        arrays.append(a)
    if all(a.ndim == 2 for a in arrays):
        images = np.stack(arrays)[:, None]  # (N, 1, H, W)
    else:
        # mixed folder: grayscale images become RGB by repeating their one channel
        images = np.stack([a if a.ndim == 3 else np.repeat(a[..., None], 3, axis=2) for a in arrays])
        images = images.transpose(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)
    labels = torch.tensor([label for _, label in items], dtype=torch.int64)
    return torch.from_numpy(np.ascontiguousarray(images)), labels, classes


def load_image_folder(
    root: str | Path,
    split: str = "train",
    size: tuple[int, int] | None = None,
    stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
    name: str = "imagefolder",
) -> ArrayDataset:
    """Load ``root[/<split>]/<class>/<image>`` into memory: images uint8 (N, C, H, W), C = 1 or 3.

    Args:
        root: the folder; with ``train/`` and ``test/`` (or ``val/``) sub-folders, ``split`` picks one.
        size: ``(h, w)`` to resize every image to (bilinear); default: all must be the same size.
        stats: ``(mean, std)`` to attach; default: computed from the *training* images (for
            split="test" that means loading the train folder too — pass ``train.mean, train.std``
            to skip that).
    """
    if size is not None:
        if len(size) != 2 or not all(is_int(s) and s > 0 for s in size):
            raise ValueError(f"size={size!r}: expected (height, width), two positive ints")
        size = (int(size[0]), int(size[1]))
    folder = find_split_dir(root, split)
    train_folder = find_split_dir(root, "train")
    if split != "train" and _class_names(folder) != _class_names(train_folder):
        raise DatasetFormatError(
            f"{folder}: class folders {_class_names(folder)} differ from {train_folder}'s "
            f"{_class_names(train_folder)}; both splits need the same classes so that label indices agree"
        )
    images, labels, classes = _read_split(folder, size)
    if stats is None:
        # normalise every split with the training statistics, as for the datasets with constants
        stats = normalisation_stats(images if split == "train" else _read_split(train_folder, size)[0])
    mean, std = stats
    return ArrayDataset(images=images, labels=labels, classes=classes, name=name, mean=mean, std=std)
