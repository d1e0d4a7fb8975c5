"""An attention layer as :mod:`structinit.adapters.provenance` found it: strided views of the
module's own parameters, whatever its names and layout, and what the trace saw about its map
(scale, causal mask, grouped keys and values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from structinit.adapters.attention import AttentionAdapter, Views
from structinit.adapters.provenance_record import first_tensor


@dataclass(frozen=True)
class TokenMap:
    """``channel_axis`` of the module's input holds the width and ``batch_axis`` the images (the
    first axis, or the second of a sequence-first (T, B, D) input); the other axes are positions,
    flattened in order. ``windows`` (nW, T), when the module cuts its input into windows, holds
    each window's positions in the order its map reads them (per image; the module's slices run
    image by image); None when the map reads the positions as they are."""

    channel_axis: int
    windows: torch.Tensor | None = None
    batch_axis: int = 0

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the call's input, or its output of the same layout) as (slices, T, D) tokens."""
        batch = self.batch_axis if x.ndim > 2 else 0
        x = x if x.ndim > 2 else x.unsqueeze(0)  # an unbatched (T, D) call
        x = x.movedim((batch % x.ndim, self.channel_axis % x.ndim), (0, -1)).flatten(1, -2)
        if self.windows is None:
            return x  # (B, positions, D)
        w = self.windows.to(x.device)
        return x[:, w].reshape(-1, w.shape[1], x.shape[-1])


