"""The probe: images of the size a model takes, built from what it states (``image_size``,
``img_size``, a config's, a patch embedding's, timm's ``pretrained_cfg``'s input size) or
guessed from its token tensors, for every check that runs a model forward to see what it
really computes. A model whose forward takes something else (several arguments, packed patches
and their grid sizes) is probed with the call its user hands over (:class:`ModelCall`)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from structinit.adapters.position import square_side
from structinit.utils import is_int
from structinit.utils.state import own_precision

# Modules whose tensors are weights, not tokens: perturbing them cannot find a PE.
_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm,
           nn.MultiheadAttention)  # _ConvNd: convolutions and transposed ones
_MAX_ROW_SLACK = 8  # prefix tokens tried when a grid must be guessed from a PE's row count


@dataclass(frozen=True)
class ModelCall:
    """One call of a model's forward, ``model(*args, **kwargs)``: the example input a user hands
    structinit (``example_inputs=``) for a model it cannot build a probe for. It is used whole,
    as given: structinit neither slices its batch nor resizes it."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __call__(self, model: nn.Module):
        return model(*self.args, **self.kwargs)

    @property
    def main(self) -> torch.Tensor | None:
        """The first tensor the call passes (its images, token ids or tokens), or None."""
        return next((v for v in (*self.args, *self.kwargs.values()) if isinstance(v, torch.Tensor)), None)

    @property
    def image_size(self) -> tuple[int, int] | None:
        """(H, W) of :attr:`main` when it is a floating-point (B, C, H, W) image batch, else None."""
        x = self.main
        return (int(x.shape[-2]), int(x.shape[-1])) if x is not None and x.ndim == 4 and x.is_floating_point() else None


def as_call(example_inputs) -> ModelCall:
    """``example_inputs`` as a :class:`ModelCall`: a tensor is the one positional argument, a
    tuple or list the positional arguments, a dict the keyword arguments; a ValueError naming
    the parameter for anything else."""
    if isinstance(example_inputs, ModelCall):
        return example_inputs
    if isinstance(example_inputs, torch.Tensor):
        return ModelCall((example_inputs,))
    if isinstance(example_inputs, (tuple, list)):
        return ModelCall(tuple(example_inputs))
    if isinstance(example_inputs, dict) and all(isinstance(k, str) for k in example_inputs):
        return ModelCall((), dict(example_inputs))
    raise ValueError(f"example_inputs={type(example_inputs).__name__}: give a tensor (the forward's one argument), a "
                     "tuple of its positional arguments, or a dict of its keyword arguments")


def run_forward(model: nn.Module, inputs):
    """``model``'s forward on ``inputs``: probe images or token ids, or a :class:`ModelCall`."""
    return inputs(model) if isinstance(inputs, ModelCall) else model(inputs)


@contextlib.contextmanager
def probing(model: nn.Module, seed: int = 0):
    """How every probe runs ``model``: in eval mode (its mode restored after) and in its own
    precision (:func:`~structinit.utils.state.own_precision`), with torch's random state forked and
    seeded with ``seed``, so that a probe draws the same whatever ran before and leaves the caller's
    random state as it was."""
    was_training = model.training
    model.eval()  # not chained: a module's own train() may return None (TinyViT's attention)
    try:
        with torch.random.fork_rng(devices=[]), own_precision():
            torch.manual_seed(seed)
            yield
    finally:
        model.train(was_training)


_TABLES_TRIED = 4  # row counts of token-width tables a token probe tries


