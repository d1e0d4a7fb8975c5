"""Attention maths shared by every path that computes attention maps: the one
implementation of the attention probabilities, LayerNorm of position-only tokens, the
heads axis of a map read from a module's forward, the key columns a map keeps when its
sinks are cut off, and how strongly each head's logits stand
on their diagonal (what mimetic's check measures)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool = False,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    r"""Attention probabilities softmax(scale · q kᵀ + bias) over the last axis; with ``causal``,
    query i sees keys j ≤ i only (the mask of a decoder, aligned at the first token).

    Args:
        q: queries (..., T, r).
        k: keys (..., S, r).
        scale: the softmax scale the attention applies (usually r^−½).
        causal: mask keys after the query (logit −∞).
        bias: an additive logit term broadcastable to (..., T, S): a relative position bias,
            a window mask.

    Returns:
        (..., T, S) probabilities; each row sums to one.

    Examples:
        >>> q = k = torch.eye(3)
        >>> attention_probs(q, k, 10.0).argmax(-1)
        tensor([0, 1, 2])
        >>> attention_probs(q, k, 10.0, causal=True)[0]
        tensor([1., 0., 0.])
    """
    logits = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        logits = logits + bias
    return (mask_future(logits) if causal else logits).softmax(dim=-1)


def mask_future(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (…, T, S) with every key after its query closed (−∞): a causal mask."""
    t, s = logits.shape[-2:]
    return logits.masked_fill(torch.ones(t, s, dtype=torch.bool, device=logits.device).triu(1), float("-inf"))


LN_EPS = 1e-6  # timm's ViT LayerNorm eps


def layer_norm_tokens(x: torch.Tensor, eps: float = LN_EPS) -> torch.Tensor:
    """LayerNorm without affine over the last axis, in float64: the position-only pseudo input
    LayerNorm(PE) that a ViT block's first norm gives at init (its weight 1, bias 0; eps 1e-6
    as timm's ViT)."""
    return F.layer_norm(x.double(), (x.shape[-1],), eps=eps)


def heads_last_lead(probs: torch.Tensor, heads: int) -> torch.Tensor:
    """A map (…, T, T) with more than four axes whose heads axis is not the third from last (NesT's
    (B, heads, blocks, T, T)) with that axis moved there, so that a reshape to (rows, heads, T, T)
    keeps each head's maps together: the last leading axis of size ``heads`` is taken for it."""
    if probs.ndim < 5 or probs.shape[-3] == heads:
        return probs
    axis = next((a for a in reversed(range(probs.ndim - 2)) if probs.shape[a] == heads), None)
    return probs if axis is None else probs.movedim(axis, -3)


MASKED_PROB = 1e-30  # a pair whose probability is below this was masked (a −100 or −inf logit)


def closes_the_future(closed: torch.Tensor) -> bool:
    """Whether ``closed`` (…, T, T), the pairs a map masks, is every key after its query and no
    other: a causal mask."""
    t = closed.shape[-1]
    above = torch.ones(t, t, dtype=torch.bool, device=closed.device).triu(1)
    return t > 1 and bool((closed == above).all())


def masked_inside(real: torch.Tensor, ours: torch.Tensor, atol: float) -> bool:
    """Whether the real maps are the adapter's with some pairs closed and every row renormalised
    over the others: a mask the layer builds inside its forward (Swin's shifted windows, when the
    module makes it itself), a logit term that does not depend on content."""
    open_pairs = real > MASKED_PROB
    if bool(open_pairs.all()) or not bool(open_pairs.any(-1).all()):
        return False
    kept = ours.masked_fill(~open_pairs, 0)
    kept = kept / kept.sum(-1, keepdim=True).clamp_min(1e-30)
    return float((real - kept).abs().max()) <= atol


def kept_keys(probs: torch.Tensor, cut) -> slice | None:
    """The key columns of a map ``probs`` (…, T, S) that ``cut`` (…, T, S′), S′ < S, holds: its
    first or last S′ (attention sinks cut off after the softmax), else None."""
    if not isinstance(cut, torch.Tensor) or not cut.ndim or cut.shape[:-1] != probs.shape[:-1]:
        return None
    n = cut.shape[-1]
    if not 0 < n < probs.shape[-1]:
        return None
    return next((slice(a, a + n) for a in (0, probs.shape[-1] - n) if torch.equal(cut, probs[..., a:a + n])), None)


MIN_DIAGONAL_TOKENS = 3  # a diagonal stands out of a spread: two logits besides it at least


def diagonal_strength(logits: torch.Tensor) -> torch.Tensor:
    """Per head, how far each token's logit on itself stands above its logits on the others,
    in units of their spread: mean over rows of (L_ii − mean_j≠i L_ij) / std_j≠i L_ij, for
    logits (B, H, T, T) (any constant per row cancels, so log-probabilities serve). It needs
    T ≥ 3 (two logits off the diagonal to have a spread); ValueError otherwise."""
    t = logits.shape[-1]
    if t < MIN_DIAGONAL_TOKENS:
        raise ValueError(f"diagonal_strength: {t} tokens leave {max(t - 1, 0)} logit(s) off the diagonal per row, "
                         f"no spread to measure against; it needs at least {MIN_DIAGONAL_TOKENS} tokens")
    eye = torch.eye(t, dtype=torch.bool, device=logits.device)
    # −∞, or the most negative float a mask fills in (Hugging Face's finfo.min): a closed pair either way
    finite = torch.isfinite(logits) & (logits > torch.finfo(logits.dtype).min / 2)
    diag = logits.diagonal(dim1=-2, dim2=-1)
    # Masked pairs (a causal mask's −∞ or finfo.min) are no logits: each row is measured on its open keys.
    # Whole-matrix masks, not a gather of the off-diagonal entries: one pass over (B, H, T, T) each.
    off_open = finite & ~eye
    count = off_open.sum(-1)
    mean = torch.where(off_open, logits, 0.0).sum(-1) / count.clamp_min(1)
    var = torch.where(off_open, (logits - mean[..., None]) ** 2, 0.0).sum(-1) / (count - 1).clamp_min(1)
    rows = (count >= 2) & finite.diagonal(dim1=-2, dim2=-1)
    score = torch.where(rows, (diag - mean) / var.sqrt().clamp_min(1e-6), torch.zeros_like(diag))
    used = rows.sum(dim=(0, -1)).clamp_min(1)
    return score.sum(dim=(0, -1)) / used
