"""Finding a model's position embedding, its prefix (class / distillation / register) tokens
and its token grid, beside :mod:`structinit.adapters.registry`'s attention discovery.

Built-in finders, tried after any user finder (most recently registered first):

- ``timm``: a root ``pos_embed`` with ``patch_embed.grid_size`` (timm, structinit, and any model
  written in their style), ``num_prefix_tokens`` / ``no_embed_class`` when present;
- ``huggingface``: an ``embeddings`` module with a ``position_embeddings`` parameter and
  ``patch_embeddings`` (Hugging Face ViT, DeiT, DINOv2 …), class / distillation / register
  tokens from the same module, the grid from the image size and patch size of its config;
- ``generic``: exactly one parameter whose name says position embedding (``pos_embed``,
  ``pos_embedding`` as in vit-pytorch, ``position_embeddings``, ``pos_emb`` …), of shape
  (1, P+N, D) or (N, D), with ``cls_token``-style parameters beside it and the grid from a
  patch convolution (kernel = stride) and an image size, or from a square N.

A finder is ``finder(model) -> Discovery | None``; teach structinit a new layout with
:func:`register_position_finder`. Names are hints: when no finder knows the model, or the
generic finder's rows do not fit its grid and tokens, the forward decides
(:mod:`structinit.adapters.trace`, asked by :class:`structinit.adapters.survey.ModelSurvey`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from structinit.utils import Registry, is_int

Token = tuple[str, torch.Tensor]  # (name, tensor (…, n, D)): learned prefix token vectors


@dataclass(frozen=True)
class Discovery:
    """What a finder learned about a model. ``None`` fields are unknown (the caller infers or
    asks for them); ``pos_embed`` is the parameter itself, shape (…, R, D), R = N or N + P.

    ``num_prefix_tokens`` is the number of tokens in front of the grid, ``prefix_tokens`` the
    learned vectors they come from, and ``source`` the finder's name (for messages).
    ``joining_prefix_tokens`` counts the model's class tokens that join in front of the grid
    only after the first attention layers (ConViT), and so are prefix tokens of the later ones;
    ``joining_tokens`` are their learned vectors. ``pos_reader`` (R', R) float64, when the
    tokens read ``pos_embed`` through a map rather than one row each (a table resized to the
    grid, or gathered at position ids): the R' tokens the table feeds get ``pos_reader`` @ its
    (R, D) rows, as if those were the position embedding (:func:`structinit.adapters.trace.table_reader`);
    ``pos_tables`` are more tables read with it, as (name, tensor), their rows after its own in
    the reader's columns (Pix2Struct's row and column tables)."""

    pos_embed: torch.Tensor | None = None
    pos_embed_name: str = "pos_embed"
    grid: tuple[int, int] | None = None
    num_prefix_tokens: int | None = None
    prefix_tokens: tuple[Token, ...] = field(default_factory=tuple)
    source: str = "?"
    joining_prefix_tokens: int = 0
    joining_tokens: tuple[Token, ...] = field(default_factory=tuple)
    pos_reader: torch.Tensor | None = field(default=None, compare=False, repr=False)
    pos_tables: tuple[Token, ...] = field(default=(), compare=False, repr=False)


NOT_FOUND = ("structinit found no position embedding in the model (it looks for timm's `pos_embed`, Hugging Face's "
             "`embeddings.position_embeddings`, and one parameter named like `pos_embedding`; "
             "structinit.register_position_finder teaches it others)")

POSITION_FINDERS: Registry[Callable[[nn.Module], Discovery | None]] = Registry("position-embedding finder")


def register_position_finder(name: str, finder: Callable[[nn.Module], Discovery | None]) -> None:
    """Teach structinit where a model keeps its position embedding.

    ``finder(model)`` returns a :class:`Discovery` for models it understands and ``None`` for
    the others. User finders are tried before the built-in ones, most recently registered
    first; registering ``name`` again replaces it.

    Examples:
        >>> def mine(model):
        ...     pe = getattr(model, "my_positions", None)
        ...     return None if pe is None else Discovery(pe, "my_positions", grid=(8, 8), num_prefix_tokens=0)
        >>> register_position_finder("mine", mine)
        >>> unregister_position_finder("mine")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r}: expected a non-empty string")
    if not callable(finder):
        raise TypeError(f"finder={finder!r}: expected a callable model → Discovery | None")
    POSITION_FINDERS.register(name, finder, replace=True, first=True)


