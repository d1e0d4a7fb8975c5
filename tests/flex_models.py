"""A small ViT whose attention runs through one fused call, ``flex_attention`` or
``scaled_dot_product_attention``: no softmax in its forward for anyone to see. Its layers read
their own maps back from that call itself (one-hot values), so a test judges a write by what
the kernel computes."""

import torch
from torch import nn

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # a torch without flex_attention: the tests that need it skip
    create_block_mask = flex_attention = None


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def distance_bias(score, b, h, q_idx, kv_idx):
    """ALiBi-like: a content-free bias that falls with the distance, steeper for later heads."""
    return score - 0.1 * (h + 1) * (q_idx - kv_idx).abs()


class FlexAttention(nn.Module):
    """q from one Linear, k and v from another (``kv_heads`` of them: grouped queries when fewer
    than ``heads``), flex_attention with the given ``score_mod`` and ``mask_mod``, an output Linear.
    ``kernel='sdpa'`` runs scaled_dot_product_attention instead, its mask the ``mask_mod``'s pairs."""

    def __init__(self, dim=48, heads=3, kv_heads=None, score_mod=None, mask_mod=None, kernel="flex", lse=False):
        super().__init__()
        self.lse = lse  # flex returns its log-sum-exp beside the output, as attention sinks use it
        if kernel == "sdpa" and score_mod is not None:
            raise ValueError("score_mod is flex_attention's")
        self.kernel = kernel
        self.heads, self.kv_heads, self.r = heads, kv_heads or heads, dim // heads
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * self.kv_heads * self.r)
        self.proj = nn.Linear(dim, dim)
        self.seen = None

    def _attend(self, q, k, v, mask):
        if self.kernel == "sdpa":
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                              enable_gqa=self.kv_heads != self.heads)
        out = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=mask,
                             enable_gqa=self.kv_heads != self.heads, return_lse=self.lse)
        return out[0] if self.lse else out

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).reshape(b, t, self.heads, self.r).transpose(1, 2)
        k, v = self.kv(x).reshape(b, t, 2, self.kv_heads, self.r).permute(2, 0, 3, 1, 4)
        mask = None if self.mask_mod is None else self._mask(t)
        self.seen = (q.detach(), k.detach(), mask)
        return self.proj(self._attend(q, k, v, mask).transpose(1, 2).reshape(b, t, d))

    def _mask(self, t):
        if self.kernel == "sdpa":
            idx = torch.arange(t)
            return self.mask_mod(0, 0, idx[:, None], idx[None])
        return create_block_mask(self.mask_mod, None, None, t, t, device="cpu")

    @torch.no_grad()
    def own_maps(self) -> torch.Tensor:
        """(B, heads, T, T): the last call's maps as flex_attention computes them (its q and k,
        one-hot values: row i of the output is query i's map)."""
        q, k, mask = self.seen
        t = q.shape[-2]
        return self._attend(q, k, torch.eye(t).expand(q.shape[0], self.kv_heads, t, t), mask)


class FlexViT(nn.Module):
    """32 px images, 4 px patches (an 8×8 grid), a class token, a learned position embedding,
    pre-norm blocks of FlexAttention and an MLP."""

    def __init__(self, depth=2, dim=48, **attention):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 65, dim) * 0.02)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(FlexAttention(dim, **attention) for _ in range(depth))
        self.mlps = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        for norm, attn, mlp in zip(self.norms, self.attns, self.mlps):
            x = x + attn(norm(x))
            x = x + mlp(x)
        return self.head(x[:, 0])
