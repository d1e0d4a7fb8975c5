"""A learned bias the attention gathers by an index buffer, under any names (TinyViT's and
EfficientFormer's ``attention_biases[:, attention_bias_idxs]``): found by its structure, modelled
in the adapter's logits, kept by mimetic and written by impulse where each offset has its own
entry; checked on the module's own maps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters import attention_survey
from structinit.adapters.observe import observe
from structinit.adapters.relative import gathered_bias
from structinit.schemes.checks import diagonal_strength


def _index(side: int, mirrored: bool) -> torch.Tensor:
    """(T, T) entry of every (query, key) pair on a side×side grid: one per signed offset, or one
    per |offset| (TinyViT's), which a pair and its mirror share."""
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    dy = ys.flatten()[None, :] - ys.flatten()[:, None]
    dx = xs.flatten()[None, :] - xs.flatten()[:, None]
    if mirrored:
        return dy.abs() * side + dx.abs()
    return (dy + side - 1) * (2 * side - 1) + dx + side - 1


class BiasedAttention(nn.Module):
    def __init__(self, dim: int, heads: int, side: int, mirrored: bool):
        super().__init__()
        self.num_heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        index = _index(side, mirrored)
        self.biases = nn.Parameter(torch.randn(heads, int(index.max()) + 1) * 0.1)
        self.register_buffer("idx", index)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) * self.scale + self.biases[:, self.idx]
        self.last_logits = logits.detach()
        return self.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class BiasedViT(nn.Module):
    """16×16 images, patch 2 (an 8×8 grid), no position embedding: the gathered bias is the only
    position the attention has."""

    def __init__(self, mirrored: bool, dim: int = 32, heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.norm, self.attn = nn.LayerNorm(dim), BiasedAttention(dim, heads, 8, mirrored)
        self.head = nn.Linear(dim, 10)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = x + self.attn(self.norm(x))
        return self.head(x.mean(1))


@pytest.mark.parametrize("mirrored", [False, True])
def test_the_gathered_table_is_found_by_its_structure_and_read_as_the_modules_own_bias(mirrored):
    model = BiasedViT(mirrored)
    found = gathered_bias(model.attn, heads=2)
    assert found is not None and found.grid == (8, 8) and found.table.shape[1] == 2
    assert found.table.untyped_storage().data_ptr() == model.attn.biases.untyped_storage().data_ptr()
    assert torch.equal(found.bias(), model.attn.biases[:, model.attn.idx])
    (layer,) = attention_survey(model).verdicts
    assert (layer.kind, layer.checked) == ("self", True)  # its logits are q kᵀ·scale + the bias: judged so
    assert gathered_bias(nn.Linear(4, 4), heads=2) is None


def test_impulse_writes_a_table_whose_offsets_each_have_an_entry_and_hits_on_the_modules_own_maps():
    model = BiasedViT(mirrored=False)
    structinit.init_(model, "impulse", seed=0)
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1.0).all())


def test_impulse_refuses_a_table_that_mirrored_offsets_share_and_mimetic_sets_the_layer():
    check_rejected(BiasedViT(mirrored=True), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"impulse cannot set the attention of layer 'attn' .*does not give the offset .* one table row "
                   r"of its own .* without biasing other pairs.*nothing was written. Pass offsets=")
    model = BiasedViT(mirrored=True)
    table = model.attn.biases.detach().clone()
    structinit.init_(model, "mimetic", seed=0)
    assert torch.equal(model.attn.biases, table)  # the model's own bias is kept
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    observe(model, images)
    assert bool((diagonal_strength(model.attn.last_logits) > 1.0).all())
