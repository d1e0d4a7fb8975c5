"""The layers that write into a transformer's residual stream: the patch embedding (the
first write), the prefix (class/register) tokens, and, per block, the attention output
projection and the MLP output; then every other Linear or Conv2d whose output reaches the
tokens an attention layer reads by dataflow (:func:`stream_writers`).

Position reservation (:mod:`structinit.functional.reservation`) rewrites exactly these.
Known layouts: timm / structinit ViTs (``patch_embed.proj``, ``blocks.i.attn.proj``,
``blocks.i.mlp.fc2``), ``nn.TransformerEncoderLayer`` (``linear2``), and torchvision's ViT
(``conv_proj``, ``mlp.3``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from structinit.adapters.attention import AttentionAdapter
from structinit.adapters.layout import TokenLayout, layout_position, prefix_pos_rows
from structinit.adapters.observe import _tensors_in
from structinit.adapters.position import Token
from structinit.adapters.probe import first_sample, probing, run_forward
from structinit.adapters.provenance_record import _CARRY, _MUL, _made_before, _producers, _Recorder, first_tensor
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.trace import traced_patch_embedding
from structinit.utils.state import in_parameters

PATCH_EMBED_PATHS = ("patch_embed.proj", "conv_proj", "embeddings.patch_embeddings.projection")
MLP_OUT_PATHS = ("mlp.fc2", "linear2", "mlp.3", "ffn.fc2", "mlp.c_proj")

Write = tuple[str, torch.Tensor, torch.Tensor | None]  # (name, weight, bias): output channel first


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _find(model: nn.Module, path: str) -> tuple[str, nn.Module] | None:
    """The one module at ``path`` or ending in ``.path`` (a wrapper such as Hugging Face's
    ``ViTForImageClassification.vit`` nests the backbone), or None if there is none or several."""
    module = _get(model, path)
    if module is not None:
        return path, module
    hits = [(n, m) for n, m in model.named_modules() if n.endswith("." + path)]
    return hits[0] if len(hits) == 1 else None


def _weight_and_bias(name: str, module: nn.Module) -> Write:
    return name, module.weight, getattr(module, "bias", None)


def patch_embedding(model: nn.Module) -> Write:
    """(name, weight, bias) of the layer that turns patches into tokens; ValueError if the
    model has none of the known ones."""
    for path in PATCH_EMBED_PATHS:
        hit = _find(model, path)
        if hit is not None and isinstance(hit[1], (nn.Conv2d, nn.Linear)):
            return _weight_and_bias(*hit)
    # A hand-written ViT: its one convolution whose kernel equals its stride cuts the patches.
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.kernel_size == m.stride]
    if len(convs) == 1:
        return _weight_and_bias(*convs[0])
    raise ValueError(f"{type(model).__name__} has no patch embedding structinit knows")


def patch_writes(survey: ModelSurvey, layer=None, position=None) -> list[Write]:
    """The writes of the patch embedding: the known ones of :func:`patch_embedding`, else the
    ones a traced forward finds (:func:`structinit.adapters.trace.traced_patch_embedding`: the
    Linear or Conv2d, and the bias of a LayerNorm that follows it); ValueError if neither. With
    ``layer`` (name, adapter) and its stage's own ``position`` (a
    :class:`~structinit.adapters.position.Discovery`), what feeds that stage's tokens (a merge,
    another branch's patch embedding), traced alone."""
    model = survey.model
    if position is not None:
        traced = traced_patch_embedding(survey, layer, position.pos_embed)
    else:
        try:
            return [patch_embedding(model)]
        except ValueError:
            traced = traced_patch_embedding(survey)
    if traced:
        return traced
    raise ValueError(
        f"{type(model).__name__} has no patch embedding structinit knows (looked for "
        f"{', '.join(PATCH_EMBED_PATHS)} as Conv2d or Linear, and for a single Conv2d with kernel = stride); "
        "position reservation needs the layer that writes patch content into the tokens, and a traced forward "
        "found no Linear or Conv2d to the model width before the position embedding: use reserve='none', "
        "or name it patch_embed.proj"
    )


