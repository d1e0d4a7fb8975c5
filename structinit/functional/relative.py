"""Relative-position attention biases, and the impulse written into them.

Swin's window attention and BEiT's attention add to head h's logit q_i·k_j/√d a learned bias
``table[index[i, j], h]``: ``index`` maps the offset between query i and key j on a Wh×Ww
grid (tokens row-major, t = y·Ww + x) to one of (2Wh−1)(2Ww−1) table rows,

    index[i, j] = (y_i − y_j + Wh − 1)·(2Ww − 1) + (x_i − x_j + Ww − 1)

(timm's ``relative_position_index``). Position lives in the table, not in the tokens, so an
impulse filter with offset (dy, dx) (query (y, x) looks at key (y+dy, x+dx), the convention of
:mod:`structinit.functional.targets`) is one table entry per head: β at the row of that
offset, 0 elsewhere. With content logits near zero, a query whose target key exists puts
mass e^β / (e^β + n − 1) on it (n keys); β is solved from the wanted mass. A query whose
target lies outside the grid (the window's border) has no entry to raise: its row stays
uniform, where a zero-padded convolution would read zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from structinit.functional.targets import Offset
from structinit.utils import check_int, check_number

__all__ = ["impulse_bias_table", "impulse_logit", "offset_row", "relative_position_index"]


def relative_position_index(win_h: int, win_w: int) -> torch.Tensor:
    """(N, N) long tensor, N = win_h·win_w: the table row of every (query, key) pair.

    Examples:
        >>> relative_position_index(1, 2)
        tensor([[1, 0],
                [2, 1]])
    """
    check_int("win_h", win_h, low=1)
    check_int("win_w", win_w, low=1)
    y, x = torch.meshgrid(torch.arange(win_h), torch.arange(win_w), indexing="ij")
    y, x = y.flatten(), x.flatten()
    dy = y[:, None] - y[None, :] + win_h - 1
    dx = x[:, None] - x[None, :] + win_w - 1
    return dy * (2 * win_w - 1) + dx


def offset_row(offset: Offset, win_h: int, win_w: int) -> int:
    """The table row of the pairs whose key is the query moved by ``offset`` = (dy, dx).

    Examples:
        >>> offset_row((0, 0), 3, 3)  # the centre of the 5×5 table of a 3×3 window
        12
    """
    dy, dx = offset
    if not (abs(dy) < win_h and abs(dx) < win_w):
        raise ValueError(f"offset {offset}: outside a {win_h}×{win_w} window, whose offsets lie within "
                         f"±{win_h - 1} rows and ±{win_w - 1} columns; choose a smaller kernel_size")
    return (-dy + win_h - 1) * (2 * win_w - 1) + (-dx + win_w - 1)


def impulse_logit(target_mass: float, keys: int) -> float:
    """β such that softmax over ``keys`` logits, one of them β and the rest 0, gives the one
    mass ``target_mass``: β = log(m (n − 1) / (1 − m)).

    Examples:
        >>> round(impulse_logit(0.5, 2), 6)
        0.0
    """
    check_number("target_mass", target_mass, low=0, high=1, low_open=True, high_open=True)
    check_int("keys", keys, low=2)
    return math.log(target_mass * (keys - 1) / (1 - target_mass))


def impulse_bias_table(offsets: Sequence[Offset], win_h: int, win_w: int, target_mass: float = 0.95,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """((2Wh−1)(2Ww−1), heads) table: head h holds :func:`impulse_logit` at the row of
    ``offsets[h]`` and 0 elsewhere, so that with zero content logits every query whose target
    key is in the window puts ``target_mass`` on it.

    Examples:
        >>> table = impulse_bias_table([(0, 1)], 2, 2, target_mass=0.9)
        >>> probs = table[relative_position_index(2, 2), 0].softmax(-1)
        >>> round(float(probs[0, 1]), 6)  # query (0, 0) looks at key (0, 1)
        0.9
    """
    if not offsets:
        raise ValueError("offsets is empty; give one (dy, dx) per head")
    rows = [offset_row(o, win_h, win_w) for o in offsets]
    beta = impulse_logit(target_mass, win_h * win_w)
    table = torch.zeros((2 * win_h - 1) * (2 * win_w - 1), len(offsets), dtype=dtype)
    table[rows, torch.arange(len(offsets))] = beta
    return table
