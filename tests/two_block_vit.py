"""A small ViT around any attention module, and the check that impulse made the module's own
maps hit their targets (on the maps it records itself, ``last_probs`` (B, H, T, T))."""

import torch
from torch import nn

from structinit.functional.targets import target_index


class TwoBlockViT(nn.Module):
    """Two pre-norm attention blocks on 16×16 images (patch 2: an 8×8 grid), a learned PE, each
    block's attention made by ``make(dim, heads)``; ``sequence_first`` turns the tokens (T, B, D)
    after the embedding."""

    def __init__(self, make, dim=48, heads=3, sequence_first=False):
        super().__init__()
        self.sequence_first = sequence_first
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 64, dim) * 0.02)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.attns = nn.ModuleList(make(dim, heads) for _ in range(2))
        self.head = nn.Linear(dim, 10)

    def tokens(self, x):
        return x.transpose(0, 1) if self.sequence_first else x

    def forward(self, images):
        x = self.tokens(self.patch(images).flatten(2).transpose(1, 2) + self.pos_embed)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return self.head(x.mean(0 if self.sequence_first else 1))


def assert_own_maps_hit(model: TwoBlockViT) -> None:
    """Each head's own map, on the position-only input the papers design for (the model's own
    norm of its PE), puts its argmax on the head's target in every grid row."""
    with torch.no_grad():
        for norm, attn in zip(model.norms, model.attns):
            attn(norm(model.tokens(model.pos_embed)))
            for h, offset in enumerate(attn.structinit_impulse["offsets"]):
                target = target_index((8, 8), offset)
                rows = torch.nonzero(target >= 0).squeeze(1)
                hit = (attn.last_probs[0, h, rows].argmax(-1) == target[rows]).float().mean()
                assert hit == 1.0, (type(attn).__name__, h, offset, float(hit))
