"""Attention modules with separate q, k and v projections (``q``/``k``/``v``, ``q_proj``/…,
``query``/…, ``to_q``/…, ``wq``/…), or q apart from a fused [k; v] (``q``/``kv``, ``to_q``/``to_kv``):
Hugging Face, vit-pytorch, x-transformers, open_clip and hand-written ViTs. The output
projection is the module's own, or one a sibling module holds (Hugging Face's
``attention.output.dense``)."""

from __future__ import annotations

from torch import nn

from structinit.adapters.attention import _HEAD_ATTRS, AttentionAdapter, Views, module_scale, split_views

__all__ = ["SeparateQKVAdapter", "sibling_output"]

_SEPARATE_NAMES = (("q", "k", "v"), ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"),
                   ("to_q", "to_k", "to_v"), ("wq", "wk", "wv"))
_SPLIT_KV_NAMES = (("q", "kv"), ("to_q", "to_kv"), ("q_proj", "kv_proj"))  # q apart, k and v fused [k; v]
_OUT_NAMES = ("proj", "o_proj", "out_proj", "o", "out", "to_out", "wo")


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    """The Linear ``module.<name>``, or the first child of an ``nn.Sequential`` there
    (vit-pytorch's ``to_out = Sequential(Linear, Dropout)``), else None."""
    child = getattr(module, name, None)
    if isinstance(child, nn.Sequential) and len(child) and isinstance(child[0], nn.Linear):
        child = child[0]
    return child if isinstance(child, nn.Linear) else None


def _heads(module: nn.Module) -> int | None:
    value = next((getattr(module, a) for a in _HEAD_ATTRS if hasattr(module, a)), None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class SeparateQKVAdapter(AttentionAdapter):
    """Modules with the q/k/v projections of the module doc, an output projection (proj, o_proj,
    out_proj, o, out, to_out, wo; else ``out``, a sibling's) and a head count attribute. What the
    module computes is checked against its own forward (:mod:`structinit.adapters.verify`)."""

    def __init__(self, module: nn.Module, out: nn.Linear | None = None):
        self.module = module
        self._qkv = next((n for n in _SEPARATE_NAMES if _all_linear(module, n)), None)
        self._split = None if self._qkv else next(n for n in _SPLIT_KV_NAMES if _all_linear(module, n))
        self._sibling = out  # an output projection held beside the module (Hugging Face's `output.dense`)
        self._out = None if out is not None else next(n for n in _OUT_NAMES if _linear(module, n) is not None)
        self.num_heads = _heads(module)
        q = _linear(module, (self._qkv or self._split)[0])
        self.head_dim = int(getattr(module, "head_dim", q.out_features // self.num_heads))
        self.dim = q.in_features
        self.scale = module_scale(module, self.head_dim)

    @property
    def input_module(self) -> nn.Module:
        """The q projection when the module normalises its input inside (vit-pytorch's
        ``self.norm``), so that the captured tokens are what q and k are computed from; else
        the module itself (its call carries the masks a map needs)."""
        if isinstance(getattr(self.module, "norm", None), nn.LayerNorm):
            return _linear(self.module, (self._qkv or self._split)[0])
        return self.module

    @property
    def sibling_inputs(self) -> tuple[nn.Module, ...]:
        if self.input_module is self.module:
            return ()
        return tuple(_linear(self.module, n) for n in (self._qkv or self._split)[1:])

    def linear_views(self) -> Views:
        out = self._sibling if self._sibling is not None else _linear(self.module, self._out)
        if self._qkv is not None:
            lin = [_linear(self.module, n) for n in self._qkv]
            return {name: (m.weight, m.bias) for name, m in zip("qkv", lin)} | {"o": (out.weight, out.bias)}
        q, kv = (_linear(self.module, n) for n in self._split)
        return ({"q": (q.weight, q.bias)} | split_views(kv.weight, kv.bias, kv.out_features // 2, "kv")
                | {"o": (out.weight, out.bias)})

    @staticmethod
    def matches(m: nn.Module) -> bool:
        if _heads(m) is None or not any(_linear(m, n) is not None for n in _OUT_NAMES):
            return False
        if any(_all_linear(m, n) for n in _SEPARATE_NAMES):
            return True
        split = next((n for n in _SPLIT_KV_NAMES if _all_linear(m, n)), None)
        return split is not None and _linear(m, split[1]).out_features % 2 == 0


def _all_linear(m: nn.Module, names) -> bool:
    return all(_linear(m, n) is not None for n in names)


_SIBLING_OUT_NAMES = ("dense", "proj", "out_proj", "o_proj")


def sibling_output(parent: nn.Module | None, module: nn.Module) -> nn.Linear | None:
    """The output projection of a ``module`` that has q/k/v projections and a head count but
    no output Linear of its own, held by a sibling under ``parent`` (Hugging Face's
    ``attention.output.dense`` beside ``attention.attention``): the one Linear named like an
    output in a sibling, from the q width back to the input width. None otherwise."""
    if parent is None or _heads(module) is None or any(_linear(module, n) is not None for n in _OUT_NAMES):
        return None
    names = next((n for n in (*_SEPARATE_NAMES, *_SPLIT_KV_NAMES) if _all_linear(module, n)), None)
    if names is None:
        return None
    q = _linear(module, names[0])
    found = [lin for child in parent.children() if child is not module for n in _SIBLING_OUT_NAMES
             for lin in [_linear(child, n)] if lin is not None
             and (lin.in_features, lin.out_features) == (q.out_features, q.in_features)]
    return found[0] if len(found) == 1 else None
