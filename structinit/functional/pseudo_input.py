"""Pseudo inputs X̃ (N×D): what the attention sees at init when only position is known."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PSEUDO_INPUTS = ("pe", "uniform", "gaussian", "pe+uniform", "pe+gaussian")


def pseudo_input(
    kind: str, pe: torch.Tensor | None, shape: tuple[int, int], *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """LayerNorm (no affine, eps 1e-5) of: the position embedding ``pe`` (``'pe'``); uniform
    noise in [−1, 1]; truncated-normal noise with std √½ (the variance of sin/cos entries);
    or the sum of ``pe`` and either noise (the 2024 paper's ablation inputs). Shape (N, D)."""
    if kind not in PSEUDO_INPUTS:
        raise ValueError(f"pseudo={kind!r}: valid names are {', '.join(PSEUDO_INPUTS)}")
    x = torch.zeros(shape, dtype=torch.float64)
    if "pe" in kind:
        if pe is None:
            raise ValueError(
                f"pseudo={kind!r} needs a position embedding, but the model has none; "
                "pass pos_embed=<(N, D) tensor> or use pseudo='uniform'/'gaussian'"
            )
        x = x + pe.detach().to(torch.float64)
    if kind.endswith("uniform"):
        x = x + (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1)
    elif kind.endswith("gaussian"):
        noise = torch.empty(shape, dtype=torch.float64)
        torch.nn.init.trunc_normal_(noise, std=math.sqrt(0.5), a=-2.0, b=2.0, generator=generator)
        x = x + noise
    return F.layer_norm(x, (shape[1],), eps=1e-5)
