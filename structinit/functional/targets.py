"""Impulse targets: one-hot k×k convolution filters as N×N attention matrices on a token grid.

Tokens of an h×w grid are flattened row-major, t = y·w + x. A one-hot filter whose single 1
sits at offset (dy, dx) from the kernel centre is, as a linear map on tokens, the shift matrix

    H[t=(y, x), t'=(y+dy, x+dx)] = 1   if (y+dy, x+dx) lies in the grid,

and 0 elsewhere (zero padding: rows whose neighbour falls outside the grid are all zero).
Output token (y, x) copies input token (y+dy, x+dx): a cross-correlation, as in ``conv2d``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from structinit.utils import OptionError, is_int

Offset = tuple[int, int]

# 2025 code's order of the 3×3 taps: centre, up, right, left, down, then the four diagonals.
ENUMERATION_ORDER_3X3: tuple[Offset, ...] = (
    (0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1),
)


def check_kernel_size(kernel_size: int, grid: tuple[int, int] | None = None) -> None:
    """Raise ValueError unless ``kernel_size`` is a positive odd int that fits the grid."""
    if not is_int(kernel_size):
        raise TypeError(f"kernel_size={kernel_size!r}: expected an odd int such as 3, 5 or 7")
    if kernel_size <= 0 or kernel_size % 2 == 0:
        raise ValueError(
            f"kernel_size={kernel_size}: an impulse filter needs a positive odd size "
            "(3, 5, 7, …) so that it has a centre tap"
        )
    if grid is not None and kernel_size > min(grid):
        raise ValueError(
            f"kernel_size={kernel_size} is larger than the token grid {grid[0]}×{grid[1]}; "
            f"use kernel_size ≤ {min(grid) if min(grid) % 2 else min(grid) - 1}"
        )


def kernel_offsets(kernel_size: int) -> list[Offset]:
    """All k² taps of a k×k kernel as (dy, dx), in the order of tap index i = (dy+k//2)·k + dx+k//2."""
    check_kernel_size(kernel_size)
    half = kernel_size // 2
    return [(i // kernel_size - half, i % kernel_size - half) for i in range(kernel_size**2)]


def enumerated_offsets(num_heads: int, kernel_size: int = 3) -> list[Offset]:
    """Deterministic offsets: centre, up, right, left, down, diagonals, then (k>3) the outer
    taps by increasing distance from the centre, cycling when there are more heads than taps."""
    check_kernel_size(kernel_size)
    rest = sorted(
        (o for o in kernel_offsets(kernel_size) if o not in ENUMERATION_ORDER_3X3),
        key=lambda o: (max(abs(o[0]), abs(o[1])), o[0] ** 2 + o[1] ** 2, o),
    )
    order = [o for o in ENUMERATION_ORDER_3X3 if max(map(abs, o)) <= kernel_size // 2] + rest
    return [order[h % len(order)] for h in range(num_heads)]


def random_offsets(
    num_heads: int, kernel_size: int = 3, generator: torch.Generator | None = None
) -> list[Offset]:
    """Offsets drawn uniformly from the k² taps, independently per head, with replacement."""
    taps = kernel_offsets(kernel_size)
    idx = torch.randint(len(taps), (num_heads,), generator=generator)
    return [taps[i] for i in idx.tolist()]


def check_offsets(offsets: Sequence[Offset], kernel_size: int) -> list[Offset]:
    """Validate explicit offsets against the kernel; return them as a list of int pairs."""
    half = kernel_size // 2
    out = []
    for o in offsets:
        if not isinstance(o, Sequence) or isinstance(o, str) or len(o) != 2 or not all(is_int(v) for v in o):
            raise OptionError(f"offsets: offset {o!r} is not a pair of ints (dy, dx); give one (dy, dx) per head")
        if max(abs(o[0]), abs(o[1])) > half:
            raise ValueError(
                f"offsets: offset {tuple(o)} lies outside the {kernel_size}×{kernel_size} kernel: "
                f"each of dy, dx must be in [−{half}, {half}]; raise kernel_size or change the offset"
            )
        out.append((int(o[0]), int(o[1])))
    return out


def target_index(grid: tuple[int, int], offset: Offset) -> torch.Tensor:
    """Index of each token's target, shape (N,), long; −1 where the target leaves the grid."""
    return target_indices(grid, [offset])[0]


def target_indices(grid: tuple[int, int], offsets: Sequence[Offset]) -> torch.Tensor:
    """:func:`target_index` of every offset at once: shape (len(offsets), N), long, row k the
    targets of ``offsets[k]``."""
    h, w = grid
    off = torch.tensor([(int(dy), int(dx)) for dy, dx in offsets], dtype=torch.long).reshape(-1, 2)
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ty, tx = y.reshape(1, -1) + off[:, :1], x.reshape(1, -1) + off[:, 1:]
    inside = (ty >= 0) & (ty < h) & (tx >= 0) & (tx < w)
    return torch.where(inside, ty * w + tx, torch.full_like(ty, -1))


def target_pairs(target: torch.Tensor, prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols): the token index of every grid row whose target (``target``, from
    :func:`target_index`) is on the grid, and of that target, in a sequence whose first
    ``prefix`` tokens are off the grid (a class token). ``probs[..., rows, :].argmax(-1) == cols``
    is a head's hit, with every key a candidate."""
    rows = torch.nonzero(target >= 0).squeeze(1)
    return rows + prefix, target[rows] + prefix


def impulse_matrix(grid: tuple[int, int], offset: Offset, dtype=torch.float32) -> torch.Tensor:
    """The N×N matrix H of a one-hot filter at ``offset`` with zero padding (see module doc)."""
    n = grid[0] * grid[1]
    t = target_index(grid, offset)
    rows = torch.nonzero(t >= 0).squeeze(1)
    out = torch.zeros(n, n, dtype=dtype)
    out[rows, t[rows]] = 1
    return out
