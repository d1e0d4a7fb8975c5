"""The training batches of an image run, and the worker processes that augment them.

Batch ``i`` of epoch ``e`` on rank ``r`` is a pure function of (seed, e, r, i): the epoch's
permutation is drawn from (seed, e) and the batch's augmentation from its own generator,
(seed, e, r, 1, i). So the batches a seed gives are the same wherever they are made: on the
training device inside the step, on the CPU in a background thread (``cpu_prefetch``), or in
any number of worker processes (``aug_workers``), in any order.

:class:`AugmentWorkers` keeps its processes for the whole run (a GPU epoch of CIFAR-10 lasts
seconds, and starting 8 processes every epoch would cost a share of it). Each worker augments
whole batches of the uint8 images on one CPU thread and returns them through shared memory; a
thread of the training process copies each into pinned memory, so that the copy to the GPU is
queued behind the running step and never waits for it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from structinit.utils import derived_generator, to_device

__all__ = ["AUGMENT_STREAM", "AugmentWorkers", "EpochBatches", "batch_generator", "epoch_order"]

AUGMENT_STREAM = 1  # the purpose key of the augmentation's generators (derive_seed's 4th key)
WORKER_PREFETCH = 2  # batches each worker makes ahead: 8 workers keep 16 batches in flight


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The permutation of ``n`` training images that epoch ``epoch`` (0-based) of seed ``seed`` visits."""
    return torch.randperm(n, generator=derived_generator(seed, epoch))


def batch_generator(seed: int, epoch: int, rank: int, index: int) -> torch.Generator:
    """The generator of the augmentation of batch ``index`` of epoch ``epoch`` on rank ``rank``."""
    return derived_generator(seed, epoch, rank, AUGMENT_STREAM, index)


class EpochBatches(Dataset):
    """The augmented uint8 batches of a run's epochs, one item per (epoch, batch).

    Args:
        images: (N, C, H, W) uint8 training images, on any device.
        augment: the run's :class:`~structinit.augment.Augment` (a callable ``(x, generator) → x``).
        seed, rank, world: the run's seed and this process's share of the images.
        per_rank: images per batch on this rank; ``steps``: batches per epoch.

    Item ``key`` is batch ``key % steps`` of epoch ``key // steps``, (per_rank, C, H, W) uint8
    on the images' device. :meth:`indices` gives the image indices of a batch, for its labels.
    """

    def __init__(self, images: torch.Tensor, augment, seed: int, rank: int, world: int, per_rank: int, steps: int):
        self.images, self.augment = images, augment
        self.seed, self.rank, self.world, self.per_rank, self.steps = seed, rank, world, per_rank, steps
        self._order: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (epoch, on the CPU, on the images' device)

    def _orders(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._order is None or self._order[0] != epoch:  # one draw per epoch, one copy to the device
            order = epoch_order(self.seed, epoch, len(self.images))[self.rank :: self.world]
            order = order[: self.steps * self.per_rank]
            self._order = (epoch, order, to_device(order, self.images.device))
        return self._order[1:]

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's image indices of epoch ``epoch`` (on the CPU) in visiting order, ``steps · per_rank`` of them."""
        return self._orders(epoch)[0]

    def indices(self, epoch: int, index: int, on_device: bool = False) -> torch.Tensor:
        """The image indices of batch ``index`` of epoch ``epoch``, on the CPU (``on_device``: the images' device)."""
        return self._orders(epoch)[int(on_device)][index * self.per_rank : (index + 1) * self.per_rank]

    def __getitem__(self, key: int) -> torch.Tensor:
        epoch, index = divmod(int(key), self.steps)
        chosen = self.indices(epoch, index, on_device=True)
        return self.augment(self.images[chosen], batch_generator(self.seed, epoch, self.rank, index))


class _Keys(Sampler):
    """The keys of the epoch being drawn: set before each pass (the workers outlive the epoch)."""

    def __init__(self):
        self.keys = range(0)

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class AugmentWorkers:
    """``workers`` processes that make :class:`EpochBatches`' batches on the CPU, for the whole run.

    ``epoch(e)`` yields the batches of epoch ``e`` in order, each (per_rank, C, H, W) uint8 on
    the CPU, pinned when ``pin`` (for a copy to a GPU that does not wait). The same batches as
    ``source[key]`` in this process, whatever ``workers``. :meth:`close` ends the processes; a
    run that forgets leaves them to end with it.

    Examples:
        >>> from structinit.augment import Augment
        >>> images = torch.zeros(8, 3, 4, 4, dtype=torch.uint8)
        >>> source = EpochBatches(images, Augment.parse("flip"), seed=0, rank=0, world=1, per_rank=4, steps=2)
        >>> pool = AugmentWorkers(source, workers=2)
        >>> [tuple(x.shape) for x in pool.epoch(0)]
        [(4, 3, 4, 4), (4, 3, 4, 4)]
        >>> pool.close()
    """

    def __init__(self, source: EpochBatches, workers: int, pin: bool = False):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"AugmentWorkers: workers={workers!r}: expected an int ≥ 1 (processes)")
        if source.images.device.type != "cpu":
            raise ValueError(f"AugmentWorkers: the images are on {source.images.device}: workers augment CPU images")
        self.source, self._keys = source, _Keys()
        # batch_size=None: an item is already a batch. Where processes fork (Linux) the workers share the
        # training process's images, copied on write, which they never do.
        self._loader = DataLoader(source, batch_size=None, sampler=self._keys, num_workers=workers,
                                  pin_memory=pin, persistent_workers=True, prefetch_factor=WORKER_PREFETCH)

    def epoch(self, epoch: int) -> Iterator[torch.Tensor]:
        steps = self.source.steps
        self._keys.keys = range(epoch * steps, (epoch + 1) * steps)
        yield from self._loader

    def close(self) -> None:
        """End the worker processes (a later :meth:`epoch` starts them again)."""
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
            self._loader._iterator = None
