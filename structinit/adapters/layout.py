"""Where the image tokens are: the token grid, the prefix (class/register) tokens, and the
position embedding rows that belong to the grid. Everything is read from the model through
:attr:`structinit.adapters.survey.ModelSurvey.position`; explicit arguments win but are
checked against what the model holds. Each function takes the model or its survey."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from structinit.adapters.fused import compiling
from structinit.adapters.position import Discovery, embedding_rows, square_side
from structinit.adapters.probe import _rows, token_candidates
from structinit.adapters.rotary import find_rotary
from structinit.adapters.survey import ModelSurvey, as_survey
from structinit.adapters.trace import tokens_at
from structinit.utils import is_int


@dataclass(frozen=True)
class TokenLayout:
    """Tokens are ``num_prefix_tokens`` prefix tokens followed by an h×w grid, row-major; or,
    for a layer that attends within windows cut from the grid (SAM's ViT), ``windows`` (slices,
    T): the grid index of each token of each window the layer receives, −1 for a padding token
    (:func:`structinit.adapters.token_order.window_order`). ``position``: the position embedding
    of a later stage's own tokens (:meth:`~structinit.adapters.survey.ModelSurvey.stage_position`),
    where the layer does not take the model's first one."""

    grid: tuple[int, int]
    num_prefix_tokens: int = 0
    windows: torch.Tensor | None = field(default=None, compare=False, repr=False)
    position: Discovery | None = field(default=None, compare=False, repr=False)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    @property
    def tokens_per_slice(self) -> int:
        """The tokens one map of the layer spans: a window's, or prefix + grid."""
        return self.num_tokens if self.windows is None else int(self.windows.shape[1])

    def check_tokens(self, count: int, where: str) -> None:
        """Raise if ``count`` tokens (what ``where`` received) is not prefix + grid (a window's)."""
        if self.windows is not None and count == self.tokens_per_slice:
            return
        if count != self.num_tokens:
            raise ValueError(
                f"{where} received {count} tokens, but the layout has {self.num_prefix_tokens} prefix + "
                f"{self.num_patches} grid ({self.grid[0]}×{self.grid[1]}) = {self.num_tokens} tokens; pass the "
                "grid=/num_prefix_tokens= the model really uses (or none, to read them from the model)"
            )