def unregister_position_finder(name: str) -> None:
    """Remove the finder registered under ``name``."""
    POSITION_FINDERS.remove(name)


def named_discovery(model: nn.Module) -> Discovery:
    """The first registered finder's :class:`Discovery` for ``model``, stored channels first or
    not; an empty one (everything unknown) when no finder knows the model. What the forward
    shows decides after it (:attr:`structinit.adapters.survey.ModelSurvey.position`)."""
    for name, finder in POSITION_FINDERS.items():
        found = finder(model)
        if found is not None:
            if not isinstance(found, Discovery):
                raise TypeError(f"position-embedding finder {name!r} returned {type(found).__name__}, not a Discovery")
            return _channels_last(found)
    return Discovery(source="none")


def _channels_last(found: Discovery) -> Discovery:
    """A position embedding stored channels first, (1, D, h, w) as PiT's, as the (1, h·w, D)
    view of its rows that every reader expects (writes through the view land in the parameter),
    with its grid (h, w). Only a square map whose width differs from its side is taken so: a
    (1, N, h, w) tensor could be either."""
    pos = found.pos_embed
    if pos is None or pos.ndim != 4 or not pos.shape[-1] == pos.shape[-2] != pos.shape[1] > 1 or pos.shape[0] != 1:
        return found
    h, w = pos.shape[-2:]
    if found.grid is not None and tuple(found.grid) != (h, w):
        return found
    return dataclasses.replace(found, pos_embed=pos.flatten(2).transpose(1, 2), grid=(int(h), int(w)))


def prefix_in_layers(found: Discovery, first_layer_tokens: int | None) -> Discovery:
    """``found`` without prefix tokens when its PE has rows for the grid alone and the first
    attention layer receives the grid alone (``first_layer_tokens``): the class token comes in
    after the first layers (CaiT's class-attention blocks, ConViT's later blocks), so it is no
    prefix of the first; ``joining_prefix_tokens`` keeps its count for the later ones."""
    if found.pos_embed is None or not found.num_prefix_tokens:
        return found
    rows = embedding_rows(found)
    n = found.grid[0] * found.grid[1] if found.grid is not None else rows if square_side(rows) else None
    if rows != n or first_layer_tokens != n:
        return found
    return dataclasses.replace(found, num_prefix_tokens=0, prefix_tokens=(),
                               joining_prefix_tokens=found.num_prefix_tokens, joining_tokens=found.prefix_tokens)


# -- helpers shared by the finders ---------------------------------------------------------------

def _grid_from(image_size, patch_size) -> tuple[int, int] | None:
    """(h, w) tokens of an image of ``image_size`` cut into ``patch_size`` patches (ints or
    pairs), or None when either is unknown or they do not divide."""
    def pair(v):
        if is_int(v):
            return int(v), int(v)
        if isinstance(v, (tuple, list)) and len(v) == 2 and all(is_int(x) for x in v):
            return int(v[0]), int(v[1])
        return None

    img, patch = pair(image_size), pair(patch_size)
    if img is None or patch is None or min(patch) <= 0 or img[0] % patch[0] or img[1] % patch[1]:
        return None
    return img[0] // patch[0], img[1] // patch[1]


def _tokens(owner: nn.Module, prefix: str, names) -> tuple[Token, ...]:
    return tuple((f"{prefix}{n}", t) for n in names if isinstance(t := getattr(owner, n, None), torch.Tensor)
                 and t.ndim >= 1)


def _count(tokens: tuple[Token, ...]) -> int:
    """Tokens contributed by (1, n, D) / (n, D) / (D,) vectors."""
    return sum(1 if t.ndim == 1 else t.shape[-2] for _, t in tokens)


_PREFIX_NAMES = ("cls_token", "class_token", "dist_token", "distillation_token", "reg_token", "register_tokens")


# -- built-in finders ------------------------------------------------------------------------------