def residual_writes(model: nn.Module, layers: list[tuple[str, AttentionAdapter]]) -> list[Write]:
    """Per attention layer, its output projection and the MLP output of the same block, as
    (name, weight, bias) in ``nn.Linear`` layout (D rows). ValueError naming the block if
    its MLP output is not found."""
    out: list[Write] = []
    for name, adapter in layers:
        if "o" not in adapter.linear_views():
            raise ValueError(f"the reservation projects every write into the residual stream off the position "
                             f"subspace, and attention layer {name!r} has no output projection structinit reads "
                             f"({adapter.output_unread}); pass reserve='patch' or reserve='none'")
        weight, bias = adapter.linear_views()["o"]
        out.append((f"{name} (output projection)", weight, bias))
        if not in_parameters(adapter.module, weight):
            name = name.rpartition(".")[0]  # the output projection is a sibling: the wrapper of both is the attention
        # The block is the nearest ancestor that holds more than the attention (a module may wrap it alone), short
        # of leaving a container's element, which is a block itself.
        held = {p.untyped_storage().data_ptr() for p in _get(model, name).parameters()} if name else set()
        block_path = name.rpartition(".")[0]
        block = _get(model, block_path) if block_path else model
        while block_path and not block_path.rpartition(".")[2].isdigit() and all(
                p.untyped_storage().data_ptr() in held for p in block.parameters()):
            name, block_path = block_path, block_path.rpartition(".")[0]
            block = _get(model, block_path) if block_path else model
        mlp_out = _mlp_output(block, adapter, search=bool(block_path))
        where = block_path
        if mlp_out is None and block_path:
            where, mlp_out = _next_block_mlp(model, block_path, adapter, layers)
        if mlp_out is None:
            raise ValueError(
                f"the block {block_path or '<root>'!r} around attention layer {name!r} has no MLP output "
                f"structinit knows (looked for {', '.join(MLP_OUT_PATHS)}, a Linear to width {adapter.dim}, and for "
                "the block's last Linear to that width outside the attention); "
                "use reserve='patch' to reserve the patch embedding only"
            )
        out.append(_weight_and_bias(f"{where}.{mlp_out[0]}".lstrip("."), mlp_out[1]))
    return out


def _mlp_output(block: nn.Module, adapter: AttentionAdapter, search: bool) -> tuple[str, nn.Linear] | None:
    """(path in ``block``, Linear) of the MLP output: a known name, or else (with ``search``;
    never at a model's root, where the classifier head could match) the block's last Linear to
    the model width outside the attention module, what writes the MLP's result back into the
    stream in a pre- or post-norm block (a 1×1 convolution on image maps counts as one). None
    when there is none."""
    for path in MLP_OUT_PATHS:
        module = _get(block, path)
        if isinstance(module, nn.Linear) and module.out_features == adapter.dim:
            return path, module
    if block is None or not search:
        return None
    o_weight = adapter.linear_views()["o"][0]
    inside = {id(m) for m in adapter.module.modules()}
    last = [(n, m) for n, m in block.named_modules()
            if _token_linear(m, adapter.dim) and id(m) not in inside and not in_parameters(m, o_weight)]
    return last[-1] if last else None


def _token_linear(module: nn.Module, width: int) -> bool:
    """A Linear to ``width``, or a 1×1 Conv2d to it (the same map, per token of an image map)."""
    if isinstance(module, nn.Linear):
        return module.out_features == width
    return (isinstance(module, nn.Conv2d) and module.out_channels == width and module.kernel_size == (1, 1)
            and module.groups == 1)


def _next_block_mlp(model: nn.Module, block_path: str, adapter: AttentionAdapter, layers) -> tuple[str, tuple | None]:
    """(path, (name, Linear)) of the MLP output in the block after ``block_path`` among its
    parent's children, when that block holds no attention layer: x-transformers alternates
    attention and feed-forward blocks ([norm, attention, residual], [norm, feed-forward,
    residual], …). (block_path, None) when there is none."""
    parent_path, _, index = block_path.rpartition(".")
    parent = _get(model, parent_path) if parent_path else model
    if not index.isdigit() or not isinstance(parent, (nn.ModuleList, nn.Sequential)) or int(index) + 1 >= len(parent):
        return block_path, None
    path = f"{parent_path}.{int(index) + 1}".lstrip(".")
    if any(name == path or name.startswith(path + ".") for name, _ in layers):
        return block_path, None
    found = _mlp_output(parent[int(index) + 1], adapter, search=True)
    return (path, found) if found is not None else (block_path, None)


