"""Impulse designs each head's logits from the adapter's q/k. An attention that rotates q and
k by position after their projections (rotary position embeddings) would not reach the impulse
maps, so impulse refuses it with a clear error and writes nothing; mimetic, which sets no
positions, still works. The check runs the model on a probe image up to the first attention
layer and compares the q kᵀ it hands to scaled_dot_product_attention with the adapter's."""

import torch
import torch.nn.functional as F
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.trace import real_logits_gap


def rotate(x: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, H, T, r): pairs of channels rotated by an angle that grows with the position."""
    t, r = x.shape[-2], x.shape[-1]
    freq = 1.0 / (100 ** (torch.arange(0, r, 2, dtype=x.dtype) / r))
    angle = torch.arange(t, dtype=x.dtype)[:, None] * freq[None]
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


class RotaryAttention(nn.Module):
    """timm's attention layout (fused qkv, proj, num_heads) with RoPE on q and k."""

    def __init__(self, attn: nn.Module, rotary: bool = True):
        super().__init__()
        self.qkv, self.proj, self.num_heads, self.rotary = attn.qkv, attn.proj, attn.num_heads, rotary

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if self.rotary:
            q, k = rotate(q), rotate(k)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def model_with(rotary: bool):
    torch.manual_seed(0)
    model = structinit.create_model("vit_micro_patch2_16")
    for block in model.blocks:
        block.attn = RotaryAttention(block.attn, rotary)
    return model


def test_impulse_refuses_rotary_attention_and_leaves_the_model_unchanged():
    model = model_with(rotary=True)
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"impulse cannot set the attention of layer 'blocks\.0\.attn' \(RotaryAttention\).*RoPE.*'mimetic'")
    name, ad = structinit.find_attention_layers(model)[0]
    assert real_logits_gap(model, name, ad) > 0.1
    structinit.init_(model, "mimetic", seed=0)  # position-free: fine with RoPE


def test_the_same_attention_without_rotation_passes_the_check():
    model = model_with(rotary=False)
    name, ad = structinit.find_attention_layers(model)[0]
    assert real_logits_gap(model, name, ad) < 1e-5
    structinit.init_(model, "impulse", seed=0)
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


def test_models_that_compute_attention_otherwise_are_not_checked():
    """structinit's own ViT (and nn.MultiheadAttention's fused path) never hand q/k to the
    probe's spy in a form it can read back: the check says nothing and impulse proceeds."""
    model = structinit.create_model("vit_micro_patch2_16")
    gap = real_logits_gap(model, *structinit.find_attention_layers(model)[0])
    assert gap is None or gap < 1e-5
