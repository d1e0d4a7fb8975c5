"""``impulse`` for attention that rotates q and k by position (2-D axial RoPE).

Such a layer has no position in its tokens, so the impulse goes into the part of q and k that
does not depend on the content: the q/k biases. W_q and W_k are set to 0, so that at init
every query's q is b_q and every key's k is b_k, and head h's logit between query i and key j
is the rotated product of the two biases alone,

    L(Δ) = Σ_f A_f cos(ω_f Δ_{a_f} − φ_f),    Δ = p_j − p_i,

which :func:`structinit.functional.rope_impulse_terms` makes peak at the head's offset and
only there, with ``target_mass`` on the target for every query whose target is on the grid.
Pair f of b_q holds (√(A_f/s), 0) and of b_k √(A_f/s)·(cos φ_f, −sin φ_f), s being the
softmax scale; pairs not chosen are 0. The maps are then the impulse exactly, on any image;
training moves W_q and W_k away from 0 (their gradient is not 0: it goes through b_k and b_q).

A layer without q/k biases has no content-free channel to write, and is refused.
"""

from __future__ import annotations

import torch

from structinit.adapters.rotary import Rotary
from structinit.functional.rope import rope_impulse_terms
from structinit.functional.targets import Offset
from structinit.schemes.plan import Plan

__all__ = ["ROTARY_SOLVER", "plan_rope_impulse"]

ROTARY_SOLVER = "rotary"


def rope_biases(rotary: Rotary, offset: Offset, head_dim: int, scale: float,
                target_mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(b_q, b_k), each (head_dim,) float64, of one head whose impulse is at ``offset``."""
    amplitudes, phases = rope_impulse_terms(rotary.freqs, rotary.axes, offset, rotary.grid, target_mass)
    size = (amplitudes / scale).sqrt()
    bq, bk = torch.zeros(head_dim, dtype=torch.float64), torch.zeros(head_dim, dtype=torch.float64)
    for f, (c0, c1) in enumerate(rotary.pairs):
        bq[c0] = size[f]
        bk[c0], bk[c1] = size[f] * torch.cos(phases[f]), -size[f] * torch.sin(phases[f])
    return bq, bk


def plan_rope_impulse(plan: Plan, chosen, per_layer: list[list[Offset]], target_mass: float) -> None:
    """Add to ``plan`` the q/k writes of every chosen layer: W_q = W_k = 0 and head h's biases
    at offset ``per_layer[i][h]``, with its record (``solver='rotary'``)."""
    memo: dict = {}  # layers share their rotation and offsets: each (rotation, offset) is solved once

    def solved(rotary: Rotary, offset: Offset, head_dim: int, scale: float):
        key = (tuple(rotary.freqs.tolist()), rotary.axes, rotary.pairs, rotary.grid, offset, head_dim, scale)
        if key not in memo:
            memo[key] = rope_biases(rotary, offset, head_dim, scale, target_mass)
        return memo[key]

    for (name, ad), offsets in zip(chosen, per_layer):
        rotary = ad.rotary
        _, bq_dst, _, bk_dst = ad.read_qk()
        if bq_dst is None or bk_dst is None:
            raise ValueError(f"impulse cannot set the attention of layer {name!r} ({type(ad.module).__name__}): it "
                             "rotates q and k by position (RoPE) and has no q/k bias, the content-free part of q and "
                             "k that the impulse is written into; nothing was written. Build the model with qkv "
                             "biases (qkv_bias=True), or use 'mimetic', which needs no position channel")
        heads = [solved(rotary, tuple(o), ad.head_dim, ad.scale) for o in offsets]
        bq = torch.stack([q for q, _ in heads])  # (heads, head_dim)
        bk = torch.stack([k for _, k in heads])
        zeros = torch.zeros(ad.num_heads, ad.dim, ad.head_dim, dtype=torch.float64)
        plan.add_qk(ad, zeros, zeros, bq, bk, record={
            "offsets": [tuple(o) for o in offsets], "grid": rotary.grid,
            "num_prefix_tokens": rotary.num_prefix_tokens, "solver": ROTARY_SOLVER})