def prefix_tokens(survey: ModelSurvey, layout: TokenLayout) -> list[Token]:
    """The learned vectors that make up the prefix tokens: class / distillation / register
    token parameters and the prefix rows of the position embedding (when it has them), as
    (name, view (…, D)), and the class tokens that join in front of the grid after the first
    layers (ConViT, CaiT). Empty without any."""
    found = layout_position(survey, layout)  # a later stage's own, else the model's
    if layout.num_prefix_tokens == 0:
        return list(found.joining_tokens)
    out: list[Token] = [*found.prefix_tokens, *found.joining_tokens]
    rows = prefix_pos_rows(survey, layout)
    if rows is not None:
        out.append(rows)
    return out


# What a stream passes through between writes into it: what the trace carries a tensor through (copies,
# casts, dropout), scales, and sums, joins, slices and reshapes.
_FLOWS = _CARRY | _MUL | {
    torch.cat, torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
    torch.Tensor.__iadd__, torch.Tensor.__getitem__, torch.reshape, torch.Tensor.reshape, torch.Tensor.view,
    torch.flatten, torch.Tensor.flatten, torch.transpose, torch.Tensor.transpose, torch.permute, torch.Tensor.permute,
    torch.Tensor.expand, torch.Tensor.unsqueeze, torch.Tensor.squeeze}
_NORMS = {F.layer_norm, F.group_norm, F.rms_norm}


@torch.no_grad()
def stream_writers(survey: ModelSurvey, layers: list[tuple[str, AttentionAdapter]]) -> list[Write]:
    """Every Linear or Conv2d whose output reaches the tokens the attention ``layers`` receive
    through sums, joins, slices, reshapes and scales alone (the stream behind the layer's own
    norm), as (name, weight, bias): what writes into the stream those layers read, found by
    dataflow on the survey's probe (one forward of its first sample, in eval mode, recorded call
    by call). It finds the writes no block layout names: a projection that replaces the class
    token between blocks (CrossViT's ``revert_projs``). Empty when the model cannot be probed."""
    model, probe = survey.model, survey.probe
    if probe is None:
        return []
    received, recorder = {}, _Recorder()

    def grab(name):
        def hook(module, args, kwargs):  # the tokens, and how many calls made them
            received.setdefault(name, (first_tensor(args, kwargs), len(recorder.ops)))
        return hook
    hooks = [ad.input_module.register_forward_pre_hook(grab(name), with_kwargs=True) for name, ad in layers]
    try:
        with probing(model), recorder:
            run_forward(model, first_sample(probe))  # one image: the dataflow is the same for each
    except Exception:  # the forward failed on its own probe: no dataflow to read
        return []
    finally:
        for hook in hooks:
            hook.remove()
    ops, producers = recorder.ops, _producers(recorder.ops)
    owners = {id(m.weight): (n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    found: dict[int, Write] = {}
    for tokens, made in received.values():
        stack, seen = [(tokens, made, True)], set()
        while stack:
            t, before, first = stack.pop()
            i = _made_before(producers, t, before)  # an identity call (dropout in eval) returns its input
            if i is None or i in seen:
                continue
            seen.add(i)
            func, args, kwargs, _ = ops[i]
            if func in (F.linear, F.conv2d):
                hit = owners.get(id(args[1] if len(args) > 1 else kwargs.get("weight")))
                if hit is not None:
                    found.setdefault(id(hit[1].weight), _weight_and_bias(*hit))
            elif func in _FLOWS or (first and func in _NORMS):  # the layer's own pre-norm: the stream is its input
                stack += [(a, i, False) for a in _tensors_in(args)]
    return list(found.values())