def probe_tokens(model: nn.Module, dim: int, grid: tuple[int, int] | None = None,
                 count: int = 2) -> Iterator[torch.Tensor]:
    """``count`` seeded N(0, 1) token sequences (count, T, ``dim``): the probe of a model that
    takes tokens, not images (a block, a stack of them, an encoder). T is tried as the ``grid``
    given with up to :data:`_MAX_ROW_SLACK` prefix tokens, the row counts of the model's
    token-width tables (a position table it adds) and of its square (T, T) index or mask buffers,
    and 16."""
    tried = [] if grid is None else [grid[0] * grid[1] + p for p in range(_MAX_ROW_SLACK + 1)]
    rows = {_rows(t) for _, t in token_candidates(model, dim)}
    rows |= {b.shape[-1] for b in model.buffers() if not b.is_floating_point() and b.ndim >= 2
             and b.shape[-1] == b.shape[-2]}
    for t in dict.fromkeys([*tried, *sorted(rows - {1}, reverse=True)[:_TABLES_TRIED], 16]):
        tokens = torch.randn(count, t, dim, generator=torch.Generator().manual_seed(0))
        yield tokens.to(device=_device(model), dtype=model_dtype(model))


def is_token_probe(inputs) -> bool:
    """Whether a probe is (B, T, D) float tokens (:func:`probe_tokens`), not images or ids."""
    return isinstance(inputs, torch.Tensor) and inputs.is_floating_point() and inputs.ndim == 3


def first_sample(inputs):
    """The first sample of a probe, (1, …); a :class:`ModelCall` whole, as its user gave it."""
    return inputs if isinstance(inputs, ModelCall) else inputs[:1]


