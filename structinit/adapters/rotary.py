"""Rotary position embeddings (2-D RoPE), described so that an adapter can recompute them.

A RoPE attention layer rotates q and k after their projections: pair f of a head's channels,
(c0, c1) = ``pairs[f]``, is turned by an angle θ_f(p) that depends on the token's grid
position p; prefix (class, register) tokens are not rotated. In complex form
z = x_{c0} + i·x_{c1} ↦ z·e^{iθ}. Channels in no pair are left as they are.

The logit of query i and key j then sees only θ_f(p_j) − θ_f(p_i). Every RoPE a ViT ships
turns each pair linearly with the position, θ_f(p) = θ_f(0) + ω_f·p with ω_f = (ω_y, ω_x):
axial RoPE (EVA-02, timm's ``*_rope*``, DINOv3: each pair with the row or the column), mixed
RoPE (learned ω_f with both components, per head and layer), and 1-D RoPE over the flattened
grid (ω_y = w·ω_x). :meth:`Rotary.frequencies` reads ω from the angles and checks that they
are linear, so the impulse solver (:mod:`structinit.functional.rope`) works from what the
layer really does.

The rotation is declared by a submodule (:func:`find_rotary`; structinit's own
:class:`~structinit.models.rope.Rotary2d`) or handed to the layer with its call
(:func:`received_rotary`). Either way the adapter applies it in
:meth:`~structinit.adapters.AttentionAdapter.qk_features` and the probe compares that
recomputation with the model's own logits, so a description that does not match what the
module computes is refused, not trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Rotary", "find_rotary", "received_rotary", "rotary_from_tables"]

# How far the angles may sit from a linear function of the position (float32 tables).
LINEAR_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Rotary:
    """What a layer's rotary embedding does to each head's q and k (module doc).

    ``angles`` (1 or heads, h·w, F) holds θ_f of every grid token, row-major, in radians;
    ``pairs[f]`` the two channels pair f turns, within a head.
    """

    angles: torch.Tensor
    pairs: tuple[tuple[int, int], ...]
    grid: tuple[int, int]
    num_prefix_tokens: int = 0

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (..., heads, T, r) with its grid tokens (after the prefix) rotated; T must be the
        prefix plus h·w tokens."""
        n = self.grid[0] * self.grid[1]
        if t.shape[-2] != self.num_prefix_tokens + n:
            raise ValueError(f"rotary: {t.shape[-2]} tokens, but the embedding is for {self.num_prefix_tokens} "
                             f"prefix + {self.grid[0]}×{self.grid[1]} grid tokens")
        angle = self.angles.to(t.device, t.dtype)  # (1 or H, n, F), broadcast over the heads
        cos, sin = torch.cos(angle), torch.sin(angle)
        c0 = torch.tensor([p[0] for p in self.pairs], device=t.device)
        c1 = torch.tensor([p[1] for p in self.pairs], device=t.device)
        grid = t[..., self.num_prefix_tokens:, :]
        x0, x1 = grid[..., c0], grid[..., c1]
        out = grid.clone()
        out[..., c0] = x0 * cos - x1 * sin
        out[..., c1] = x0 * sin + x1 * cos
        return torch.cat([t[..., :self.num_prefix_tokens, :], out], dim=-2)

    def frequencies(self) -> torch.Tensor:
        """(1 or heads, F, 2) float64: ω_f = (ω_y, ω_x) of every pair, radians per row and per
        column, read off the angles (wrapped to (−π, π]: an integer grid cannot tell ω from
        ω + 2π). ValueError when an angle is not θ_f(0) + ω_f·p."""
        return _frequencies(self.angles, self.grid)

    def head(self, h: int) -> int:
        """The row of :attr:`angles` that head ``h`` uses."""
        return h if self.angles.shape[0] > 1 else 0


def _wrapped(a: torch.Tensor) -> torch.Tensor:
    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


