r"""Gated positional self-attention (GPSA; ConViT, d'Ascoli et al., 2021), recognised by its
parts under any class: a ``qk`` Linear D → 2·inner (q then k), a ``v`` Linear D → inner, a
``proj`` Linear inner → D, a ``pos_proj`` Linear 3 → H and a ``gating_param`` of H gates. A
head's map mixes a content softmax with a positional one, by the formula of
:mod:`structinit.functional.gated`, which this adapter and structinit's ConViT both call. The
probe checks this recomputation against the module's own maps, so a module that only looks
like GPSA is refused by what it computes.

Impulse writes both halves of a GPSA head, so that the map the model computes points at the
head's offset: the content q/k as for any attention, and the positional scores as ConViT's own
local init does for its lattice of centres, a Gaussian −α‖r − δ_h‖² around the head's offset
δ_h (weights (2α δx, 2α δy, −α), zero bias; α the module's ``locality_strength``, else 1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from structinit.adapters.attention import AttentionAdapter, Views, module_scale, split_views
from structinit.functional.attention import heads_last_lead
from structinit.functional.gated import gated_mixture, gaussian_positional_weight, relative_positions
from structinit.functional.targets import Offset

_PARTS = ("qk", "v", "proj", "pos_proj")


def is_gated_positional(module: nn.Module) -> bool:
    """Whether ``module`` has GPSA's parts with matching shapes (module doc)."""
    parts = [getattr(module, n, None) for n in _PARTS]
    gate = getattr(module, "gating_param", None)
    if not all(isinstance(p, nn.Linear) for p in parts) or not isinstance(gate, torch.Tensor) or gate.ndim != 1:
        return False
    qk, v, proj, pos = parts
    inner = v.out_features
    return (qk.out_features == 2 * inner and qk.in_features == v.in_features == proj.out_features
            and proj.in_features == inner and pos.in_features == 3 and pos.out_features == gate.numel()
            and inner % gate.numel() == 0)


class GatedPositionalAdapter(AttentionAdapter):
    """structinit's view of a GPSA layer (module doc): q/k are the halves of ``qk``, and the
    attention probabilities are the gated mixture, so maps, checks and fidelity read what the
    layer computes."""

    def __init__(self, module: nn.Module):
        if not is_gated_positional(module):
            raise ValueError(f"{type(module).__name__} lacks GPSA's qk, v, proj, pos_proj and gating_param")
        self.module = module
        self.num_heads = module.gating_param.numel()
        self.head_dim = module.v.out_features // self.num_heads
        self.dim = module.qk.in_features
        self.scale = module_scale(module, self.head_dim)

    matches = staticmethod(is_gated_positional)

    def linear_views(self) -> Views:
        m = self.module
        return split_views(m.qk.weight, m.qk.bias, self.num_heads * self.head_dim, "qk") | {
            "v": (m.v.weight, m.v.bias), "o": (m.proj.weight, m.proj.bias)}

    def relative_positions(self, tokens: int) -> torch.Tensor:
        """(T, T, 3): the module's own ``rel_indices`` when they fit ``tokens``, else those of a
        square grid of that many tokens (as the published code builds them)."""
        rel = getattr(self.module, "rel_indices", None)
        if isinstance(rel, torch.Tensor) and rel.shape[-1] == 3 and rel.shape[-2] == rel.shape[-3] == tokens:
            return rel.reshape(tokens, tokens, 3)
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise ValueError(f"{type(self.module).__name__} got {tokens} tokens, not a square grid: GPSA's "
                             "positional scores need the grid")
        return relative_positions((side, side)).to(self.module.pos_proj.weight.device)

    def positional_probs(self, tokens: int) -> torch.Tensor:
        """(heads, T, T): the softmax of the positional scores."""
        rel = self.relative_positions(tokens).to(self.module.pos_proj.weight.dtype)
        return self.module.pos_proj(rel).permute(2, 0, 1).softmax(dim=-1)

    def mix(self, content: torch.Tensor) -> torch.Tensor:
        """The gated mixture of content probabilities (…, heads, T, T) with the positional ones,
        each row renormalised to sum to one."""
        positional = self.positional_probs(content.shape[-1]).to(content.dtype)
        return gated_mixture(content, positional, self.module.gating_param.to(content.dtype))

    def attention_probs(self, x: torch.Tensor, terms: torch.Tensor | None = None) -> torch.Tensor:
        return self.mix(super().attention_probs(x, terms))

    def observed_probs(self, maps, shape):
        """The gated mixture of the module's own content softmax, the map among ``maps`` that is
        not its positional softmax (a code may compute either first)."""
        positional = self.positional_probs(shape[-1]) if len(shape) == 4 else None
        for probs in maps:
            if probs.numel() != shape.numel():
                continue
            probs = heads_last_lead(probs, shape[1]).reshape(shape)
            if positional is not None and torch.allclose(probs, positional.to(probs.dtype).expand(shape), atol=1e-6):
                continue
            return self.mix(probs)
        return None

    def positional_writes(self, offsets: list[Offset], grid: tuple[int, int]) -> list[tuple[torch.Tensor,
                                                                                           torch.Tensor]]:
        """``pos_proj`` set so that head h's positional scores are −α‖r − δ_h‖² + const, a
        Gaussian around its offset δ_h = (δy, δx) (module doc)."""
        pos = self.module.pos_proj
        alpha = float(getattr(self.module, "locality_strength", 1.0))
        weight = gaussian_positional_weight([(dx, dy) for dy, dx in offsets], alpha, dtype=pos.weight.dtype,
                                            device=pos.weight.device)
        return [(pos.weight, weight)] + ([] if pos.bias is None else [(pos.bias, torch.zeros_like(pos.bias))])
