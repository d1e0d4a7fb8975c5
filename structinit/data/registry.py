"""``load_dataset(name, root, split)``: one entry point for every supported dataset."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from structinit.data.cifar import CIFAR10, CIFAR100, load_cifar
from structinit.data.datasets import ArrayDataset, DatasetNotFoundError, check_split
from structinit.data.digits import load_digits
from structinit.data.download import download as download_files
from structinit.data.idx import load_idx_dataset
from structinit.data.imagefolder import load_image_folder
from structinit.data.svhn import load_svhn

__all__ = ["DATASETS", "FASHION_MNIST_DEBIAN_ROOT", "default_root", "load_dataset"]

DATASETS = ("cifar10", "cifar100", "svhn", "mnist", "fashion_mnist", "imagefolder", "digits")
# Debian/Ubuntu package dataset-fashion-mnist installs the official IDX .gz files here.
FASHION_MNIST_DEBIAN_ROOT = Path("/usr/share/datasets/fashion-mnist")
_ALIASES = {"cifar_10": "cifar10", "cifar_100": "cifar100", "fashionmnist": "fashion_mnist", "fmnist": "fashion_mnist"}
# keyword options each loader understands
_OPTIONS = {"cifar100": {"label"}, "imagefolder": {"size", "stats"}}


def default_root() -> Path:
    """Where datasets live when no ``root`` is given: ``$STRUCTINIT_DATA``, else ``~/.cache/structinit/datasets``."""
    env = os.environ.get("STRUCTINIT_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "structinit" / "datasets"


def _canonical(name: str) -> str:
    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in DATASETS:
        raise ValueError(f"dataset {name!r} is not supported; expected one of {', '.join(DATASETS)}")
    return key


def _loader(name: str, split: str, options: dict[str, Any]) -> Callable[[Path], ArrayDataset]:
    if name == "cifar10":
        return lambda root: load_cifar(root, CIFAR10, split)
    if name == "cifar100":
        return lambda root: load_cifar(root, CIFAR100, split, **options)
    if name == "svhn":
        return lambda root: load_svhn(root, split)
    return lambda root: load_idx_dataset(root, name, split)  # mnist, fashion_mnist


def load_dataset(
    name: str, root: str | Path | None = None, split: str = "train", download: bool = False, **options: Any
) -> ArrayDataset:
    """Load a whole split into memory as an :class:`ArrayDataset` (images uint8 (N, C, H, W)).

    Args:
        name: one of :data:`DATASETS`.
        root: where the files are (see each loader for the layouts accepted). Default:
            :func:`default_root`; for fashion_mnist, ``/usr/share/datasets/fashion-mnist`` is
            tried first. ``imagefolder`` requires it; ``digits`` ignores it (bundled with scikit-learn).
        split: ``"train"`` or ``"test"``.
        download: fetch and verify the official files into ``root`` when they are not found.
        options: ``label="fine"|"coarse"`` (cifar100); ``size=(h, w)``, ``stats=(mean, std)`` (imagefolder).

    Returns images uint8 (N, C, H, W): cifar10/cifar100/svhn (N, 3, 32, 32), mnist/fashion_mnist
    (N, 1, 28, 28), digits (N, 1, 8, 8).
    """
    name = _canonical(name)
    check_split(split)
    unknown = set(options) - _OPTIONS.get(name, set())
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS.get(name, ()))) or "none"
        raise TypeError(
            f"load_dataset({name!r}): unexpected option(s) {', '.join(sorted(unknown))}; allowed: {allowed}"
        )
    if name == "digits":
        return load_digits(split)
    if name == "imagefolder":
        if root is None:
            raise ValueError("load_dataset('imagefolder'): root is required — the folder with one sub-folder per class")
        return load_image_folder(root, split, **options)

    load = _loader(name, split, options)
    if root is not None:
        roots = [Path(root).expanduser()]
    elif name == "fashion_mnist":
        roots = [FASHION_MNIST_DEBIAN_ROOT, default_root()]
    else:
        roots = [default_root()]
    missing: list[DatasetNotFoundError] = []
    for r in roots:
        try:
            return load(r)
        except DatasetNotFoundError as exc:
            missing.append(exc)
    if not download:
        if len(missing) == 1:
            raise missing[0]
        raise DatasetNotFoundError(" — and — ".join(str(e) for e in missing))
    target = roots[-1]  # never the system folder: it is the user's cache or their explicit root
    spec = CIFAR10 if name == "cifar10" else CIFAR100
    if name in ("cifar10", "cifar100") and target.name in (spec.folder, spec.archive):
        target = target.parent  # root named the folder or archive itself; download beside it
    download_files(name, target)
    return load(target)