def infer_layout(
    model: nn.Module | ModelSurvey, grid: tuple[int, int] | None = None, num_prefix_tokens: int | None = None
) -> TokenLayout:
    """Token layout of ``model``; explicit ``grid`` / ``num_prefix_tokens`` take precedence
    where they agree with the model.

    The grid comes from the model's patch embedding (timm's ``patch_embed.grid_size``, a Hugging
    Face config's image and patch size, a patch convolution and an image size), else from a
    square position embedding, else from a rotary embedding's (:mod:`structinit.adapters.rotary`);
    the prefix tokens from ``num_prefix_tokens`` or the class /
    distillation / register token parameters the model holds (see
    :mod:`structinit.adapters.position`). A position embedding must have N or N + P rows.
    """
    survey = as_survey(model)
    model, found = survey.model, survey.position
    declared = found.num_prefix_tokens
    if num_prefix_tokens is not None:
        if not is_int(num_prefix_tokens) or num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens={num_prefix_tokens!r}: expected an int ≥ 0")
        num_prefix_tokens = int(num_prefix_tokens)
        # more than the tokens the generic finder counts by name may be tokens under names it does not know
        counted = found.source == "generic"
        if declared is not None and (num_prefix_tokens < declared or (num_prefix_tokens > declared and not counted)):
            names = ", ".join(n for n, _ in found.prefix_tokens) or "none"
            raise ValueError(
                f"num_prefix_tokens={num_prefix_tokens}, but {type(model).__name__} has {declared} prefix "
                f"token(s) (parameters: {names}); omit num_prefix_tokens= or pass {declared}{' or more' * counted}"
            )
    prefix = num_prefix_tokens if num_prefix_tokens is not None else (declared or 0)
    rows = embedding_rows(found)
    grid = found.grid if grid is None else grid
    rotary = next((r for m in model.modules() if (r := find_rotary(m)) is not None), None)
    if grid is None and rotary is not None:  # RoPE: no position embedding, the rotation knows its grid
        grid, prefix = rotary.grid, prefix if num_prefix_tokens is not None or declared else rotary.num_prefix_tokens
    if grid is None and rows is not None:
        no_row = bool(getattr(model, "no_embed_class", False))
        sides = [s for n in ((rows,) if no_row else (rows - prefix, rows)) if (s := square_side(n)) is not None]
        grid = (sides[0], sides[0]) if sides else None
    if grid is None:
        if survey.takes_token_ids:
            raise ValueError(
                f"{type(model).__name__} reads token ids, a 1-D sequence with no grid of image tokens: impulse and the "
                "other grid schemes shape attention as convolutions on a 2-D grid, which a sequence does not have. "
                "Use 'mimetic' (it needs no grid), or pass grid=(h, w) if the ids are an image's tokens in row-major "
                "order"
            )
        first = survey.first_layer
        width = None if first is None else first[1].dim
        if (found.pos_embed is None and width and survey.attention.probed
                and not [t for _, t in token_candidates(model, width, any_axis=True) if _rows(t) > 1]):
            # Not a PE the finders miss: no free tensor of the tokens' width along any axis with more than one row (a
            # class or mask token is one row: the same for every position), and the probe saw each layer's call,
            # so no rotation handed to it either
            held = (f"the model holds no tensor of their width ({width}) and more than one row outside its layers' "
                    "weights to add to them")
            raise ValueError(
                f"cannot infer the token grid of {type(model).__name__}: "
                + (f"its tokens carry position from a table its forward computes each call and adds to them, which "
                   f"impulse cannot write ({held})" if _carries_position(survey, first) else
                   f"its tokens carry no position, since {held} (its position, if any, comes from convolutions)")
                + ", and it states no image size; impulse builds each head's map from position in q and k, so pass "
                "grid=(h, w) and pos_embed= if you add one it cannot see, or use 'mimetic', which needs neither"
            )
        if found.pos_embed is None:  # position from elsewhere (Twins' depthwise convs), or a PE under no known name
            raise ValueError(
                f"cannot infer the token grid of {type(model).__name__}: it has no position embedding structinit "
                "can find (a tensor of the model's width added to the tokens before the first attention layer) "
                "and no patch embedding with a known image size; pass grid=(h, w), and to impulse also "
                "pos_embed= (its maps need position in q and k), or use 'mimetic', which needs neither"
            )
        raise ValueError(
            f"cannot infer the token grid of {type(model).__name__}: no patch embedding with a known image "
            "size and no square position embedding; pass grid=(h, w)"
        )
    if not isinstance(grid, (tuple, list)) or len(grid) != 2 or not all(is_int(g) and g > 0 for g in grid):
        raise ValueError(f"grid={grid!r}: expected two positive ints (h, w)")
    layout = TokenLayout((int(grid[0]), int(grid[1])), prefix)
    if rows is not None:
        _check_rows(found, rows, layout, explicit_prefix=num_prefix_tokens is not None and declared is None)
    return layout


def _carries_position(survey: ModelSurvey, first) -> bool:
    """Whether the forward adds a table it computes to the tokens before the first layer
    ``first`` (name, adapter): a tensor of their width that neither the image nor a parameter
    feeds, its rows not all alike (a sin-cos table made from ``arange``), added to one the image
    feeds; position from convolutions is in what the image feeds, and is not such a table."""
    probe, width, seen = survey.probe, first[1].dim, []
    if not (isinstance(probe, torch.Tensor) and probe.is_floating_point()):
        return False

    class Additions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if compiling():  # flex_attention compiling its op (adapters.fused): nothing to look at
                return out
            if getattr(func, "__name__", "").strip("_") in ("add", "radd", "iadd") and len(args) == 2:
                seen.extend(t for t, fed in (args, args[::-1]) if isinstance(t, torch.Tensor)
                            and isinstance(fed, torch.Tensor) and fed.requires_grad and not t.requires_grad
                            and t.is_floating_point() and t.shape[-1] == width and t.numel() > width)
            return out

    with Additions():
        tokens_at(survey.model, first[1], probe[:1].clone().requires_grad_(True), keep_graph=True)
    return any(bool((t.reshape(-1, width) != t.reshape(-1, width)[:1]).any()) for t in seen)