def _timm(model: nn.Module) -> Discovery | None:
    pos = getattr(model, "pos_embed", None)
    grid_size = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if not isinstance(pos, torch.Tensor) or grid_size is None:
        return None
    tokens = _tokens(model, "", ("cls_token", "dist_token", "reg_token"))
    prefix = getattr(model, "num_prefix_tokens", None)
    return Discovery(pos, "pos_embed", tuple(int(g) for g in grid_size),
                     int(prefix) if is_int(prefix) else _count(tokens), tokens, "timm")


def _huggingface(model: nn.Module) -> Discovery | None:
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(getattr(m, "position_embeddings", None), nn.Parameter) and hasattr(m, "patch_embeddings")]
    if len(found) != 1:
        return None
    path, emb = found[0]
    prefix = f"{path}." if path else ""
    tokens = _tokens(emb, prefix, ("cls_token", "distillation_token", "register_tokens"))
    patches = emb.patch_embeddings
    config = getattr(emb, "config", None) or getattr(model, "config", None)
    grid = _grid_from(getattr(patches, "image_size", None), getattr(patches, "patch_size", None)) or _grid_from(
        getattr(config, "image_size", None), getattr(config, "patch_size", None))
    return Discovery(emb.position_embeddings, f"{prefix}position_embeddings", grid, _count(tokens), tokens,
                     "huggingface")


_PE_NAME = re.compile(r"^(pos|position|positional)_?(embed|embedding|embeddings|emb|encoding|enc)$")


def _generic(model: nn.Module) -> Discovery | None:
    candidates = [(n, p) for n, p in _named_tensors(model) if _PE_NAME.match(n.rpartition(".")[2]) and p.ndim >= 2]
    if len(candidates) != 1:
        return None  # none, or ambiguous: infer_layout then asks for grid=/pos_embed=
    name, pos = candidates[0]
    owner_path = name.rpartition(".")[0]
    owner = model.get_submodule(owner_path) if owner_path else model
    tokens = _tokens(owner, f"{owner_path}." if owner_path else "", _PREFIX_NAMES)
    prefix = getattr(owner, "num_prefix_tokens", None)
    # No prefix-token parameter and no count: unknown rather than 0, since a class token under
    # another name is common in hand-written models (the PE's row count then decides).
    prefix = int(prefix) if is_int(prefix) else (_count(tokens) if tokens else None)
    grid = _patch_conv_grid(model)
    # The name is a hint: when its rows do not fit the grid and the tokens beside it (a class token kept
    # elsewhere or under another name), the traced forward decides (structinit.adapters.survey).
    return Discovery(pos, name, grid, prefix, tokens, "generic")


def _named_tensors(model: nn.Module):
    """Parameters and buffers (a fixed PE is often a buffer), each once."""
    seen = set()
    for n, t in (*model.named_parameters(), *model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield n, t


def _patch_conv_grid(model: nn.Module) -> tuple[int, int] | None:
    """The grid of the first Conv2d whose kernel equals its stride (a patch embedding), given an
    image size the model states (``img_size`` / ``image_size`` / ``config.image_size``)."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == m.stride), None)
    if conv is None:
        return None
    grids = (_grid_from(getattr(owner, attr, None), tuple(conv.stride))
             for owner in (model, getattr(model, "config", None)) for attr in ("img_size", "image_size"))
    return next((g for g in grids if g is not None), None)


for _name, _finder in (("timm", _timm), ("huggingface", _huggingface), ("generic", _generic)):
    POSITION_FINDERS.register(_name, _finder)


def embedding_rows(found: Discovery) -> int | None:
    """How many token rows the position embedding gives: its rows, or the tokens a read table
    feeds (``pos_reader``); None without one."""
    if found.pos_embed is None:
        return None
    pe = found.pos_embed
    return int(found.pos_reader.shape[0]) if found.pos_reader is not None else int(pe.numel() // pe.shape[-1])


def square_patch(image: tuple[int, int], n: int) -> int | None:
    """p where n square p×p patches tile an (H, W) image, else None."""
    area = image[0] * image[1]
    p = square_side(area // n) if n > 0 and not area % n else None
    return p if p and not image[0] % p and not image[1] % p else None


def square_side(n: int) -> int | None:
    """s with s·s = n (n ≥ 1), else None."""
    s = math.isqrt(max(n, 0))
    return s if s > 0 and s * s == n else None
