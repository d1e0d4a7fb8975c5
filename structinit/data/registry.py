"""``load_dataset(name, root, split)``: one entry point for every supported dataset, each a
:class:`DatasetLoader` in :data:`DATASET_LOADERS` (a :class:`~structinit.utils.Registry`, like the schemes')."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structinit.data.cifar import CIFAR10, CIFAR100, CifarSpec, load_cifar, locate_cifar
from structinit.data.datasets import ArrayDataset, DatasetNotFoundError, check_split
from structinit.data.digits import load_digits
from structinit.data.download import download as download_files
from structinit.data.idx import load_idx_dataset
from structinit.data.imagefolder import load_image_folder
from structinit.data.svhn import load_svhn
from structinit.utils import Registry

__all__ = ["DATASETS", "DATASET_LOADERS", "DatasetLoader", "FASHION_MNIST_DEBIAN_ROOT", "canonical_name",
           "default_root", "load_dataset"]

# Debian/Ubuntu package dataset-fashion-mnist installs the official IDX .gz files here.
FASHION_MNIST_DEBIAN_ROOT = Path("/usr/share/datasets/fashion-mnist")
_ALIASES = {"cifar_10": "cifar10", "cifar_100": "cifar100", "fashionmnist": "fashion_mnist", "fmnist": "fashion_mnist"}


@dataclass(frozen=True)
class DatasetLoader:
    """How :func:`load_dataset` reads one dataset.

    Attributes:
        load: ``load(root, split, **options) -> ArrayDataset``; raises
            :class:`DatasetNotFoundError` when ``root`` does not hold the files.
        options: the keyword options ``load`` accepts.
        root_mode: ``"search"`` (files looked for under ``root``, else :func:`default_root`;
            downloadable), ``"required"`` (the user's own folder: no default, no download) or
            ``"ignored"`` (bundled with a package).
        system_roots: folders tried before :func:`default_root` when no ``root`` is given.
        download_into: the folder to download into for a ``root`` that was tried
            (default: that folder itself).
        file_root: for a dataset whose ``root`` may be a file (CIFAR's archive, read in place),
            the check that a file is one it reads (a :class:`DatasetNotFoundError` otherwise);
            None when ``root`` is a folder.
    """

    load: Callable[..., ArrayDataset]
    options: frozenset[str] = frozenset()
    root_mode: str = "search"
    system_roots: tuple[Path, ...] = ()
    download_into: Callable[[Path], Path] | None = None
    file_root: Callable[[Path], object] | None = None


DATASET_LOADERS: Registry[DatasetLoader] = Registry("dataset")


def _cifar_download_folder(spec: CifarSpec) -> Callable[[Path], Path]:
    # root named the extracted folder or the archive itself: download beside it
    return lambda target: target.parent if target.name in (spec.folder, spec.archive) else target


DATASET_LOADERS.register("cifar10", DatasetLoader(
    lambda root, split: load_cifar(root, CIFAR10, split), download_into=_cifar_download_folder(CIFAR10),
    file_root=lambda path: locate_cifar(path, CIFAR10)))
DATASET_LOADERS.register("cifar100", DatasetLoader(
    lambda root, split, **options: load_cifar(root, CIFAR100, split, **options), frozenset({"label"}),
    download_into=_cifar_download_folder(CIFAR100), file_root=lambda path: locate_cifar(path, CIFAR100)))
DATASET_LOADERS.register("svhn", DatasetLoader(load_svhn))
DATASET_LOADERS.register("mnist", DatasetLoader(lambda root, split: load_idx_dataset(root, "mnist", split)))
DATASET_LOADERS.register("fashion_mnist", DatasetLoader(
    lambda root, split: load_idx_dataset(root, "fashion_mnist", split), system_roots=(FASHION_MNIST_DEBIAN_ROOT,)))
DATASET_LOADERS.register("imagefolder", DatasetLoader(
    load_image_folder, frozenset({"size", "stats"}), root_mode="required"))
DATASET_LOADERS.register("digits", DatasetLoader(lambda root, split: load_digits(split), root_mode="ignored"))

DATASETS = tuple(DATASET_LOADERS)  # the built-in names, in registration order


def default_root() -> Path:
    """Where datasets live when no ``root`` is given: ``$STRUCTINIT_DATA``, else ``~/.cache/structinit/datasets``."""
    env = os.environ.get("STRUCTINIT_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "structinit" / "datasets"


def canonical_name(name: str) -> str:
    """The registered name of dataset ``name`` (aliases and spellings such as ``CIFAR-10``
    resolved); a ValueError listing the supported datasets otherwise."""
    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in DATASET_LOADERS:
        raise ValueError(f"dataset {name!r} is not supported; expected one of {', '.join(DATASET_LOADERS)}")
    return key


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
    name = canonical_name(name)
    check_split(split)
    entry = DATASET_LOADERS[name]
    unknown = set(options) - entry.options
    if unknown:
        allowed = ", ".join(sorted(entry.options)) or "none"
        raise TypeError(
            f"load_dataset({name!r}): unexpected option(s) {', '.join(sorted(unknown))}; allowed: {allowed}"
        )
    if entry.root_mode == "ignored":
        return entry.load(None, split, **options)
    if entry.root_mode == "required":
        if root is None:
            raise ValueError(f"load_dataset({name!r}): root is required — the folder with one sub-folder per class")
        return entry.load(root, split, **options)

    roots = [Path(root).expanduser()] if root is not None else [*entry.system_roots, default_root()]
    missing: list[DatasetNotFoundError] = []
    for r in roots:
        try:
            return entry.load(r, split, **options)
        except DatasetNotFoundError as exc:
            missing.append(exc)
    given = "root" if root is not None else "$STRUCTINIT_DATA"
    if (root is not None or os.environ.get("STRUCTINIT_DATA")) and roots[-1].is_file():  # no archive it can read
        raise DatasetNotFoundError(f"{given}={roots[-1]} is a file, not a folder, and holds no {name} data; give "
                                   f"the folder that holds the {name} files (or a folder to download them into)")
    if not download:
        if len(missing) == 1:
            raise missing[0]
        raise DatasetNotFoundError(" — and — ".join(str(e) for e in missing))
    target = roots[-1]  # never a system folder: it is the user's cache or their explicit root
    if entry.download_into is not None:
        target = entry.download_into(target)
    download_files(name, target)
    return entry.load(target, split, **options)