def token_candidates(model: nn.Module, dim: int, any_axis: bool = False,
                     channels_first: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Free floating-point tensors of width ``dim``: parameters, buffers and plain tensor
    attributes (vit-pytorch's fixed sin-cos table) of modules that are not standard layers;
    with ``any_axis``, those with ``dim`` along any axis after the first (a position embedding
    kept channels first, (1, D, h, w), as PiT's and Visformer's); with ``channels_first``, such
    a (1, D, h, w) map also, as its (1, h·w, D) view (a write through it lands in the tensor)."""
    if channels_first:
        maps = [(n, t.flatten(2).transpose(1, 2)) for n, t in token_candidates(model, dim, any_axis=True)
                if t.ndim == 4 and t.shape[0] == 1 and t.shape[1] == dim != t.shape[-1]]
        return token_candidates(model, dim) + maps
    out, seen = [], set()
    for path, module in model.named_modules():
        if isinstance(module, _LAYERS):
            continue
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False),
               *((n, t) for n, t in vars(module).items() if isinstance(t, torch.Tensor) and not n.startswith("_"))]
        for name, t in own:
            wide = dim in t.shape[1:] if any_axis else t.ndim >= 1 and t.shape[-1] == dim
            if t.is_floating_point() and wide and id(t) not in seen:
                seen.add(id(t))
                out.append((f"{path}.{name}" if path else name, t))
    return out


def _rows(t: torch.Tensor) -> int:
    return int(t.numel() // t.shape[-1])


def _pair(v) -> tuple[int, int] | None:
    if is_int(v) and v > 0:
        return int(v), int(v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(is_int(x) and x > 0 for x in v):
        return int(v[0]), int(v[1])
    return None


def _stated(model: nn.Module, attrs) -> tuple[int, int] | None:
    """The first (h, w) the model, its config or its patch embedding states under ``attrs``."""
    owners = (model, getattr(model, "config", None), getattr(model, "patch_embed", None))
    pairs = (_pair(getattr(owner, attr, None)) for owner in owners for attr in attrs)
    return next((p for p in pairs if p is not None), None)


def _configured(model: nn.Module) -> tuple[int, int] | None:
    """The (h, w) of the input size a model's own config states as (C, H, W): timm's
    ``pretrained_cfg`` (``default_cfg``), for a model that keeps no image size of its own."""
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None)
        size = cfg.get("input_size") if isinstance(cfg, dict) else None
        if isinstance(size, (tuple, list)) and len(size) == 3:
            return _pair(tuple(size[1:]))
    return None


def _patch(model: nn.Module) -> tuple[int, int] | None:
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == m.stride), None)
    return _stated(model, ("patch_size",)) or (tuple(conv.stride) if conv is not None else None)


def _channels(model: nn.Module, patch) -> int:
    """Input channels: a patch convolution's, else a patch Linear's in_features / (p·p), else 3."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is not None:
        return conv.in_channels
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is not None and patch is not None and first.in_features % (patch[0] * patch[1]) == 0:
        return max(1, min(first.in_features // (patch[0] * patch[1]), 4))
    return 3


def probe_sizes(model: nn.Module, candidates) -> list[tuple[int, int, int]]:
    """(C, H, W) probe sizes to try, most likely first (module doc)."""
    patch = _patch(model)
    chans = _channels(model, patch)
    stated = _stated(model, ("image_size", "img_size")) or _configured(model)
    if stated is not None:
        return [(chans, *stated)]
    if patch is None:
        return []
    sides = dict.fromkeys(side for rows in sorted({_rows(t) for _, t in candidates}, reverse=True)
                          for n in range(rows, max(rows - _MAX_ROW_SLACK, 0), -1) if (side := square_side(n)))
    return [(chans, s * patch[0], s * patch[1]) for s in sides]


def probe_choices(model: nn.Module, candidates: list, count: int = 2) -> Iterator[torch.Tensor]:
    """The probes to try on a model whose attention layers are ``candidates`` (name, adapter),
    most likely first: ``count`` images (count, C, H, W) in the model's dtype at each size
    :func:`probe_sizes` gives, then at the common square sizes, then, for a model that reads
    token ids through an embedding (a language model), ``count`` sequences of ids (count, T),
    T = 16, 8, 4. The caller keeps the first its forward takes (:func:`first_taken`)."""
    dim = candidates[0][1].dim if candidates else _common_width(model)
    sizes = probe_sizes(model, token_candidates(model, dim) if dim else [])
    for size in [*sizes, *((3, s, s) for s in _COMMON_SIDES if (3, s, s) not in sizes)]:
        yield probe_images(model, count, size)
    emb = input_embedding(model)
    if emb is not None:
        for length in _TEXT_LENGTHS:
            yield torch.randint(emb.num_embeddings, (count, length),
                                generator=torch.Generator().manual_seed(0)).to(emb.weight.device)


@torch.no_grad()
def first_taken(model: nn.Module, choices, errors: list | None = None) -> torch.Tensor | None:
    """The first of ``choices`` (probe tensors) that the model's forward takes, in eval mode
    with torch's random state forked; None when it takes none (a wrong size, or not an image
    model). Each one tried costs a forward: a survey tries them in its own forward instead
    (:func:`structinit.adapters.verify.survey_attention`). ``errors``, when given, collects what
    each refused choice raised."""
    was_training = model.training
    model.eval()
    try:
        for inputs in choices:
            try:
                with torch.random.fork_rng(devices=[]):
                    run_forward(model, inputs)
            except Exception as err:  # the wrong size or kind: try the next
                if errors is not None:
                    errors.append(err)
                continue
            return inputs
    finally:
        model.train(was_training)
    return None


def probe_inputs(model: nn.Module, candidates: list, count: int = 2) -> torch.Tensor | None:
    """``count`` probe inputs the model takes (:func:`probe_choices`, :func:`first_taken`), or
    None when it takes none."""
    return first_taken(model, probe_choices(model, candidates, count))


_TEXT_LENGTHS = (16, 8, 4)  # tokens a sequence probe tries, longest first (a model may hold few positions)


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding that reads a model's token ids: the one it names (Hugging Face's
    ``get_input_embeddings``), else its first ``nn.Embedding``; None when it has none."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        named = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        named = None
    if isinstance(named, nn.Embedding):
        return named
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def probe_images(model: nn.Module, count: int, size: tuple[int, int, int]) -> torch.Tensor:
    """``count`` seeded N(0, 1) images of ``size`` (C, H, W) on the model's device, in its dtype."""
    images = torch.randn(count, *size, generator=torch.Generator().manual_seed(0))
    return images.to(device=_device(model), dtype=model_dtype(model))


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (its inputs' dtype), else float32."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


_COMMON_SIDES = (32, 224, 64, 16, 28, 96, 128, 256, 384)  # tried in this order by a model that states no size


def _common_width(model: nn.Module) -> int | None:
    """The input width most of the model's Linear layers take: the token width of a model whose
    attention no adapter claims (so that it can still be probed, and that attention found)."""
    widths = [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
    return max(set(widths), key=widths.count) if widths else None


def probe_at(model: nn.Module, grid: tuple[int, int], count: int = 2) -> torch.Tensor | None:
    """``count`` probe images whose patches make an h×w ``grid``, for a model whose token grid
    follows its input (RoPE computed at each call); None when no patch size can be told."""
    patch = _patch(model)
    if patch is None:
        return None
    return probe_images(model, count, (_channels(model, patch), grid[0] * patch[0], grid[1] * patch[1]))


def detach_all(value):
    """``value`` with every tensor in it (or in its tuples and lists) detached."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(detach_all(v) for v in value)
    return value


def handed(args: tuple, kwargs: dict) -> tuple:
    """What a call was handed, in short: each tensor argument's shape, each other argument's value
    when it is a plain number, flag or string (a None is left out, as if not passed)."""
    def brief(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
        return v if isinstance(v, (bool, int, float, str)) else type(v).__name__
    return (tuple(brief(a) for a in args),
            tuple(sorted((k, brief(v)) for k, v in kwargs.items() if v is not None)))


def unlike_calls(times: int, first: tuple, later: tuple) -> str:
    """Why a module called differently within one forward is refused, with what each call was
    :func:`handed`."""
    def shown(given: tuple) -> str:
        args, kwargs = given
        return ", ".join([*(str(a) for a in args), *(f"{k}={v}" for k, v in kwargs)]) or "nothing"
    return (f"it is called {times} times in one forward, and not alike: first with ({shown(first)}), later with "
            f"({shown(later)}). One layer's weights then serve two token layouts or two mechanisms, and an init "
            "checked on one call is not checked on the other")


def call_copy(value, detach: bool = True):
    """An argument of a call as it was when the call began, to call again with: tensors detached
    (kept as they are with ``detach=False``), and a stateful object copied (a key/value cache
    grows with every call; a second call on the object the first one filled would see twice the
    keys). Modules, and what cannot be copied, are passed as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach() if detach else value
    if isinstance(value, (tuple, list)):
        return type(value)(call_copy(v, detach) for v in value)
    if isinstance(value, dict):
        return {k: call_copy(v, detach) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str, nn.Module, torch.dtype, torch.device)):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that refuses copying: the caller gets the object itself
        return value


def replaced_tokens(args: tuple, kwargs: dict, old: torch.Tensor, new: torch.Tensor, adapter) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with every tensor that holds the tokens ``old`` (as the adapter reads
    them, possibly batch-first of a sequence-first input) replaced by ``new``."""
    def swap(value):
        if not isinstance(value, torch.Tensor):
            return value
        if value is old or (value.shape == old.shape and value.data_ptr() == old.data_ptr()):
            return new.to(value.dtype)
        if value.ndim == 3 and value.transpose(0, 1).shape == old.shape and torch.equal(value.transpose(0, 1), old):
            return new.transpose(0, 1).to(value.dtype)  # nn.MultiheadAttention, sequence first
        if value.ndim == old.ndim - 1 and value.unsqueeze(0).shape == old.shape and torch.equal(value[None], old):
            return new[0].to(value.dtype)  # an unbatched (T, D) call
        if value.ndim == 4 and old.ndim == 3 and value.flatten(2).transpose(1, 2).shape == old.shape \
                and torch.equal(value.flatten(2).transpose(1, 2), old):  # (B, D, H, W) maps, pixels as tokens
            return new.transpose(1, 2).reshape(value.shape).to(value.dtype)
        if value.ndim > old.ndim and value.numel() == old.numel() and value.shape[-1] == old.shape[-1] \
                and torch.equal(value.reshape(old.shape), old):  # channels last, windows of (h, w) tokens
            return new.reshape(value.shape).to(value.dtype)
        return value
    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