def _check_rows(found: Discovery, rows: int, layout: TokenLayout, explicit_prefix: bool) -> None:
    n, p = layout.num_patches, layout.num_prefix_tokens
    if rows in (n, n + p) and not (explicit_prefix and p > 0 and rows == n):
        return
    if n < rows < n + p and not explicit_prefix:  # the first prefix tokens have rows, the rest (registers) none
        return
    if rows in (n, n + p):  # P tokens the model shows no sign of, and no PE rows for them either
        raise ValueError(
            f"num_prefix_tokens={p}, but the model has no prefix-token parameter and its position embedding "
            f"`{found.pos_embed_name}` has {rows} rows, exactly the {layout.grid[0]}×{layout.grid[1]} grid; "
            "omit num_prefix_tokens= (or register a finder with structinit.register_position_finder if the "
            "model really prepends tokens that have no position row)"
        )
    raise ValueError(
        f"the position embedding `{found.pos_embed_name}` has {rows} rows, but a {layout.grid[0]}×{layout.grid[1]} "
        f"grid with {p} prefix token(s) needs {n} to {n + p}; pass the grid=/num_prefix_tokens= that match"
    )


def grid_pos_embed(model: nn.Module | ModelSurvey, layout: TokenLayout) -> torch.Tensor | None:
    """(N, D) rows of the model's position embedding that belong to the grid (its last N), or
    None if it has none: a view, or for a table the tokens read through a map (``pos_reader``)
    what they read, computed (write it with :func:`pos_embed_writes`). A PE with exactly N rows
    (timm's ``no_embed_class``) gives prefix tokens no row; one with N + k rows, k < P, gives the
    first k prefix tokens a row (Hugging Face's DINOv2 with registers: the class token has one,
    the registers none)."""
    found = layout_position(model, layout)
    rows = _embedding_rows(found)
    if rows is None:
        return None
    n, p = layout.num_patches, layout.num_prefix_tokens
    if n <= rows.shape[0] <= n + p:  # the grid's rows come last; prefix tokens may have rows or not
        return rows[rows.shape[0] - n:]
    _check_rows(found, rows.shape[0], layout, explicit_prefix=False)
    raise AssertionError("unreachable")


def pos_embed_writes(model: nn.Module | ModelSurvey, layout: TokenLayout,
                     grid_rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, value) writes that make the grid rows of the model's position embedding
    ``grid_rows`` (N, D): into its view, or, for a table read through a map A
    (``pos_reader``), the smallest change Δ of the table with A(T + Δ) = ``grid_rows``
    (Δ = A⁺(``grid_rows`` − AT)). ValueError when the table cannot hold them (grid tokens that
    read the same rows alike, but should differ)."""
    found = layout_position(model, layout)
    if found.pos_reader is None:
        return [(grid_pos_embed(model, layout), grid_rows)]
    positions = None if found.pos_tables else grid_positions(found, layout.num_patches)
    if positions is not None:  # rows a permutation places (NesT's): each table row is one grid row, no solve
        return [(found.pos_embed, grid_rows.detach()[positions].reshape(found.pos_embed.shape))]
    tables = [(found.pos_embed_name, found.pos_embed), *found.pos_tables]
    flat = _table_rows(found)
    reader = found.pos_reader[found.pos_reader.shape[0] - layout.num_patches:]
    target = grid_rows.detach().reshape(layout.num_patches, -1).double().cpu()
    # the least-norm solution (unique; SVD-based, as A may have dependent rows whose targets still agree)
    change = torch.linalg.lstsq(reader, target - reader @ flat, driver="gelsd").solution
    if not bool((reader @ (flat + change) - target).abs().amax() <= 1e-6 * (1 + float(target.abs().amax()))):
        names = " and ".join(f"`{n}`" for n, _ in tables)
        why = ("some read the same rows alike" if reader.unique(dim=0).shape[0] < reader.shape[0] else
               f"their {reader.shape[0]} rows are read from {reader.shape[1]} table rows, as a table resized up to the "
               "grid is" if reader.shape[1] < reader.shape[0] else "the rows they read are not independent")
        raise ValueError(
            f"the position table{'s' * (len(tables) > 1)} {names} {'are' if len(tables) > 1 else 'is'} read so "
            f"that the {layout.num_patches} grid tokens cannot get the rows impulse designs ({why}): no write of "
            "them gives each grid position its row; pass pe_scale=None to keep the model's position embedding")
    out, start = [], 0
    for _, t in tables:
        rows = t.numel() // t.shape[-1]
        out.append((t, (flat + change)[start:start + rows].reshape(t.shape).to(t.device, t.dtype)))
        start += rows
    return out


def layout_position(model: nn.Module | ModelSurvey, layout: TokenLayout) -> Discovery:
    """The position embedding ``layout``'s tokens take: a later stage's own, else the model's."""
    return layout.position if layout.position is not None else as_survey(model).position


