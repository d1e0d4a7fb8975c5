"""Host-to-device copies that never wait for the device.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory makes the host wait until
the device has drained its queue, so the next kernels are launched late and the device idles.
Augmentation draws its per-image parameters on the CPU for every batch: copied plainly, each
draw would stall the training step. :func:`to_device` stages the copy in pinned memory and
queues it behind the work already launched, which keeps the host ahead of the device.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without a host-device synchronisation.

    A CPU tensor bound for a CUDA device is copied through pinned memory with
    ``non_blocking=True``; torch's pinned-memory cache keeps the staging buffer alive until the
    copy has run, so ``t`` may be freed or changed at once. Any other pair is ``t.to(device)``.

    Examples:
        >>> to_device(torch.arange(3), "cpu")
        tensor([0, 1, 2])
    """
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
