"""Diagnostics: attention maps of any supported model, and how faithfully each head
implements its impulse (the fraction of attention on, and the argmax hit of, its target)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from structinit.adapters import AttentionAdapter, MultiheadAttentionAdapter, find_attention_layers
from structinit.layout import grid_pos_embed, infer_layout
from structinit.schemes.base import RECORD_ATTR, check_finite, select_layers
from structinit.targets import Offset, target_index


def _tokens(adapter: AttentionAdapter, args: tuple, kwargs: dict) -> torch.Tensor:
    """The (B, T, D) tokens an attention module receives as its (self-attention) query."""
    x = args[0] if args else next(kwargs[k] for k in ("x", "hidden_states", "query") if k in kwargs)
    if isinstance(adapter, MultiheadAttentionAdapter) and not adapter.module.batch_first and x.ndim == 3:
        x = x.transpose(0, 1)
    return x if x.ndim == 3 else x.unsqueeze(0)


def _run_with_hooks(model: nn.Module, inputs, layers, fn: Callable[[int, torch.Tensor], None]) -> None:
    handles = []
    for i, (_, ad) in enumerate(layers):
        def hook(module, args, kwargs, i=i, ad=ad):
            fn(i, _tokens(ad, args, kwargs).detach())
        handles.append(ad.module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in handles:
            h.remove()


def attention_maps(model: nn.Module, inputs, layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Attention probabilities of every (chosen) attention layer for one forward pass of
    ``inputs``: a list of (B, heads, T, T) float tensors, T including prefix tokens.

    Works on any model an adapter understands: each layer's input is captured with a hook
    and its map recomputed from the adapter's q/k weights. Holds all maps in memory; for
    large batches use :func:`impulse_fidelity`, which reduces them on the fly.
    """
    chosen = select_layers(find_attention_layers(model), layers)
    maps: list[torch.Tensor | None] = [None] * len(chosen)

    def keep(i, x):
        maps[i] = chosen[i][1].attention_probs(x.float())

    was_training = model.training
    model.eval()
    try:
        _run_with_hooks(model, inputs, chosen, keep)
    finally:
        model.train(was_training)
    _check_all_called(chosen, [m is not None for m in maps])
    return maps


def _check_all_called(chosen, called) -> None:
    missing = [name for (name, _), ok in zip(chosen, called) if not ok]
    if missing:
        raise RuntimeError(
            f"attention layer(s) {', '.join(missing)} were not called through their forward() "
            "during the model's forward pass (a fused inference fast path, or an unused layer); "
            "their maps cannot be captured"
        )


def _layer_offsets(chosen, offsets) -> list[list[Offset]]:
    out = []
    for i, (name, ad) in enumerate(chosen):
        if offsets is not None:
            offs = offsets[i] if offsets and isinstance(offsets[0][0], (list, tuple)) else offsets
        else:
            record = getattr(ad.module, RECORD_ATTR, None)
            if record is None:
                raise ValueError(
                    f"attention layer {name!r} has no impulse offsets recorded (it was not "
                    "initialised by structinit's impulse scheme in this process); pass offsets="
                )
            offs = record["offsets"]
        if len(offs) != ad.num_heads:
            raise ValueError(f"layer {name!r} has {ad.num_heads} heads but {len(offs)} offsets were given")
        out.append([tuple(o) for o in offs])
    return out


@torch.no_grad()
def impulse_fidelity(
    model: nn.Module,
    images: torch.Tensor | None = None,
    *,
    offsets: Sequence | None = None,
    layers: Sequence[int] | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int | None = None,
    pos_embed: torch.Tensor | None = None,
    batch_size: int = 64,
) -> dict[str, torch.Tensor]:
    """How well each head implements its impulse.

    Returns ``{'mass': (layers × heads), 'hit': (layers × heads)}``: the mean attention
    probability on each head's target token, and the fraction of rows whose argmax (over all
    tokens, prefix tokens included) is the target — over grid rows whose target lies inside
    the grid, and over all images.

    With ``images`` the model runs forward and each layer sees its real input. With
    ``images=None`` every layer is fed the position-only pseudo input LayerNorm(PE) (the
    grid rows of ``model.pos_embed``, or ``pos_embed``), as in the papers.

    Offsets are read from each layer (recorded by :func:`structinit.impulse_init_`) unless
    ``offsets`` gives one list of (dy, dx) per head (shared) or one such list per layer.
    """
    chosen = select_layers(find_attention_layers(model), layers)
    layout = infer_layout(model, grid, num_prefix_tokens)
    offs = _layer_offsets(chosen, offsets)
    heads = max(ad.num_heads for _, ad in chosen)
    mass = torch.full((len(chosen), heads), float("nan"))
    hit = torch.full((len(chosen), heads), float("nan"))
    sums = torch.zeros(len(chosen), heads, 2, dtype=torch.float64)
    counts = torch.zeros(len(chosen), heads, dtype=torch.float64)
    p = layout.num_prefix_tokens
    targets = [[target_index(layout.grid, o) for o in layer] for layer in offs]

    def reduce(i: int, x: torch.Tensor, prefix: int) -> None:
        probs = chosen[i][1].attention_probs(x.float())  # (B, H, T, T)
        arg = probs.argmax(-1)
        for h, t in enumerate(targets[i]):
            rows = torch.nonzero(t >= 0).squeeze(1)
            cols = t[rows] + prefix
            on_target = probs[:, h, rows + prefix, cols]
            sums[i, h, 0] += on_target.double().sum()
            sums[i, h, 1] += (arg[:, h, rows + prefix] == cols).double().sum()
            counts[i, h] += on_target.numel()

    if images is None:
        pe = pos_embed if pos_embed is not None else grid_pos_embed(model, layout)
        if pe is None:
            raise ValueError("the model has no `pos_embed`; pass pos_embed=<(N, D) tensor> or images")
        check_finite("pos_embed", pe)
        x = F.layer_norm(pe.detach().float().reshape(1, layout.num_patches, -1), (pe.shape[-1],), eps=1e-6)
        for i in range(len(chosen)):
            reduce(i, x, prefix=0)
    else:
        was_training = model.training
        model.eval()
        try:
            for start in range(0, images.shape[0], batch_size):
                _run_with_hooks(model, images[start : start + batch_size], chosen,
                                lambda i, x: reduce(i, x, prefix=p))
        finally:
            model.train(was_training)
        _check_all_called(chosen, (counts.sum(1) > 0).tolist())
    valid = counts > 0
    mass[valid] = (sums[..., 0][valid] / counts[valid]).float()
    hit[valid] = (sums[..., 1][valid] / counts[valid]).float()
    return {"mass": mass, "hit": hit}
