"""The entries of a projection found by where they are, not by labels: for q and k that pass
through a norm after their projection (q/k-norm, often with rotary positions), a labelled
cotangent comes out mixed across a head's channels, so only the *set* of entries feeding a head
is known. They are then read as the head's lines of input weights in storage order.

That order is the channel order of the product when q and k lay their heads out alike, and
it need be no more than that: a head's logits are q·k summed over its channels, so one
permutation of the channels applied to both leaves them unchanged. The survey and the schemes'
checks then judge the layer on its own maps like any other."""

from __future__ import annotations

import torch


def lines_in_storage_order(support: torch.Tensor, stride: tuple[int, ...], width: int,
                           channels: int) -> dict[int, torch.Tensor] | None:
    """``support`` (N, ndim), the entries of one parameter that feed one head, as
    channel → its line of ``width`` entries, the lines in storage order; None when the entries
    are not ``channels`` whole lines along one axis (a norm's weight, a bias, a position term)."""
    if len(support) != channels * width:
        return None
    strides = torch.tensor(stride)
    for axis in range(support.shape[1]):
        others = torch.cat([support[:, :axis], support[:, axis + 1:]], 1)
        keys, group = torch.unique(others, dim=0, return_inverse=True)
        if len(keys) != channels:
            continue
        lines = [support[group == g] for g in range(channels)]
        if not all(sorted(line[:, axis].tolist()) == list(range(width)) for line in lines):
            continue
        lines.sort(key=lambda line: int((line.min(0).values * strides).sum()))
        return dict(enumerate(lines))
    return None
