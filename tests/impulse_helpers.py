"""Helpers shared by the impulse tests: small models, maps recomputed from raw weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import structinit


def small_vit(img_size=16, patch_size=2, embed_dim=32, depth=2, num_heads=2, **kw):
    opts = dict(num_classes=10, class_token=False, global_pool="avg", pos_embed="sincos")
    opts.update(kw)
    return structinit.VisionTransformer(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim,
                                        depth=depth, num_heads=num_heads, **opts)


def grid_pe(model) -> torch.Tensor:
    pe = model.pos_embed.detach().reshape(-1, model.embed_dim)
    return pe[pe.shape[0] - model.patch_embed.num_patches:]


def pseudo_input(model) -> torch.Tensor:
    """LayerNorm of the grid rows of the PE: what each layer sees without image content."""
    pe = grid_pe(model).float()
    return F.layer_norm(pe, (pe.shape[-1],), eps=1e-6)


def head_maps(attn, x: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ · scale) per head, (heads, N, N), from the fused qkv Linear itself."""
    n = x.shape[0]
    inner = attn.num_heads * attn.head_dim
    qkv = F.linear(x, attn.qkv.weight, attn.qkv.bias)
    q = qkv[:, :inner].reshape(n, attn.num_heads, attn.head_dim).transpose(0, 1)
    k = qkv[:, inner:2 * inner].reshape(n, attn.num_heads, attn.head_dim).transpose(0, 1)
    return (q @ k.transpose(-1, -2) * attn.scale).softmax(-1)


def hit_and_mass(model, offsets_per_layer=None):
    """(hit, mass) per layer×head, computed independently of structinit.impulse_fidelity."""
    grid = model.patch_embed.grid_size
    x = pseudo_input(model)
    hits, masses = [], []
    for i, blk in enumerate(model.blocks):
        offs = offsets_per_layer[i] if offsets_per_layer else blk.attn.structinit_impulse["offsets"]
        probs = head_maps(blk.attn, x)
        hrow, mrow = [], []
        for h, off in enumerate(offs):
            t = structinit.target_index(grid, off)
            rows = torch.nonzero(t >= 0).squeeze(1)
            hrow.append((probs[h, rows].argmax(-1) == t[rows]).float().mean().item())
            mrow.append(probs[h, rows, t[rows]].mean().item())
        hits.append(hrow)
        masses.append(mrow)
    return torch.tensor(hits), torch.tensor(masses)


def logits_from_factors(z, wq, wk):
    """(heads, N, N) logits (z Wq[h])(z Wk[h])ᵀ."""
    return torch.stack([(z @ wq[h]) @ (z @ wk[h]).T for h in range(wq.shape[0])])


def ln_sincos(grid, dim):
    return F.layer_norm(structinit.sincos_2d(grid, dim, dtype=torch.float64), (dim,), eps=1e-6)


def target_margins(logits, grid, offsets):
    """Per head: min over rows with an in-grid target of (target logit − best other logit)."""
    out = []
    for h, off in enumerate(offsets):
        t = structinit.target_index(grid, off)
        rows = torch.nonzero(t >= 0).squeeze(1)
        row_logits = logits[h, rows].clone()
        on_target = row_logits[torch.arange(len(rows)), t[rows]].clone()
        row_logits[torch.arange(len(rows)), t[rows]] = -float("inf")
        out.append(float((on_target - row_logits.max(-1).values).min()))
    return out