class TracedAdapter(AttentionAdapter):
    """An attention module read by provenance: ``views`` holds, for 'q', 'k', 'v' and 'o',
    (weight, bias) strided views of the module's own parameters in ``nn.Linear`` layout.

    ``token_map`` turns a call's input or output into the (slices, T, D) tokens its maps are made
    of: (B, T, D) tokens as they are, the pixels of (B, D, H, W) or (B, H, W, D) maps, the
    windows a module cuts from them (:mod:`structinit.adapters.provenance_tokens`). ``kv_of[h]``
    is the key/value head query head h reads: grouped-query attention has fewer key/value heads
    than query heads (``kv_heads``), and the 'k' and 'v' views hold ``kv_heads`` of them. A head
    of v may be wider than one of q and k (``value_dim``). ``more_biases[role]`` holds the role's
    biases beyond the one its view names (a projection's own bias before a BatchNorm's): reads
    add them in (:meth:`read_views`), and every write of the role sets them to zero, so that the
    bias written is the role's whole shift.
    """

    is_causal = False  # found by the trace: keys after the query are masked
    # Why the output is no projection of the context (then there is no 'o' view): a mechanism, in words
    output_unread: str | None = None

    def __init__(self, module: nn.Module, views: Views, num_heads: int, head_dim: int, scale: float,
                 token_map: TokenMap | None = None, param_names: dict[str, str] | None = None,
                 kv_of: tuple[int, ...] | None = None, inputs: tuple[nn.Module, ...] = (),
                 value_dim: int | None = None, more_biases: dict[str, tuple[torch.Tensor, ...]] | None = None):
        self.module, self._views = module, views
        self._inputs = tuple(inputs)  # the submodules that read the tokens, when the module normalises them inside
        self.num_heads, self.head_dim = int(num_heads), int(head_dim)
        self._value_dim = None if value_dim is None else int(value_dim)
        self.dim = int(views["q"][0].shape[-1]) if views else 0
        self.scale, self.token_map = float(scale), token_map or TokenMap(-1)
        self.param_names = param_names or {}  # role → the parameter its weight lives in, for messages
        self.kv_of = tuple(range(self.num_heads)) if kv_of is None else tuple(kv_of)
        self.kv_heads = max(self.kv_of) + 1
        self.more_biases = dict(more_biases or {})

    @property
    def grouped(self) -> bool:
        """Whether several query heads share a key/value head (grouped-query attention)."""
        return self.kv_heads != self.num_heads

    def linear_views(self) -> Views:
        return dict(self._views)

    def read_views(self) -> Views:
        views = dict(self._views)
        for role, more in self.more_biases.items():
            weight, bias = views[role]
            views[role] = (weight, bias.detach() + sum(b.detach().reshape(bias.shape) for b in more))
        return views

    def _more_zeroed(self, roles: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(b, torch.zeros_like(b)) for role in roles for b in self.more_biases.get(role, ())]

    @property
    def input_module(self) -> nn.Module:
        return self._inputs[0] if self._inputs else self.module

    @property
    def sibling_inputs(self) -> tuple[nn.Module, ...]:
        return self._inputs[1:]

    @property
    def causal(self) -> bool:
        return self.is_causal

    masked = None  # (slices, T, T): pairs the traced call masked whatever the content (a packed sequence's blocks)

    def input_tokens(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return self.token_map.tokens(first_tensor(args, kwargs))

    def call_terms(self, args: tuple, kwargs: dict, x: torch.Tensor) -> torch.Tensor | None:
        """The terms the call hands the module, and the mask the module built inside on the traced
        call (a block-diagonal mask over a packed sequence), for calls of the same shape."""
        terms = super().call_terms(args, kwargs, x)
        closed = self.masked
        if closed is None or closed.shape[0] not in (1, x.shape[0]) or closed.shape[-1] != x.shape[-2]:
            return terms
        inner = torch.zeros(closed.shape, dtype=x.dtype, device=x.device)
        inner = inner.masked_fill(closed.to(x.device), float("-inf"))[:, None]
        return inner if terms is None else terms + inner

    def output_tokens(self, out: torch.Tensor | None) -> torch.Tensor | None:
        return None if out is None else self.token_map.tokens(out)

    def _heads_of(self, w, b, heads):
        w = w.detach().reshape(heads, self.head_dim, self.dim).transpose(1, 2).clone()
        return w, None if b is None else b.detach().reshape(heads, self.head_dim).clone()

    def read_qk(self):
        """(Wq, bq, Wk, bk) per query head: a grouped layer's key heads repeated as its queries read them."""
        v = self.read_views()
        wq, bq = self._heads_of(*v["q"], self.num_heads)
        wk, bk = self._heads_of(*v["k"], self.kv_heads)
        index = torch.tensor(self.kv_of)
        return wq, bq, wk[index], None if bk is None else bk[index]

    def qk_writes(self, wq, wk, bq=None, bk=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As :meth:`AttentionAdapter.qk_writes`; a grouped layer takes ``wk`` (kv_heads, D, r)."""
        if wk.shape[0] != self.kv_heads:
            raise ValueError(f"internal: {wk.shape[0]} key heads for a layer with {self.kv_heads}")
        out = []
        for (w_dst, b_dst), w, b in ((self._views["q"], wq, bq), (self._views["k"], wk, bk)):
            out.append((w_dst, w.transpose(1, 2).reshape(w_dst.shape)))
            if b_dst is not None:
                out.append((b_dst, torch.zeros_like(b_dst) if b is None else b.reshape(b_dst.shape)))
        return out + self._more_zeroed("qk")

    def vo_writes(self, wv, wo, bv=None, bo=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return super().vo_writes(wv, wo, bv, bo) + self._more_zeroed("v")

    def head_values(self, v: torch.Tensor, heads: int) -> torch.Tensor | None:
        b, t, width = v.shape
        if heads != self.num_heads or width != self.kv_heads * self.value_dim:
            return None
        v = v.reshape(b, t, self.kv_heads, self.value_dim).transpose(1, 2)
        return v[:, torch.tensor(self.kv_of)]


class CallTokens:
    """Reads the tokens of a call the way a :class:`TracedAdapter` will, before there is one:
    what a probe records for a module the trace is about to read."""

    sibling_inputs = ()

    @staticmethod
    def input_tokens(args: tuple, kwargs: dict) -> torch.Tensor:
        x = first_tensor(args, kwargs)
        return x.flatten(2).transpose(1, 2) if x.ndim == 4 else (x if x.ndim == 3 else x.unsqueeze(0))
