"""The optimisation every run shares: AdamW's parameter groups, the learning-rate schedule
and an exponential moving average of the weights."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["EMA", "cosine_lr", "param_groups"]


def cosine_lr(step: int, total: int, warmup: int, cfg) -> float:
    """Linear warm-up from ``cfg.warmup_lr`` to ``cfg.lr`` over ``warmup`` steps, then cosine
    decay to ``cfg.min_lr`` at ``total``."""
    if step < warmup:
        return cfg.warmup_lr + (cfg.lr - cfg.warmup_lr) * step / warmup
    t = (step - warmup) / max(1, total - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as timm makes them: weight decay on weight matrices only, not on vectors
    (biases, norms, gains) nor on what the model lists in ``no_weight_decay()`` (position
    embeddings, class tokens, Mamba's ``A_log`` and ``D``: decay would pull them towards
    zero, undoing what their init sets up). Frozen parameters are left out."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class EMA:
    """Exponential moving average of the weights: ema ← d·ema + (1−d)·w after every step."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.state[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)
            else:
                self.state[k].copy_(v)
