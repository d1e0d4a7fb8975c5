"""The layers that write into a transformer's residual stream: the patch embedding (the
first write), the prefix (class/register) tokens, and, per block, the attention output
projection and the MLP output.

Position reservation (:mod:`structinit.functional.reservation`) rewrites exactly these.
Known layouts: timm / structinit ViTs (``patch_embed.proj``, ``blocks.i.attn.proj``,
``blocks.i.mlp.fc2``), ``nn.TransformerEncoderLayer`` (``linear2``), and torchvision's ViT
(``conv_proj``, ``mlp.3``).
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters.attention import AttentionAdapter
from structinit.adapters.layout import TokenLayout

PATCH_EMBED_PATHS = ("patch_embed.proj", "conv_proj", "embeddings.patch_embeddings.projection")
MLP_OUT_PATHS = ("mlp.fc2", "linear2", "mlp.3", "ffn.fc2", "mlp.c_proj")

Write = tuple[str, torch.Tensor, torch.Tensor | None]  # (name, weight, bias): output channel first
Token = tuple[str, torch.Tensor]  # (name, tensor (…, D)): token vectors, channel last


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _weight_and_bias(name: str, module: nn.Module) -> Write:
    return name, module.weight, getattr(module, "bias", None)


def patch_embedding(model: nn.Module) -> Write:
    """(name, weight, bias) of the layer that turns patches into tokens; ValueError if the
    model has none of the known ones."""
    for path in PATCH_EMBED_PATHS:
        module = _get(model, path)
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            return _weight_and_bias(path, module)
    raise ValueError(
        f"{type(model).__name__} has no patch embedding structinit knows (looked for "
        f"{', '.join(PATCH_EMBED_PATHS)} as Conv2d or Linear); position reservation needs the layer "
        "that writes patch content into the tokens: use reserve='none', or name it patch_embed.proj"
    )


def residual_writes(model: nn.Module, layers: list[tuple[str, AttentionAdapter]]) -> list[Write]:
    """Per attention layer, its output projection and the MLP output of the same block, as
    (name, weight, bias) in ``nn.Linear`` layout (D rows). ValueError naming the block if
    its MLP output is not found."""
    out: list[Write] = []
    for name, adapter in layers:
        weight, bias = adapter.linear_views()["o"]
        out.append((f"{name} (output projection)", weight, bias))
        block_path = name.rpartition(".")[0]
        block = _get(model, block_path) if block_path else model
        for path in MLP_OUT_PATHS:
            module = _get(block, path)
            if isinstance(module, nn.Linear) and module.out_features == adapter.dim:
                out.append(_weight_and_bias(f"{block_path}.{path}".lstrip("."), module))
                break
        else:
            raise ValueError(
                f"the block {block_path or '<root>'!r} around attention layer {name!r} has no MLP output "
                f"structinit knows (looked for {', '.join(MLP_OUT_PATHS)}, a Linear to width {adapter.dim}); "
                "use reserve='patch' to reserve the patch embedding only"
            )
    return out


def prefix_tokens(model: nn.Module, layout: TokenLayout) -> list[Token]:
    """The learned vectors that make up the prefix tokens: ``cls_token``, ``reg_token`` and the
    prefix rows of ``pos_embed`` (when it has them), as (name, view (…, D)). Empty without
    prefix tokens."""
    if layout.num_prefix_tokens == 0:
        return []
    out: list[Token] = []
    for name in ("cls_token", "reg_token"):
        t = getattr(model, name, None)
        if isinstance(t, torch.Tensor):
            out.append((name, t))
    pos = getattr(model, "pos_embed", None)
    if isinstance(pos, torch.Tensor):
        rows = pos.reshape(-1, pos.shape[-1])
        if rows.shape[0] == layout.num_patches + layout.num_prefix_tokens:
            out.append(("pos_embed (prefix rows)", rows[: layout.num_prefix_tokens]))
    return out