def _frequencies(angles: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    h, w = grid
    a = angles.double().reshape(angles.shape[0], h, w, -1)
    wy = _wrapped(a[:, 1, 0] - a[:, 0, 0]) if h > 1 else torch.zeros_like(a[:, 0, 0])
    wx = _wrapped(a[:, 0, 1] - a[:, 0, 0]) if w > 1 else torch.zeros_like(a[:, 0, 0])
    y = torch.arange(h, dtype=torch.float64)[:, None, None]
    x = torch.arange(w, dtype=torch.float64)[None, :, None]
    linear = a[:, :1, :1] + y * wy[:, None, None] + x * wx[:, None, None]
    off = float(_wrapped(a - linear).abs().max()) if a.numel() else 0.0
    # Angles held in 16 bits are rounded, each by up to half a unit in the last place of its size.
    rounding = torch.finfo(angles.dtype).eps * float(a.abs().max()) if a.numel() else 0.0
    if off > LINEAR_TOLERANCE + rounding:
        raise ValueError(f"the rotary angles are not linear in the grid position on a {h}×{w} grid (off by {off:.3g} "
                         "rad): impulse needs θ_f(p) = θ_f(0) + ω_f·p, as axial, mixed and 1-D RoPE have")
    return torch.stack([wy, wx], -1)


def _linear_on(angles: torch.Tensor, grid: tuple[int, int]) -> bool:
    try:
        _frequencies(angles, grid)
    except ValueError:
        return False
    return True


def token_grid(angles: torch.Tensor) -> tuple[int, int] | None:
    """The (h, w) on which ``angles`` (…, n, F) are linear in the position: the squarest
    factorisation of n that is, or None."""
    n = angles.shape[-2]
    flat = angles.reshape(-1, n, angles.shape[-1])
    shapes = sorted(((n // w, w) for w in range(1, n + 1) if n % w == 0), key=lambda s: abs(s[0] - s[1]))
    return next((s for s in shapes if _linear_on(flat, s)), None)


def rotary_from_tables(cos: torch.Tensor, sin: torch.Tensor, half: bool, num_prefix_tokens: int,
                       grid: tuple[int, int] | None = None) -> Rotary | None:
    """The :class:`Rotary` of per-channel tables ``cos``, ``sin`` (…, n, r) as timm's
    ``apply_rot_embed`` and Hugging Face's ``apply_rotary_pos_emb`` use them: x·cos + turn(x)·sin,
    the pairs interleaved (2c, 2c+1) or, with ``half``, (c, c + r/2). Leading axes: none, heads,
    or batch × heads with every batch row equal. None when the tables are not such a rotation
    (the two channels of a pair at different angles, angles not linear on any grid)."""
    cos, sin = cos.detach().double(), sin.detach().double()
    if cos.shape != sin.shape or cos.ndim < 2 or cos.shape[-1] % 2:
        return None
    cos, sin = cos.reshape(-1, *cos.shape[-2:]), sin.reshape(-1, *sin.shape[-2:])
    r = cos.shape[-1]
    c0 = list(range(r // 2)) if half else list(range(0, r, 2))
    c1 = [c + r // 2 for c in c0] if half else [c + 1 for c in c0]
    if not (torch.allclose(cos[..., c0], cos[..., c1], atol=1e-5) and torch.allclose(sin[..., c0], sin[..., c1],
                                                                                       atol=1e-5)):
        return None
    angles = torch.atan2(sin[..., c0], cos[..., c0])  # (L, n, F)
    if angles.shape[0] > 1 and bool((angles == angles[:1]).all()):
        angles = angles[:1]
    grid = grid or token_grid(angles)
    if grid is None or grid[0] * grid[1] != angles.shape[-2] or not _linear_on(angles, grid):
        return None
    return Rotary(angles, tuple(zip(c0, c1)), tuple(grid), num_prefix_tokens)


def find_rotary(module: nn.Module) -> Rotary | None:
    """The :class:`Rotary` a direct submodule of ``module`` declares (its ``rotary()``), or None."""
    found = (describe() for child in module.children() if callable(describe := getattr(child, "rotary", None)))
    return next((rotary for rotary in found if isinstance(rotary, Rotary)), None)


def received_rotary(module: nn.Module, args: tuple, kwargs: dict, tokens: int, head_dim: int) -> Rotary | None:
    """The rotation ``module`` received with a call on ``tokens`` tokens, or None:

    - timm (``EvaAttention``, ``AttentionRope``): ``rope`` (…, n, 2·head_dim) = [sin | cos],
      interleaved pairs unless the module's ``rotate_half``; its ``num_prefix_tokens`` in front;
    - Hugging Face (DINOv3): ``position_embeddings`` = (cos, sin), each (…, n, head_dim),
      half-split pairs, the prefix being the tokens in front of the last n;
    - vit-pytorch (RvT): ``pos_emb`` = (sin, cos), each (…, n, r ≤ head_dim), interleaved pairs
      on the first r channels, one class token in front;
    - x-transformers: ``rotary_pos_emb`` = (angles, 1), angles (…, ≥ T, r ≤ head_dim) of the last
      T tokens, interleaved pairs on the first r channels (its ``rotate_half`` turns (2c, 2c+1));
      a length scale other than 1 (xPos) is no rotation: None.
    """
    rope = kwargs.get("rope", args[1] if len(args) > 1 else None)  # args[0]: the tokens
    if isinstance(rope, torch.Tensor) and rope.shape[-1] == 2 * head_dim:
        sin, cos = rope.chunk(2, -1)
        prefix = int(getattr(module, "num_prefix_tokens", tokens - rope.shape[-2]))
        return _fitting(cos, sin, bool(getattr(module, "rotate_half", False)), prefix, tokens)
    pair = kwargs.get("position_embeddings")
    if _two_tensors(pair) and pair[0].shape[-1] == head_dim:
        cos, sin = pair
        return _fitting(cos, sin, True, tokens - cos.shape[-2], tokens)
    pair = kwargs.get("pos_emb")
    if _two_tensors(pair) and pair[0].shape[-1] <= head_dim:
        sin, cos = pair
        return _fitting(cos, sin, False, tokens - sin.shape[-2], tokens)
    pair = kwargs.get("rotary_pos_emb")
    if isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], torch.Tensor) and not isinstance(
            pair[1], torch.Tensor) and pair[1] == 1 and pair[0].shape[-1] <= head_dim and pair[0].shape[-2] >= tokens:
        angles = pair[0][..., -tokens:, :]
        return _fitting(angles.cos(), angles.sin(), False, 0, tokens)
    return None


def _two_tensors(pair) -> bool:
    return isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)


def _fitting(cos, sin, half, prefix, tokens) -> Rotary | None:
    if prefix < 0 or prefix + cos.shape[-2] != tokens:
        return None
    return rotary_from_tables(cos, sin, half, prefix)
