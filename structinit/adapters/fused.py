"""Attention made inside one torch call: ``F.scaled_dot_product_attention`` and ``flex_attention``.

Neither shows its map: both take q, k and v and return the attention's output. This module
reads the call as data, the same way for both: its q, k and v, its scale, and its logits
(q kᵀ·scale after every mask and modification, −∞ where a pair is closed), so that
:mod:`~structinit.adapters.observe` can read the map and :mod:`~structinit.adapters.provenance`
can follow q, k and v back to their parameters.

``flex_attention`` is a Python function that runs a higher-order op (HOP); a
:class:`~torch.overrides.TorchFunctionMode` sees that op, not the function, with the call's
q, k, v, ``score_mod``, block mask and resolved scale, and the output first among its results.
Called outside ``torch.compile``, the function compiles the op with dynamo, which traces any
active mode: the modes of this package pass every call straight through while dynamo traces
(:func:`compiling`) and read the op when it runs. Its logits come from torch's own eager
implementation (``math_attention``), so ``score_mod`` and ``mask_mod`` act exactly as they do
in the model.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from structinit.functional.attention import mask_future

SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
try:  # the op flex_attention runs, and torch's eager implementation of it
    _flex_ops = importlib.import_module("torch._higher_order_ops.flex_attention")
    FLEX, _FLEX_MATH = _flex_ops.flex_attention, _flex_ops._math_attention_inner
    _FLEX_API = importlib.import_module("torch.nn.attention.flex_attention")
except (ImportError, AttributeError):  # a torch without flex_attention: nothing to read
    FLEX = _FLEX_MATH = _FLEX_API = None
FUSED = frozenset(op for op in (SDPA, FLEX) if op is not None)
# The Python functions a forward calls, as torch.fx records them (survey.forms_no_attention)
FUSED_FUNCTIONS = frozenset(f for f in (SDPA, getattr(_FLEX_API, "flex_attention", None)) if f is not None)


def compiling() -> bool:
    """Whether dynamo is tracing (flex_attention compiles its op even when called eagerly): a
    mode must then pass calls through untouched, and reads them when they run."""
    return torch.compiler.is_compiling()


@dataclass
class FusedCall:
    """One fused attention call: its q (…, H, Tq, r), k and v (…, Hkv, Tk, ·), and the scale of
    q kᵀ (resolved: r^-½ when the call gave none)."""

    func: object
    args: tuple
    kwargs: dict
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scale: float

    def logits(self) -> torch.Tensor:
        """(…, H, Tq, Tk) float: q kᵀ·scale (key heads repeated for grouped queries) after the
        call's masks and its ``score_mod``, −∞ on every pair it closes."""
        q, k = self.query.detach(), self.key.detach()
        if self.func is FLEX:  # torch's own eager maths, with the call's score_mod and mask_mod
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            k = k.expand(q.shape[0], *k.shape[1:])  # keys shared by the batch: as flex broadcasts them
            with torch.no_grad():
                return _FLEX_MATH(q, k, self.value.detach(), *self.args[3:9])[1].float()
        q, k, bound = q.float(), k.float(), _sdpa_bound(self.args, self.kwargs)
        if k.shape[-3] != q.shape[-3] and bound.get("enable_gqa"):
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        logits = q @ k.transpose(-2, -1) * self.scale
        mask = bound.get("attn_mask")
        if mask is not None:
            mask = mask.detach()
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.float()
        return mask_future(logits) if bound.get("is_causal") else logits


def fused_call(func, args: tuple, kwargs: dict) -> FusedCall | None:
    """The call as a :class:`FusedCall`, or None when ``func`` is no fused attention."""
    if func is SDPA:
        bound = _sdpa_bound(args, kwargs)
        q, given = bound["query"], bound.get("scale")
        return FusedCall(func, args, kwargs, q, bound["key"], bound["value"],
                         q.shape[-1] ** -0.5 if given is None else float(given))
    if func is FLEX and func is not None:  # (query, key, value, score_mod, block_mask, scale, …): all positional
        return FusedCall(func, args, kwargs, args[0], args[1], args[2], float(args[5]))
    return None


def fused_output(func, out):
    """The attention output of a fused call's result (flex's op returns it first, with its
    log-sum-exp)."""
    return out[0] if func is FLEX and isinstance(out, tuple) else out


def _sdpa_bound(args: tuple, kwargs: dict) -> dict:
    return dict(zip(_SDPA_ARGS, args)) | kwargs


@contextlib.contextmanager
def differentiable_flex():
    """Within: flex_attention takes q, k and v that need gradients on CPU.

    torch refuses them there because its compiled CPU kernel has no backward; called eagerly,
    as a forward under a mode is, the op runs torch's math implementation, which autograd
    differentiates like any other ops (its gradients agree with those of softmax(q kᵀ)·v). A
    trace follows q, k and v to their parameters by gradients, so it lifts that device check
    for the one call it records, and puts it back after.
    """
    check = getattr(_FLEX_API, "_validate_device", None)
    if check is None:
        yield
        return

    def cpu_backward_allowed(query, key, value):
        if query.device.type != "cpu":
            check(query, key, value)

    _FLEX_API._validate_device = cpu_backward_allowed
    try:
        yield
    finally:
        _FLEX_API._validate_device = check
