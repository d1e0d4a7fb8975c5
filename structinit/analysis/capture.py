"""Capturing what attention layers see and do: :func:`attention_maps` returns the maps a model
computes itself (its own softmax, in its forward); :func:`run_with_hooks` hands a callback the
tokens each layer receives, for analyses that recompute from them (metrics, CKA)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from structinit.adapters import find_attention_layers, select_layers
from structinit.adapters.observe import real_maps
from structinit.adapters.probe import run_forward


def run_with_hooks(model: nn.Module, inputs, layers, fn: Callable[..., None], *, with_terms: bool = False) -> None:
    """One forward pass of ``inputs`` without gradients; ``fn(i, x)`` gets the (B, T, D) tokens
    that the q/k of ``layers[i]`` (a list of (name, adapter)) are computed from, as the layer is
    called (:meth:`~structinit.AttentionAdapter.input_tokens`). With ``with_terms``,
    ``fn(i, x, terms)`` also gets the additive logit terms of the call (Swin's window mask; see
    :meth:`~structinit.AttentionAdapter.call_terms`), or None."""
    handles = []
    for i, (_, ad) in enumerate(layers):
        def hook(module, args, kwargs, i=i, ad=ad):
            x = ad.input_tokens(args, kwargs).detach()
            if with_terms:  # the call's arguments, as the attention module received them: the hook may sit
                # on its q/k projection instead, which sees no mask
                fn(i, x, ad.call_terms(*((args, kwargs) if module is ad.module else ((), {})), x))
            else:
                fn(i, x)
        handles.append(ad.input_module.register_forward_pre_hook(hook, with_kwargs=True))
    forward_then_remove(model, inputs, handles)


def forward_then_remove(model: nn.Module, inputs, handles) -> None:
    """One forward pass of ``inputs`` without gradients; the hook ``handles`` are removed
    afterwards, also when the pass fails."""
    try:
        with torch.no_grad():
            run_forward(model, inputs)
    finally:
        for h in handles:
            h.remove()


def attention_maps(model: nn.Module, inputs, layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Attention probabilities of every (chosen) attention layer for one forward pass of
    ``inputs``: a list of (B, heads, T, T) float tensors, T including prefix tokens.

    These are the maps the model computes itself, captured from its own softmax,
    ``scaled_dot_product_attention``, ``flex_attention`` or ``nn.MultiheadAttention`` in its forward
    (:func:`structinit.adapters.observe.real_maps`), whatever it does to q and k on the way (a
    windowed layer gives B·windows maps of the window's tokens). Holds all maps in memory; for
    large batches use :func:`impulse_fidelity`, which reduces them on the fly.
    """
    chosen = select_layers(find_attention_layers(model), layers)
    return [real.probs for real in real_maps(model, inputs, chosen)]


def check_all_called(chosen, called) -> None:
    """Raise if a chosen layer's hook never fired (its maps were not captured)."""
    missing = [name for (name, _), ok in zip(chosen, called) if not ok]
    if missing:
        raise RuntimeError(
            f"attention layer(s) {', '.join(missing)} were not called through their forward() "
            "during the model's forward pass (a fused inference fast path, or an unused layer); "
            "their maps cannot be captured"
        )
