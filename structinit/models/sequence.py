"""Two small next-token sequence models of matched size, for the synthetic sequence tasks of
:mod:`structinit.data.sequence_tasks` (the mimetic init of Mamba against attention).
Both map tokens (B, L) LongTensor → logits (B, L, vocab_size). Parameter names::

    MambaLM            embedding · backbone.layers[i].{norm, mixer.{in_proj, conv1d, x_proj,
                       dt_proj, A_log, D, out_proj}} · norm_f · head
    CausalTransformer  embedding · pos_embed (1, max_len, D) · blocks[i].{norm1, attn.qkv,
                       attn.proj, norm2, mlp.fc1, mlp.fc2} · norm · head

The registered presets take ``vocab_size`` and ``max_len`` keywords (``MambaLM`` ignores
``max_len``), so a training loop can build either with
``create_model(name, vocab_size=task.vocab_size, max_len=task.seq_len)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from structinit.models.registry import register_presets
from structinit.models.vit import Block, LayerNorm
from structinit.utils import check_int
from structinit.utils.optional_imports import require

__all__ = ["CausalTransformer", "MambaLM"]

EMBED_STD = 0.02  # token (and position) embeddings ~ N(0, 0.02²), as GPT-2 and the official Mamba LM


def _check_tokens(tokens: torch.Tensor, max_len: int | None = None) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype != torch.long:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens of shape/type {shape}: expected a LongTensor (batch, length) of token ids")
    if max_len is not None and tokens.shape[1] > max_len:
        raise ValueError(f"tokens of length {tokens.shape[1]} > max_len={max_len}: build the model with "
                         f"max_len ≥ {tokens.shape[1]}")


class MambaLM(nn.Module):
    """A Mamba-1 language model: token embedding → ``mambapy.mamba.Mamba`` (pure PyTorch, parallel
    scan) → RMSNorm → linear head. ``mambapy`` is optional: it is imported when a ``MambaLM`` is
    built, so ``import structinit`` works without it.

    The blocks keep their own (official ``mamba_simple``) init: Δ bias from log-uniform
    Δ ∈ [0.001, 0.1], S4D-real A, D = 1. As in the official LM, the embedding is N(0, 0.02²) and
    each ``out_proj`` is divided by √n_layers (pre-norm residual rescale); the head has no bias.

    Args:
        vocab_size: the number of token ids.
        d_model: the width D.
        n_layers: the number of Mamba blocks.
        d_state: the SSM state size N.
        expand: the inner width factor E (d_inner = E·D).
        d_conv: the causal depthwise conv width.
        pscan: parallel scan (True) or mambapy's sequential reference scan.
        max_len: accepted for a uniform interface with :class:`CausalTransformer`; unused.

    Examples:
        >>> model = MambaLM(vocab_size=17, d_model=32, n_layers=1)
        >>> model(torch.zeros(2, 10, dtype=torch.long)).shape
        torch.Size([2, 10, 17])
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, d_state: int = 16, expand: int = 2,
                 d_conv: int = 4, pscan: bool = True, max_len: int | None = None):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("d_state", d_state), ("expand", expand), ("d_conv", d_conv)):
            check_int(name, value, low=1)
        mamba = require("mambapy.mamba", "MambaLM (pip install mambapy==1.2.0)")
        self.vocab_size = vocab_size
        self.config = mamba.MambaConfig(d_model=d_model, n_layers=n_layers, d_state=d_state, expand_factor=expand,
                                        d_conv=d_conv, pscan=pscan)
        self.embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embedding.weight, std=EMBED_STD)
        self.backbone = mamba.Mamba(self.config)
        with torch.no_grad():
            for layer in self.backbone.layers:
                layer.mixer.out_proj.weight.div_(math.sqrt(n_layers))
        self.norm_f = mamba.RMSNorm(d_model, self.config.rms_norm_eps)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW must not decay: every block's ``A_log`` (decay would pull A towards
        −1, a fast-forgetting state, undoing the mimetic init) and skip ``D``, as the official
        implementation's ``_no_weight_decay`` marks them."""
        return {name for name, _ in self.named_parameters() if name.endswith((".A_log", ".D"))}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens)
        return self.head(self.norm_f(self.backbone(self.embedding(tokens))))


class CausalTransformer(nn.Module):
    """A GPT-style causal transformer: (B, L) token ids → (B, L, vocab_size) logits, L ≤ max_len.

    Token embedding plus a learned position embedding ``pos_embed`` (1, max_len, D) (both
    N(0, 0.02²)), then pre-norm :class:`structinit.models.vit.Block` s with ``causal=True``
    (fused ``qkv``, timm names), a final LayerNorm and a bias-free head; structinit's attention
    adapters and the ``mimetic`` scheme find its layers. Linear layers keep PyTorch's default
    init (``structinit.init_(model, "timm")`` gives timm's).

    Args:
        vocab_size: the number of token ids.
        max_len: the longest input (rows of ``pos_embed``).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: the transformer's size.

    Examples:
        >>> model = CausalTransformer(vocab_size=17, max_len=16, embed_dim=32, depth=1, num_heads=2)
        >>> model(torch.zeros(2, 10, dtype=torch.long)).shape
        torch.Size([2, 10, 17])
    """

    def __init__(self, vocab_size: int, max_len: int = 256, embed_dim: int = 64, depth: int = 2,
                 num_heads: int = 2, mlp_ratio: float = 2.0, qkv_bias: bool = True):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("max_len", max_len), ("embed_dim", embed_dim),
                            ("depth", depth), ("num_heads", num_heads)):
            check_int(name, value, low=1)
        self.vocab_size, self.max_len = vocab_size, max_len
        self.embed_dim = self.num_features = embed_dim
        self.num_prefix_tokens = 0
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        nn.init.normal_(self.embedding.weight, std=EMBED_STD)
        self.pos_embed = nn.Parameter(torch.randn(1, max_len, embed_dim) * EMBED_STD)
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, mlp_ratio, qkv_bias, causal=True)
                                      for _ in range(depth)])
        self.norm = LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size, bias=False)

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW must not decay (timm's convention): the position embedding."""
        return {"pos_embed"}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens, self.max_len)
        x = self.embedding(tokens) + self.pos_embed[:, : tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


# ----------------------------------------------------------------------------- entry points
# Matched pairs: at width D, the transformer (head_dim 32, MLP ×2) has within ~15 % of the
# Mamba (E 2, N 16, d_conv 4) model's parameters: per layer ≈ 8.1·D² vs ≈ 8·D².
register_presets(globals(), MambaLM, {
    "mamba_seq_2x64": (dict(vocab_size=256, d_model=64, n_layers=2),
                       "Mamba-1 LM, 2 layers, D 64, N 16, E 2, d_conv 4 (≈ 65 k parameters without embeddings)."),
    "mamba_seq_2x128": (dict(vocab_size=256, d_model=128, n_layers=2),
                        "Mamba-1 LM, 2 layers, D 128, N 16, E 2, d_conv 4 (≈ 233 k parameters without embeddings)."),
})
register_presets(globals(), CausalTransformer, {
    "gpt_seq_2x64": (dict(vocab_size=256, embed_dim=64, depth=2, num_heads=2),
                     "Causal transformer, 2 layers, D 64, 2 heads of 32, MLP ×2, learned PE (max_len 256)."),
    "gpt_seq_2x128": (dict(vocab_size=256, embed_dim=128, depth=2, num_heads=4),
                      "Causal transformer, 2 layers, D 128, 4 heads of 32, MLP ×2, learned PE (max_len 256)."),
})
