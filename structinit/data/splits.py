"""Deterministic, class-balanced subsets and held-out splits.

Every choice here goes through :func:`stable_permutation`, a splitmix64 hash of (seed, index):
the same seed gives the same images on every machine and every numpy/torch version (library
RNG streams are not guaranteed to stay fixed across versions), which keeps benchmark subsets
comparable over time.
"""

from __future__ import annotations

import numpy as np
import torch

from structinit.data.datasets import ArrayDataset
from structinit.utils import check_int

__all__ = ["holdout_split", "stable_permutation", "stratified_indices", "stratified_subset"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def stable_permutation(n: int, seed: int) -> np.ndarray:
    """int64 (n,): a permutation of ``range(n)`` that depends only on ``(n, seed)``.

    Sorts the indices by splitmix64(offset(seed) + i); splitmix64 is a bijection on 64-bit
    integers, so keys never tie.
    """
    n, seed = check_int("n", n), check_int("seed", seed)
    offset = np.uint64(((seed & _MASK) * _GOLDEN) & _MASK)  # python ints: no overflow warnings
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + offset + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.argsort(z, kind="stable").astype(np.int64)


def _per_class_quota(counts: np.ndarray, size: int, seed: int) -> np.ndarray:
    """How many to take from each class (the rule is :func:`stratified_subset`'s); the total is always ``size``."""
    c = len(counts)
    order = stable_permutation(c, seed)
    quota = np.full(c, size // c, dtype=np.int64)
    quota[order[: size % c]] += 1
    take = np.minimum(quota, counts)
    short = size - int(take.sum())
    while short > 0:
        for k in order:
            if short and take[k] < counts[k]:
                take[k] += 1
                short -= 1
    return take


def stratified_indices(labels: torch.Tensor, num_classes: int, size: int, seed: int = 0) -> torch.Tensor:
    """int64 (size,), sorted: indices of a class-balanced sample of ``labels`` (N,).

    Within a class the picks are a prefix of a seeded permutation, so for a fixed seed a larger
    ``size`` gives a superset of a smaller one (nested training subsets).
    """
    size, seed = check_int("size", size), check_int("seed", seed)
    n = labels.shape[0]
    if size > n:
        raise ValueError(f"size={size}: larger than the {n} images available; expected {num_classes}..{n}")
    if size < num_classes:
        raise ValueError(
            f"size={size}: smaller than the {num_classes} classes, so some class would get no image; "
            f"expected {num_classes}..{n}"
        )
    y = labels.cpu().numpy()
    counts = np.bincount(y, minlength=num_classes)
    take = _per_class_quota(counts, size, seed)
    picks = []
    for k in range(num_classes):
        members = np.flatnonzero(y == k)
        # distinct stream per class, derived from the seed (not utils.derive_seed: it reduces
        # mod 2⁶³−1, which would change the subsets that negative seeds give)
        perm = stable_permutation(len(members), seed * 1_000_003 + k)
        picks.append(members[perm[: take[k]]])
    return torch.from_numpy(np.sort(np.concatenate(picks)))


def stratified_subset(ds: ArrayDataset, size: int, seed: int = 0) -> ArrayDataset:
    """``size`` images of ``ds`` with classes as balanced as possible, in their original order.

    Each class gets ``size // num_classes`` images and the remainder goes one each to the first
    classes of a seeded class order (a class with too few images gives its shortfall to the
    others). Deterministic for a seed on every platform; nested in ``size`` for a fixed seed.
    Raises ``ValueError`` if ``size > len(ds)`` or ``size < ds.num_classes``.
    """
    return ds.subset(stratified_indices(ds.labels, ds.num_classes, size, seed))


def holdout_split(
    ds: ArrayDataset, holdout: int, seed: int | None = None, mode: str = "stratified"
) -> tuple[ArrayDataset, ArrayDataset]:
    """Carve ``holdout`` images out of ``ds``: returns ``(train, held_out)``, disjoint, covering ``ds``.

    Args:
        holdout: number of held-out images, ``0 < holdout < len(ds)``.
        seed: for ``mode="stratified"`` (default 0); ignored by ``"last"``.
        mode: ``"stratified"`` — a class-balanced sample (see :func:`stratified_subset`);
            ``"last"`` — the last ``holdout`` images, in order.

    Both parts keep the original order and ``ds.mean``/``ds.std``.

    The lossless CIFAR-10 benchmark (the local ``test_batch`` is partly JPEG-recovered): train
    on subsets of batches 1–4 and test on batch 5, the last 10,000 training images::

        pool, test = holdout_split(load_dataset("cifar10", root), 10_000, mode="last")
        train = stratified_subset(pool, 4_000, seed=0)
    """
    holdout = check_int("holdout", holdout)
    n = len(ds)
    if not 0 < holdout < n:
        raise ValueError(f"holdout={holdout}: expected 0 < holdout < {n} (the dataset's size)")
    if mode == "last":
        keep = torch.arange(n - holdout)
        held = torch.arange(n - holdout, n)
    elif mode == "stratified":
        held = stratified_indices(ds.labels, ds.num_classes, holdout, 0 if seed is None else seed)
        mask = torch.ones(n, dtype=torch.bool)
        mask[held] = False
        keep = mask.nonzero().squeeze(1)
    else:
        raise ValueError(f"mode={mode!r}: expected 'stratified' or 'last'")
    return ds.subset(keep), ds.subset(held)
