"""Attention modules found by what they compute, not by their names: one fused Linear whose
output splits three ways into q, k, v (heads · r each), an output Linear from heads · r back to
the width, and softmax(q kᵀ · scale) in between (vit-pytorch's ``to_qkv`` / ``to_out``, and any
module written the same way, under any names).

The layout is read from shapes and then *verified by running the module*: on random tokens x
(1, T, D) the module's output must equal

    out = concat_h softmax(q_h k_hᵀ · scale) v_h · W_oᵀ + b_o,   [q; k; v] = W_qkv x̂ + b_qkv,

where x̂ is what the fused Linear really receives (the module may normalise x first, as
vit-pytorch's ``Attention.norm`` does). The head count comes from an attribute (``heads``,
``num_heads``, …) when there is one, else from the softmax scale (r = scale⁻²), else from the
first divisor of heads · r that the verification accepts; the scale is the one the module
states, else r^−½, else none at all (1: q/k-normed attention often leaves it out), else
exp(``temperature``) for a module with a learned scalar temperature (vit-pytorch's LSA, whose
logit on each token's own key is also masked: verified with and without that mask). A module
whose output differs still (RoPE, head mixing, …) is not adapted, so the caller's "no adapter
understands" error names it.
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters.attention import _HEAD_ATTRS, AttentionAdapter, Views, module_scale, split_views
from structinit.utils import is_int

_ATOL = 1e-5  # float32 recomputation of a small attention: differences are ~1e-7


def fused_candidate(module: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """(qkv Linear D → 3·inner, output Linear inner → D) when ``module``'s own Linears (its Linear
    children and those of its nn.Sequential children, as ``to_out = Sequential(Linear, Dropout)``)
    have that shape (exactly one of each), else None."""
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return None
    lins = [m for c in module.children() for m in (c.children() if isinstance(c, nn.Sequential) else [c])
            if isinstance(m, nn.Linear)]
    pairs = [(qkv, out) for qkv in lins for out in lins
             if qkv is not out and qkv.out_features == 3 * out.in_features and out.out_features == qkv.in_features]
    return pairs[0] if len(pairs) == 1 else None


def _head_counts(module: nn.Module, inner: int) -> list[int]:
    """Head counts to verify, most likely first (module doc), among the divisors of ``inner``."""
    stated = [int(getattr(module, a)) for a in _HEAD_ATTRS if is_int(getattr(module, a, None))]
    if stated:
        return stated[:1]
    scale = module_scale(module, 0) if any(hasattr(module, a) for a in ("scale", "scaling")) else None
    from_scale = [inner // round(scale**-2)] if scale and round(scale**-2) and inner % round(scale**-2) == 0 else []
    return from_scale + [h for h in range(1, inner + 1) if inner % h == 0 and h not in from_scale]


def _scales(module: nn.Module) -> list[float | str | None]:
    """Softmax scales to verify (module doc): None for the stated or r^−½ one, 1, 'temperature'."""
    temperature = getattr(module, "temperature", None)
    learned = isinstance(temperature, torch.Tensor) and temperature.numel() == 1
    return [None, 1.0] + (["temperature"] if learned else [])


class FusedLinearAdapter(AttentionAdapter):
    """An attention module recognised by structure (module doc). ``input_module`` is the fused
    Linear: its input is what q and k are computed from, after any norm inside the module."""

    def __init__(self, module: nn.Module, num_heads: int | None = None):
        found = fused_candidate(module)
        if found is None:
            raise ValueError(f"{type(module).__name__} has no fused q/k/v Linear and output Linear of matching shapes")
        self.module, (self.qkv, self.out) = module, found
        for masks_self in (False, True):
            for heads in [num_heads] if num_heads else _head_counts(module, self.qkv.out_features // 3):
                for scale in _scales(module):
                    self._set_heads(heads, scale, masks_self)
                    if verify(self):
                        return
        raise ValueError(f"{type(module).__name__}'s forward is not softmax(q kᵀ·scale)·v of its fused Linear "
                         "for any head count; register an adapter for it")

    def _set_heads(self, heads: int, scale: float | str | None = None, masks_self: bool = False) -> None:
        self.num_heads, self.dim = int(heads), self.qkv.in_features
        self.head_dim = self.qkv.out_features // 3 // self.num_heads
        self.masks_self = masks_self
        if scale == "temperature":  # read now: a learned temperature is a weight, not the class's code
            self.scale = float(self.module.temperature.detach().float().exp())
        else:
            self.scale = module_scale(self.module, self.head_dim) if scale is None else scale

    @property
    def input_module(self) -> nn.Module:
        return self.qkv

    def linear_views(self) -> Views:
        views = split_views(self.qkv.weight, self.qkv.bias, self.num_heads * self.head_dim)
        return views | {"o": (self.out.weight, self.out.bias)}

    @staticmethod
    def matches(module: nn.Module) -> bool:
        try:
            FusedLinearAdapter(module)
        except (ValueError, RuntimeError, TypeError):
            return False
        return True


@torch.no_grad()
def verify(adapter: FusedLinearAdapter, tokens: int = 6) -> bool:
    """True when the module's forward on random tokens equals the recomputation from the
    adapter's views (module doc), in eval mode (the mode is restored)."""
    module, seen = adapter.module, {}
    gen = torch.Generator().manual_seed(0)
    w = adapter.qkv.weight
    x = torch.randn(1, tokens, adapter.dim, generator=gen).to(w.dtype)
    handle = adapter.qkv.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    was_training = module.training
    module.eval()
    try:
        y = module(x)
    except Exception:  # a module that needs other inputs is not this kind of attention
        return False
    finally:
        handle.remove()
        module.train(was_training)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or "x" not in seen:
        return False
    # concat_h P_h (x W_v[h] + b_v[h]) then the output Linear, P_h = softmax(q kᵀ · scale)
    x, views = seen["x"], adapter.linear_views()
    v = nn.functional.linear(x, *views["v"]).unflatten(-1, (adapter.num_heads, adapter.head_dim)).transpose(1, 2)
    ours = nn.functional.linear((adapter.attention_probs(x) @ v).transpose(1, 2).flatten(2), *views["o"])
    return torch.allclose(y, ours, atol=_ATOL, rtol=1e-4)