def stage_layout(found: Discovery, tokens: int) -> TokenLayout | None:
    """The layout of a later stage's ``tokens`` tokens from its own position embedding ``found``
    (prefix tokens and a grid whose rows it holds), or None when they do not add up."""
    rows, prefix = embedding_rows(found), found.num_prefix_tokens or 0
    n = tokens - prefix
    grid = found.grid if found.grid is not None and found.grid[0] * found.grid[1] == n else None
    side = square_side(n) if grid is None else None
    grid = grid or ((side, side) if side else None)
    if grid is None or rows not in (n, n + prefix):
        return None
    return TokenLayout(tuple(grid), prefix, position=found)


def _embedding_rows(found: Discovery) -> torch.Tensor | None:
    pos = found.pos_embed
    if pos is None:
        return None
    if found.pos_reader is None:
        return pos.reshape(-1, pos.shape[-1])
    return (found.pos_reader @ _table_rows(found)).to(pos.device, pos.dtype)


def grid_positions(found: Discovery, num_patches: int) -> torch.Tensor | None:
    """(N,) long: the grid position (row-major) each of the N grid rows of ``found``'s position
    embedding gives its token: each its own index, or, for an embedding whose rows a permutation
    places on the grid (``pos_reader`` one 1 per row and column: NesT's rows run block by block),
    where that puts it; None for a reader that is no permutation (a resized table)."""
    reader = found.pos_reader
    if reader is None:
        return torch.arange(num_patches)
    ones = reader == 1
    if reader.shape != (num_patches, num_patches) or not bool(((reader == 0) | ones).all()) or not (
            bool((ones.sum(0) == 1).all()) and bool((ones.sum(1) == 1).all())):
        return None
    return ones.long().argmax(0)


def _table_rows(found: Discovery) -> torch.Tensor:
    """The rows of the tables a read position embedding comes from, one table after the other,
    as the reader's columns take them (R, D), float64."""
    tables = (found.pos_embed, *(t for _, t in found.pos_tables))
    return torch.cat([t.detach().reshape(-1, t.shape[-1]).double().cpu() for t in tables])


def prefix_pos_rows(model: nn.Module | ModelSurvey, layout: TokenLayout) -> tuple[str, torch.Tensor] | None:
    """(name, view (P, D)) of the position-embedding rows of the prefix tokens, or None when
    they have none (or read a table through a map: no view to write)."""
    found = layout_position(model, layout)
    pos = found.pos_embed
    if pos is None or layout.num_prefix_tokens == 0 or found.pos_reader is not None:
        return None
    rows = pos.reshape(-1, pos.shape[-1])
    with_rows = rows.shape[0] - layout.num_patches  # registers after the class token may have none
    if not 0 < with_rows <= layout.num_prefix_tokens:
        return None
    return f"{found.pos_embed_name} (prefix rows)", rows[:with_rows]


def position_embedding_name(model: nn.Module | ModelSurvey) -> str | None:
    """Qualified name of the model's position embedding, or None if none was found."""
    found = as_survey(model).position
    return None if found.pos_embed is None else found.pos_embed_name
