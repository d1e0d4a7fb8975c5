"""Every random choice in structinit goes through a CPU ``torch.Generator``: this module makes
them from a seed or checks the one given, and derives independent sub-seeds from tuples of
integers (seed, epoch, rank, purpose, …)."""

from __future__ import annotations

import torch

from structinit.utils.checks import is_int, show

_MOD = 2**63 - 1
SEED_LIMIT = 2**63  # seeds are whole numbers in [0, 2⁶³), in the API and on the command line


def check_generator(generator: object, where: str = "generator") -> torch.Generator:
    """Return ``generator`` if it is a CPU ``torch.Generator``; raise otherwise.

    Draws happen on the CPU so that CPU and CUDA runs of the same seed agree.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{where}: generator={show(generator)}: pass a CPU torch.Generator, e.g. "
            "torch.Generator().manual_seed(0), so that the result is reproducible"
        )
    if generator.device.type != "cpu":
        raise ValueError(
            f"{where}: generator is on {generator.device}: random draws happen on the CPU (so CPU and "
            "CUDA runs agree); pass torch.Generator() without a device"
        )
    return generator


def make_generator(generator: torch.Generator | None = None, seed: int | None = None) -> torch.Generator:
    """The CPU generator every random draw of an init goes through.

    ``seed`` wins; else ``generator``; else a seed drawn from torch's global RNG, so that
    ``torch.manual_seed(s)`` before a call also reproduces it.
    """
    if seed is not None:
        if not is_int(seed):
            raise TypeError(f"seed={seed!r}: expected an int")
        if not 0 <= int(seed) < SEED_LIMIT:  # torch reads −1 as 2⁶⁴ − 1: two seeds, one stream
            raise ValueError(f"seed={int(seed)}: expected a whole number in [0, 2**63), as the command line takes")
        return torch.Generator().manual_seed(int(seed))  # int(): a numpy integer is not one to torch
    if generator is not None:
        return check_generator(generator)
    return torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))


def derive_seed(*keys: int) -> int:
    """A seed in [0, 2⁶³−1) that depends only on the tuple ``keys`` (a polynomial hash; keys
    that differ in any position give different streams in practice)."""
    seed = 0
    for k in keys:
        if not is_int(k):
            raise TypeError(f"derive_seed: key {k!r} is not an int")
        seed = (seed * 1_000_003 + int(k)) % _MOD
    return seed


def derived_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by :func:`derive_seed` of ``keys``."""
    return torch.Generator().manual_seed(derive_seed(*keys))
