"""Small language models in the styles people write them, for mimetic on 1-D sequences: nanoGPT's
causal self-attention (one fused ``c_attn`` Linear, a causal mask held as a buffer or passed to
``scaled_dot_product_attention``), a grouped-query attention with rotary positions, as in Llama,
the same with attention sinks, as in gpt-oss, and an ALiBi attention laid out as Bloom's. Each
attention records the softmax input and output its own forward formed."""

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: ``c_attn`` → q, k, v; ``flash`` uses scaled_dot_product_attention with
    is_causal, otherwise a tril buffer masks the logits before the softmax."""

    def __init__(self, dim, heads, block, flash):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.n_head, self.flash = heads, flash
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        self.last_logits, self.last_probs = att.detach(), F.softmax(att, dim=-1).detach()
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, attn, dim):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), attn, nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token and learned position embeddings, pre-norm blocks, a tied LM head."""

    def __init__(self, vocab=97, block=32, dim=48, heads=3, depth=2, flash=False, attn=None):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        make = attn or (lambda: CausalSelfAttention(dim, heads, block, flash))
        self.h = nn.ModuleList(Block(make(), dim) for _ in range(depth))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def rotate(x, positions, base=10000.0):
    """Rotary position embedding, half-split (Llama's ``rotate_half``): channels i and i + r/2 of
    each head turn by position · base^(−2i/r)."""
    r = x.shape[-1]
    freq = base ** (-torch.arange(0, r, 2, dtype=torch.float32) / r)
    angle = positions[:, None].float() * freq[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = torch.cat([-x[..., r // 2:], x[..., :r // 2]], -1)
    return x * cos + half * sin


class GroupedRotaryAttention(nn.Module):
    """Llama-style attention: ``heads`` query heads share ``kv_heads`` key/value heads, q and k
    rotated by position, causal; the keys repeated per query head (``repeat_kv``) unless
    ``sdpa``, which hands the fewer heads to scaled_dot_product_attention(enable_gqa=True)."""

    def __init__(self, dim, heads, kv_heads, sdpa=False):
        super().__init__()
        self.heads, self.kv_heads, self.r, self.sdpa = heads, kv_heads, dim // heads, sdpa
        self.wq = nn.Linear(dim, heads * self.r, bias=False)
        self.wkv = nn.ModuleList(nn.Linear(dim, kv_heads * self.r, bias=False) for _ in range(2))
        self.wo = nn.Linear(heads * self.r, dim, bias=False)

    def project(self, x):
        """q, k and v of the heads (k and v of the fewer key heads), and the causal logits."""
        b, t, _ = x.shape
        pos = torch.arange(t)
        q = rotate(self.wq(x).view(b, t, self.heads, self.r).transpose(1, 2), pos)
        k = rotate(self.wkv[0](x).view(b, t, self.kv_heads, self.r).transpose(1, 2), pos)
        v = self.wkv[1](x).view(b, t, self.kv_heads, self.r).transpose(1, 2)
        logits = (q @ k.repeat_interleave(self.heads // self.kv_heads, 1).transpose(-2, -1)) / self.r**0.5
        return q, k, v, logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))

    def forward(self, x):
        q, k, v, logits = self.project(x)
        self.last_logits, self.last_probs = logits.detach(), logits.softmax(-1).detach()
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = logits.softmax(-1) @ v.repeat_interleave(self.heads // self.kv_heads, 1)
        return self.wo(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class SinkAttention(GroupedRotaryAttention):
    """gpt-oss's attention: a learned logit per head (a sink) joined to every row of the causal
    logits, the row's largest logit subtracted, one softmax over both, and the sink's column
    dropped before the map weights the values; ``first`` joins it before the keys."""

    def __init__(self, dim, heads, kv_heads, first=False):
        super().__init__(dim, heads, kv_heads)
        self.sinks, self.first = nn.Parameter(torch.randn(heads)), first

    def forward(self, x):
        _, _, v, logits = self.project(x)
        sink = self.sinks.reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        joined = torch.cat([sink, logits] if self.first else [logits, sink], -1)
        probs = F.softmax(joined - joined.max(-1, keepdim=True).values, dim=-1)
        probs = probs[..., 1:] if self.first else probs[..., :-1]
        self.last_logits, self.last_probs = logits.detach(), probs.detach()
        y = probs @ v.repeat_interleave(self.heads // self.kv_heads, 1)
        return self.wo(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class AlibiAttention(nn.Module):
    """Bloom's layout: q and k folded to (B·heads, T, r), the logits from
    ``alibi.baddbmm(batch1=q, batch2=kᵀ)`` (a per-head slope times each key's position as the
    input it adds), the causal softmax on the (B, heads, T, T) view, the map folded back for
    ``torch.bmm``. Keeps its own logits (``last_logits``) and the bias in them (``last_bias``)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.query_key_value, self.dense, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
        self.register_buffer("slopes", 2.0 ** -torch.arange(1.0, heads + 1.0))

    def forward(self, x):
        b, t, c = x.shape
        r = c // self.heads
        q, k, v = (y.reshape(b, t, self.heads, r).transpose(1, 2).reshape(b * self.heads, t, r)
                   for y in self.query_key_value(x).chunk(3, dim=-1))
        alibi = (self.slopes[:, None] * torch.arange(t)).repeat(b, 1)[:, None, :]  # (B·heads, 1, T)
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=r**-0.5).view(b, self.heads, t, t)
        logits = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        self.last_logits, self.last_bias = logits.detach(), alibi.view(b, self.heads, 1, t).detach()
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).view(b * self.heads, t, t)
        context = torch.bmm(probs, v).view(b, self.heads, t, r)
        return self.dense(context.transpose(1, 2).reshape(b, t, c))


class SeqAttention(nn.Module):
    """Attention with separate ``q_proj``/``k_proj``/``v_proj``/``out_proj`` (Bart's names):
    self-attention, causal or not, or with ``memory`` cross-attention from x to it."""

    def __init__(self, dim, heads, causal=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.heads, self.causal = heads, causal

    def forward(self, x, memory=None):
        b, t, c = x.shape
        source = x if memory is None else memory
        split = lambda y: y.view(b, y.shape[1], self.heads, c // self.heads).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(source)), split(self.v_proj(source))
        att = q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5
        if self.causal:
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        self.last_logits = att.detach()
        return self.out_proj((F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, c))


class TinySeq2Seq(nn.Module):
    """An encoder block over the ids, then a decoder block of causal self-attention and
    cross-attention to the encoder's output (Bart's layout, one block each, post-norm-free)."""

    def __init__(self, vocab=97, block=32, dim=48, heads=3):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.encoder_attn_self = SeqAttention(dim, heads)
        self.self_attn, self.encoder_attn = SeqAttention(dim, heads, causal=True), SeqAttention(dim, heads)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        memory = x + self.encoder_attn_self(x)
        y = x + self.self_attn(x)
        return self.head(y + self.encoder_attn(y, memory))


class TwoNormAttention(SeqAttention):
    """Self-attention whose q and k read the tokens through norms of their own: keys projected
    from other tensors than the queries, yet over the same tokens."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.q_norm_in, self.k_norm_in = nn.LayerNorm(dim), nn.LayerNorm(dim)
        with torch.no_grad():
            self.k_norm_in.weight.mul_(torch.linspace(0.5, 1.5, dim))

    def forward(self, x, memory=None):
        b, t, c = x.shape
        split = lambda y: y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        q, k, v = split(self.q_proj(self.q_norm_in(x))), split(self.k_proj(self.k_norm_in(x))), split(self.v_proj(x))
        att = F.softmax(q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5, dim=-1)
        return self.out_proj((att @ v).transpose(1, 2).reshape(b, t, c))


class TinyEncoder(nn.Module):
    def __init__(self, attn, vocab=97, block=32, dim=48):
        super().__init__()
        self.embed, self.pos, self.attn, self.head = nn.Embedding(vocab, dim), nn.Embedding(block, dim), attn, \
            nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(x + self.attn(x))
