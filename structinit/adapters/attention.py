"""Find the attention layers of a model and read/write their per-head weights.

All of structinit's maths works on one layout, the row-vector convention of the papers:
for head h, ``q_h = x @ Wq[h] + bq[h]`` with ``Wq`` of shape (heads, D, r), likewise ``Wk``,
and for the value/output pair ``out = (x @ Wv + bv) @ Wo + bo`` with ``Wv`` (D, heads·r)
and ``Wo`` (heads·r, D). An adapter translates that layout to and from the module's own
parameters (``nn.Linear`` stores the transpose, fused modules store slices).

Built-in adapters cover fused ``qkv`` modules (timm / structinit ViT) and
``torch.nn.MultiheadAttention`` (so ``nn.TransformerEncoderLayer`` works too) here, modules with
separate q/k/v projections in :mod:`structinit.adapters.separate`, and fused or gated layouts
beside it. Register your own with :func:`register_adapter`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from structinit.adapters.position_mlp import CosineLogits, PositionMlpBias, find_cosine_logits, find_position_mlp
from structinit.adapters.relative import RelativeBias, call_logit_terms, find_relative_bias
from structinit.adapters.rotary import Rotary, find_rotary, received_rotary
from structinit.functional.attention import attention_probs, heads_last_lead

Views = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


def in_matrix(view: torch.Tensor) -> torch.Tensor:
    """A q, k or v weight view as ``nn.Linear`` holds it, (heads·r, D): one that keeps its heads on
    an axis of their own, (heads, r, D) (q, k and v packed per head), read with them flattened
    (a copy; writes go to the view itself, in its own shape)."""
    return view.flatten(0, 1) if view.ndim == 3 else view


def out_matrix(view: torch.Tensor) -> torch.Tensor:
    """An output projection view as ``nn.Linear`` holds it, (D, heads·r); (D, heads, r) read with
    the heads flattened (a copy), as :func:`in_matrix`."""
    return view.flatten(1, 2) if view.ndim == 3 else view


class AttentionAdapter:
    """Per-head view of one self-attention module.

    Subclasses set ``num_heads``, ``head_dim``, ``dim`` (input width), ``scale`` (the softmax
    scale the module applies, default head_dim^−½) and implement :meth:`linear_views`, which
    returns for ``'q', 'k', 'v', 'o'`` a ``(weight, bias)`` pair of tensors *aliasing the
    module's storage* in ``nn.Linear`` layout (out_features, in_features).
    """

    module: nn.Module
    num_heads: int
    head_dim: int
    dim: int
    scale: float
    rotary_received: bool = False  # the rotation came with the probe's call (:meth:`receive_call`)
    # Each token's logit on itself masked out (vit-pytorch's LSA): a logit term that does not
    # depend on content, which the maps include and impulse, whose centre offset it hides, refuses.
    masks_self: bool = False
    # A logit term the layer adds that does not depend on content and that the adapter does not
    # model (a position bias of its own), as the probe showed it: row-centred (slices, H, T, T).
    added_term: torch.Tensor | None = None

    def linear_views(self) -> Views:
        raise NotImplementedError

    def read_views(self) -> Views:
        """:meth:`linear_views` as the layer computes with them, for reading: where several biases
        shift a role's channels (a projection's own, then its norm's), their sum (a copy). Writes
        go to :meth:`linear_views`."""
        return self.linear_views()

    @property
    def value_dim(self) -> int:
        """Channels a head of v has, and of the context the output projection reads: ``head_dim``
        but in a layer whose values are wider than its queries and keys (LeViT's, SHViT's)."""
        return getattr(self, "_value_dim", None) or self.head_dim

    @property
    def input_module(self) -> nn.Module:
        """The module whose first input is the (B, T, D) tokens q and k are computed from: the
        attention module itself, or its q/k projection when the module normalises its input
        inside (vit-pytorch), so that captured maps equal the module's own."""
        return self.module

    @property
    def sibling_inputs(self) -> tuple[nn.Module, ...]:
        """Modules besides :attr:`input_module` that read the same tokens (a k/v projection
        beside the q projection that :attr:`input_module` names); a probe that substitutes the
        tokens substitutes them there too."""
        return ()

    def input_tokens(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The (B, T, D) tokens in the arguments of a forward pre-hook on :attr:`input_module`
        (the self-attention query); ``nn.MultiheadAttention``'s sequence-first input is
        transposed, an unbatched (T, D) input gets a batch axis."""
        x = args[0] if args else next(kwargs[k] for k in ("x", "hidden_states", "query", "input") if k in kwargs)
        if isinstance(self.module, nn.MultiheadAttention) and not self.module.batch_first and x.ndim == 3:
            x = x.transpose(0, 1)
        return x if x.ndim == 3 else x.unsqueeze(0)

    def head_values(self, v: torch.Tensor, heads: int) -> torch.Tensor | None:
        """The value projection's output (B, T, heads·r) as (B, heads, T, r), the values each
        head's map is applied to; None when it does not split into ``heads``."""
        b, t, width = v.shape
        return None if width % heads else v.reshape(b, t, heads, -1).transpose(1, 2)

    def output_tokens(self, out: torch.Tensor | None) -> torch.Tensor | None:
        """The module's output as (B, T, D) tokens, to compare with the recomputation (the
        output as it is, but for a module that works on (B, D, H, W) maps)."""
        return out

    # -- reading ---------------------------------------------------------------------------
    def read_qk(self):
        """(Wq, bq, Wk, bk): weights (heads, D, r), biases (heads, r) or None."""
        v = self.read_views()
        return (*self._split_heads(*v["q"]), *self._split_heads(*v["k"]))

    def read_vo(self):
        """(Wv (D, heads·r), bv, Wo (heads·r, D), bo), biases or None."""
        v = self.read_views()
        (wv, bv), (wo, bo) = v["v"], v["o"]
        bv = None if bv is None else bv.reshape(-1)
        return in_matrix(wv.detach()).T.clone(), _clone(bv), out_matrix(wo.detach()).T.clone(), _clone(bo)

    def _split_heads(self, w, b):
        w = w.detach().reshape(self.num_heads, self.head_dim, self.dim).transpose(1, 2).clone()
        return w, None if b is None else b.detach().reshape(self.num_heads, self.head_dim).clone()

    # -- writing (callers validate and compute everything first) -------------------------
    def qk_writes(self, wq, wk, bq=None, bk=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, value) pairs that set Wq/Wk; biases default to zero if present."""
        v = self.linear_views()
        out = []
        for (w_dst, b_dst), w, b in ((v["q"], wq, bq), (v["k"], wk, bk)):
            out.append((w_dst, w.transpose(1, 2).reshape(w_dst.shape)))
            if b_dst is not None:
                out.append((b_dst, torch.zeros_like(b_dst) if b is None else b.reshape(b_dst.shape)))
        return out

    def vo_writes(self, wv, wo, bv=None, bo=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        v = self.linear_views()
        biases = [(b_dst, torch.zeros_like(b_dst) if b is None else b.reshape(b_dst.shape))
                  for b_dst, b in ((v["v"][1], bv), (v["o"][1], bo)) if b_dst is not None]
        return [(v["v"][0], wv.T.reshape(v["v"][0].shape)), (v["o"][0], wo.T.reshape(v["o"][0].shape)), *biases]

    def qk_features(self, x: torch.Tensor):
        """q, k of shape (..., heads, T, r) for input tokens x (..., T, D), with the module's
        q/k normalisation and rotary position embedding if it has them."""
        wq, bq, wk, bk = self.read_qk()
        qk = []
        for w, b, norm in ((wq, bq, "q_norm"), (wk, bk, "k_norm")):
            # one (D, heads·r) product, then split: a batched einsum over the heads is slower
            t = (x @ w.to(x.dtype).transpose(0, 1).reshape(w.shape[1], -1)).unflatten(-1, w.shape[::2]).movedim(-2, -3)
            t = t if b is None else t + b.to(x.dtype)[:, None, :]
            norm = getattr(self.module, norm, None)
            if isinstance(norm, nn.Module):  # the model's own norm, run in its own dtype (a 16-bit norm refuses fp32)
                held = next(norm.parameters(), None)
                # over every head's channels at once (OLMo-2's), or over each head's
                full = held is not None and held.shape[-1] == t.shape[-3] * t.shape[-1] != t.shape[-1]
                u = t.movedim(-3, -2).flatten(-2) if full else t
                u = norm(u if held is None else u.to(held.dtype)).to(x.dtype)
                t = u.unflatten(-1, t.shape[-3::2]).movedim(-2, -3) if full else u
            qk.append(t)
        q, k = qk
        if self.cosine is not None:  # Swin-V2: s_h·cos(q, k)
            q, k = self.cosine.features(q, k, self.scale)
        if self.rotary is not None:
            q, k = self.rotary.rotate(q), self.rotary.rotate(k)
        return q, k

    @functools.cached_property
    def rotary(self) -> Rotary | None:
        """The module's rotary position embedding (2-D RoPE), or None: its own
        (:func:`~structinit.adapters.rotary.find_rotary`), else the one it received in the
        probe's call (:meth:`receive_call`)."""
        return find_rotary(self.module)

    def receive_call(self, args: tuple, kwargs: dict, x: torch.Tensor) -> None:
        """Read what the module receives with a call on tokens ``x`` (B, T, D) that the adapter
        needs to recompute its logits: a rotation the model hands to each layer (timm's EVA and
        RoPE ViTs, DINOv3; :func:`~structinit.adapters.rotary.received_rotary`)."""
        if (self.rotary is None or self.rotary_received) and x.ndim == 3:
            self.rotary = received_rotary(self.module, args, kwargs, x.shape[-2], self.head_dim)
            self.rotary_received = self.rotary is not None

    @functools.cached_property
    def relative(self) -> RelativeBias | PositionMlpBias | None:
        """The module's relative position bias (Swin, BEiT), stored or generated by an MLP
        (Swin-V2, timm's relpos-MLP ViTs), or None
        (:func:`~structinit.adapters.relative.find_relative_bias`,
        :func:`~structinit.adapters.position_mlp.find_position_mlp`)."""
        return find_relative_bias(self.module, self.num_heads) or find_position_mlp(self.module)

    @functools.cached_property
    def cosine(self) -> CosineLogits | None:
        """The module's cosine attention (Swin-V2's s_h·cos(q, k)), or None
        (:func:`~structinit.adapters.position_mlp.find_cosine_logits`)."""
        return find_cosine_logits(self.module)

    def call_terms(self, args: tuple, kwargs: dict, x: torch.Tensor) -> torch.Tensor | None:
        """The additive logit terms the module received with tokens ``x`` (B, T, D) in a call
        (Swin's window mask, BEiT's shared relative bias), as (B, 1 or heads, T, T), or None."""
        return call_logit_terms(args, kwargs, x.shape[0], self.num_heads, x.shape[-2], x)

    def attention_probs(self, x: torch.Tensor, terms: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q kᵀ · scale + relative bias + terms), shape (..., heads, T, T), for input
        tokens x (..., T, D): the module's relative position bias if it has one
        (:attr:`relative`), the call's ``terms`` (:meth:`call_terms`) if given; causal (keys after
        the query masked) when the module says so (:attr:`causal`)."""
        q, k = self.qk_features(x)
        parts = [None if self.relative is None else self.relative.bias(), terms,
                 self_mask(q.shape[-2], q.dtype, q.device) if self.masks_self else None]
        parts = [p.to(q.dtype) for p in parts if p is not None]
        bias = sum(parts[1:], parts[0]) if parts else None  # relative bias + terms + self mask, in that order
        return attention_probs(q, k, self.scale, causal=self.causal, bias=bias)

    def positional_writes(self, offsets: list, grid: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, value) pairs that point the module's own positional scores at each
        head's offset (dy, dx) on ``grid``, for attention whose map mixes in a part that depends
        on position alone (ConViT's gated positional attention); none for plain attention."""
        return []

    def observed_probs(self, maps: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
        """The module's own attention probabilities among the square ``maps`` captured inside
        its forward (:mod:`structinit.adapters.observe`), as ``shape`` (B, heads, T, T): the
        first that has that many entries, or None. An adapter whose module mixes several maps
        (ConViT's gated positional attention) returns the mixture."""
        return next((heads_last_lead(probs, shape[1]).reshape(shape) for probs in maps
                     if probs.numel() == shape.numel()), None)

    @property
    def qk_normalised(self) -> bool:
        """Whether the module normalises q and k after their projections (a ``q_norm`` /
        ``k_norm`` module that is not an identity, as timm's ``qk_norm=True``)."""
        return any(isinstance(getattr(self.module, n, None), nn.Module) and not isinstance(
            getattr(self.module, n), nn.Identity) for n in ("q_norm", "k_norm"))

    masks_future = False  # its own maps, in the probe, close every key after its query and no other

    @property
    def causal(self) -> bool:
        """Whether the module masks future keys: its maps in the probe do (:attr:`masks_future`, a
        mask its forward builds), or a ``causal`` or ``is_causal`` attribute is True (structinit's
        causal :class:`~structinit.models.vit.Attention`, Hugging Face decoders)."""
        return self.masks_future or any(getattr(self.module, attr, None) is True for attr in ("causal", "is_causal"))


def self_mask(tokens: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """(T, T): −∞ on the diagonal, 0 elsewhere: the logit term of attention that masks each
    token's attention to itself."""
    out = torch.zeros(tokens, tokens, dtype=dtype, device=device)
    return out.fill_diagonal_(float("-inf"))


def module_scale(module: nn.Module, head_dim: int) -> float:
    """The softmax scale a module states (``scale`` as in timm, ``scaling`` as in Hugging
    Face), or head_dim^−½."""
    for attr in ("scale", "scaling"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return head_dim**-0.5


def _clone(t):
    return None if t is None else t.detach().clone()


def split_views(weight: torch.Tensor, bias: torch.Tensor | None, n: int, names: str = "qkv") -> Views:
    """(weight, bias) rows [i·n, (i + 1)·n) of a fused projection, under the i-th of ``names``."""
    return {name: (weight[i * n:(i + 1) * n], None if bias is None else bias[i * n:(i + 1) * n])
            for i, name in enumerate(names)}


class FusedQKVAdapter(AttentionAdapter):
    """Modules with ``qkv = Linear(D, 3·heads·r)`` laid out [q; k; v] and ``proj`` (timm)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.num_heads = int(module.num_heads)
        inner = module.qkv.out_features // 3
        self.head_dim = int(getattr(module, "head_dim", inner // self.num_heads))
        self.dim = module.qkv.in_features
        self.scale = module_scale(module, self.head_dim)

    def linear_views(self) -> Views:
        qkv, proj, n = self.module.qkv, self.module.proj, self.num_heads * self.head_dim
        views = split_views(qkv.weight, qkv.bias, n)
        if qkv.bias is None:  # BEiT keeps q/v biases apart from the Linear (and k's as a zero buffer)
            parts = [getattr(self.module, f"{name}_bias", None) for name in "qkv"]
            if any(isinstance(t, nn.Parameter) for t in parts):
                views = {name: (views[name][0], t if isinstance(t, torch.Tensor) else None)
                         for name, t in zip("qkv", parts)}
        return views | {"o": (proj.weight, proj.bias)}

    @staticmethod
    def matches(m: nn.Module) -> bool:
        return (
            isinstance(getattr(m, "qkv", None), nn.Linear)
            and isinstance(getattr(m, "proj", None), nn.Linear)
            and hasattr(m, "num_heads")
            and m.qkv.out_features % 3 == 0
        )


_HEAD_ATTRS = ("num_heads", "n_heads", "num_attention_heads", "heads")


def is_self_attention(module: nn.MultiheadAttention) -> bool:
    """True when keys and values have the query's width, i.e. torch packs q/k/v into one
    ``in_proj_weight`` (what torch's private ``_qkv_same_embed_dim`` records)."""
    return module.kdim == module.embed_dim and module.vdim == module.embed_dim


class MultiheadAttentionAdapter(AttentionAdapter):
    """``torch.nn.MultiheadAttention`` used as self-attention (packed in-projection; torch
    uses separate q/k/v weights only when kdim/vdim differ, i.e. for cross-attention)."""

    def __init__(self, module: nn.MultiheadAttention):
        if not is_self_attention(module):
            raise ValueError(
                f"nn.MultiheadAttention with kdim={module.kdim}, vdim={module.vdim} != "
                f"embed_dim={module.embed_dim} is cross-attention; structinit initialises "
                "self-attention (queries and keys from the same tokens) only"
            )
        self.module = module
        self.num_heads = module.num_heads
        self.head_dim = module.head_dim
        self.dim = module.embed_dim
        self.scale = self.head_dim**-0.5

    def linear_views(self) -> Views:
        m = self.module
        return split_views(m.in_proj_weight, m.in_proj_bias, m.embed_dim) | {"o": (m.out_proj.weight, m.out_proj.bias)}

    @staticmethod
    def matches(m: nn.Module) -> bool:
        return isinstance(m, nn.MultiheadAttention) and is_self_attention(m)


def head_mixers(module: nn.Module, num_heads: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, tensor, identity value) of each talking-heads mixer of an attention ``module``:
    a direct child ``nn.Linear(num_heads, num_heads)`` (timm's CaiT ``proj_l``/``proj_w``;
    its weight to I, its bias to 0), a 1×1 ``nn.Conv2d`` from num_heads channels to num_heads
    (EfficientFormerV2's ``talking_head1``/``talking_head2``: the identity kernel) or a direct
    (num_heads, num_heads) Parameter (vit-pytorch's
    ``mix_heads_pre_attn``/``post_attn``; to I). Set so, every head keeps its own map."""
    if num_heads < 2:
        return []
    eye = torch.eye(num_heads)
    found = []
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.in_features == child.out_features == num_heads:
            found.append((f"{name}.weight", child.weight, eye))
        elif (isinstance(child, nn.Conv2d) and child.in_channels == child.out_channels == num_heads
              and child.kernel_size == (1, 1) and child.groups == 1):  # heads as the channels of the maps
            found.append((f"{name}.weight", child.weight, eye[:, :, None, None]))
        else:
            continue
        if child.bias is not None:
            found.append((f"{name}.bias", child.bias, torch.zeros(num_heads)))
    for name, p in module.named_parameters(recurse=False):
        if p.shape == (num_heads, num_heads):
            found.append((name, p, eye))
    return found


def mixes_heads(func, args, result: torch.Tensor) -> bool:
    """Whether a torch call (``func`` on ``args``, giving ``result``) is a talking-heads mixer on maps
    held as images: a 1×1 convolution from the H heads of a (B, H, T, S) map to H."""
    x, weight = (*args, None, None)[:2]
    return (func is torch.nn.functional.conv2d and isinstance(weight, torch.Tensor) and x.ndim == 4
            and tuple(weight.shape) == (x.shape[1], x.shape[1], 1, 1) and result.shape == x.shape)


def adapter_logits(adapter: AttentionAdapter, x: torch.Tensor, terms: torch.Tensor | None) -> torch.Tensor:
    """q kᵀ·scale + relative bias + the call's terms, (B, H, T, T), as the adapter reads the layer."""
    q, k = adapter.qk_features(x)
    logits = q @ k.transpose(-2, -1) * adapter.scale
    if adapter.relative is not None:
        logits = logits + adapter.relative.bias().to(logits.dtype)
    if terms is not None:
        logits = logits + terms.to(logits.dtype)
    if adapter.masks_self:
        logits = logits + self_mask(logits.shape[-1], logits.dtype, logits.device)
    return logits
