"""Finding the position embedding, the prefix tokens and the token grid by what the forward
does, not by names.

A probe image runs through the model up to the first attention layer (a pre-hook on the
adapter's ``input_module`` stops the forward there, so the cost is the embedding stage only)
and gives the T×D tokens q and k are computed from. Every free tensor of width D (a parameter,
buffer or plain tensor attribute of a module that is not a standard layer) is then perturbed
in place, one at a time, and restored bit for bit. The token rows that change say what it is:

- the position embedding changes R rows one to one, R = N (grid) or N + P (grid and prefix);
- a prefix (class, distillation, register) token changes only its own row(s);
- the grid rows are the rows the position embedding changes and no token tensor does.

The probe's size is the image size the model states (``image_size``, ``img_size``, a config's),
or else the side √N × patch size tried for every square N a candidate's row count allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch import nn

from structinit.adapters.position import Discovery, _grid_from, square_patch, square_side
from structinit.adapters.probe import (
    ModelCall,
    _patch,
    _rows,
    first_sample,
    probe_images,
    probe_sizes,
    probing,
    run_forward,
    token_candidates,
)
from structinit.adapters.row_reading import leaf_of, raster_rows, recording


class _Stop(Exception):
    """Raised by the probe's hook: the forward has reached the first attention layer."""


def tokens_at(model: nn.Module, adapter, images: torch.Tensor, seed: int = 0,
              keep_graph: bool = False) -> torch.Tensor | None:
    """The (B, T, D) tokens ``adapter.input_module`` receives when ``images`` run through
    ``model``, where a hook stops the forward; None when the forward fails before that (a probe
    the model does not take). Eval mode (restored after), torch's random state forked and
    seeded with ``seed``, as in every probe (:mod:`structinit.adapters.observe`). Without
    gradients, unless ``keep_graph`` (then the tokens keep theirs, for a backward)."""
    return _stopped_at(model, adapter.input_module, lambda args, kwargs, out: adapter.input_tokens(args, kwargs),
                       images, seed, keep_graph)


def tensor_at(model: nn.Module, module: nn.Module, inputs, output: bool, keep_graph: bool = False):
    """The first tensor ``module`` receives (``output=False``) or returns when ``inputs`` run
    through ``model``, the forward stopped there (as :func:`tokens_at`); None when the forward
    fails before, or what is there is no tensor."""
    def grab(args, kwargs, out):
        found = out if output else next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        found = found[0] if isinstance(found, (tuple, list)) and found else found
        return found if isinstance(found, torch.Tensor) else None
    return _stopped_at(model, module, grab, inputs, 0, keep_graph, output=output)


def _stopped_at(model, module, grab, inputs, seed, keep_graph, output=False):
    seen = {}

    def stop(mod, args, kwargs, out=None):
        x = grab(args, kwargs, out)
        seen["x"] = x if keep_graph or x is None else x.detach().clone()
        raise _Stop

    handle = (module.register_forward_hook(stop, with_kwargs=True) if output
              else module.register_forward_pre_hook(stop, with_kwargs=True))
    try:
        with probing(model, seed), torch.set_grad_enabled(keep_graph and torch.is_grad_enabled()):
            run_forward(model, inputs)
    except _Stop:
        pass
    except Exception:  # a probe of the wrong size or kind: the caller tries the next or gives up
        return None
    finally:
        handle.remove()
    return seen.get("x")


def token_views(x: torch.Tensor | None, inputs) -> list[torch.Tensor]:
    """The tokens ``x`` a layer received (:func:`tokens_at`) as the trace reads them: windows of the
    probe images (B·windows, n, D) first as one sample per image, (B, windows·n, D), for an embedding
    of the whole image (NesT's blocks), then as windows, for one added to each alike (TNT's pixels)."""
    images = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.ndim == 4 else None
    if x is None:
        return []
    if x.ndim == 3 and images and x.shape[0] > images and x.shape[0] % images == 0:
        return [x.reshape(images, -1, x.shape[-1]), x]
    return [x]


@torch.no_grad()
def changed_rows(model: nn.Module, adapter, images: torch.Tensor, base: torch.Tensor, t: torch.Tensor) -> list[int]:
    """Token rows of sample 0 that change when ``t`` is perturbed (then restored bit for bit)."""
    saved = t.detach().clone()
    gen = torch.Generator().manual_seed(0)
    t.add_(torch.randn(t.shape, generator=gen).to(t.dtype) * (float(saved.float().std(correction=0)) + 1.0))
    try:
        after = tokens_at(model, adapter, images)
    finally:
        t.copy_(saved)
    if after is None or after.numel() != base.numel():
        return []
    after = after.reshape(base.shape)
    diff = (after[0] - base[0]).abs().amax(-1)
    return torch.nonzero(diff > 1e-5 * (1 + float(base[0].abs().amax()))).flatten().tolist()


def traced_discovery(survey, on_probe: bool = False, layer=None) -> Discovery | None:
    """The position embedding, prefix tokens and grid of the model ``survey`` (a
    :class:`~structinit.adapters.survey.ModelSurvey`, which asks this module) surveys, found by
    tracing (module doc); None when the model cannot be probed or shows no position embedding
    before its grid. With ``on_probe``, read on the images the survey probed the layers with,
    alone: for a model that resizes its position embedding to each image's grid (NaFlexViT),
    whose layers then receive another count of tokens than the embedding's own grid gives. With
    ``layer`` (name, adapter), the embedding of that layer's tokens rather than the first layer's
    (a later stage's own, added after a merge)."""
    first, probe = layer or survey.first_layer, survey.probe
    images = isinstance(probe, torch.Tensor) and probe.ndim == 4
    candidates = [] if first is None else token_candidates(survey.model, first[1].dim, channels_first=True)
    if not candidates or (on_probe and not images):
        return None
    on = [(probe, tuple(probe.shape[-2:]))] if images else None
    attention = [v.adapter.module for v in survey.attention.verdicts]
    if on_probe:
        return _trace(survey.model, first, candidates, attention, survey.example, on)
    # the sizes the model states first (its PE's grid); then the probe's images, for a model built for another (TNT)
    return _trace(survey.model, first, candidates, attention, survey.example) or (
        _trace(survey.model, first, candidates, attention, None, on) if on and survey.example is None else None)


def _trace(model, first, candidates, attention, example: ModelCall | None = None, probes=None) -> Discovery | None:
    # in the model's dtype (a table may be held in another) for every forward alike; a caller's input is the only probe
    probes = probes or ([(example, example.image_size)] if example is not None else
                        ((probe_images(model, 1, size), size[1:]) for size in probe_sizes(model, candidates)))
    for inputs, image in probes:
        for base in token_views(tokens_at(model, first[1], inputs), inputs):
            found = _classify(model, first, inputs, base, candidates)
            if found is not None:
                return _on_image(model, _with_grid(model, *found, image), inputs, attention)
    return None


def _on_image(model: nn.Module, found: Discovery, inputs, attention: list[nn.Module]) -> Discovery:
    """``found`` with its rows placed where they sit on the image, when the model's spatial maps
    show them in another order than row-major (:func:`~structinit.adapters.row_reading.raster_rows`):
    as a ``pos_reader`` that permutes them, so that every reader takes them in grid order."""
    pe, n = found.pos_embed, _rows(found.pos_embed)
    if found.pos_reader is not None or found.num_prefix_tokens or found.grid is None or math.prod(found.grid) != n:
        return found
    with recording(pe) as leaf:
        order = None if leaf is None else raster_rows(model, inputs, leaf, pe, n, attention)
    if order is None or bool((order == torch.arange(n)).all()):
        return found
    return dataclasses.replace(found, pos_reader=torch.eye(n, dtype=torch.float64)[order])  # row g: order[g]'s


def _classify(model, first, images, base, candidates) -> tuple[Discovery, int] | None:
    """Sort the candidates by the rows they change into PE and prefix tokens (module doc)."""
    rows = {name: changed_rows(model, first[1], images, base, t) for name, t in candidates}
    one_to_one = [(n, t) for n, t in candidates if rows[n] and len(rows[n]) == _rows(t)]
    pes, reader = [(n, t) for n, t in one_to_one if _rows(t) >= 4], None
    pes.sort(key=lambda nt: -_rows(nt[1]))
    if len(pes) > 1 and _rows(pes[0][1]) == _rows(pes[1][1]):
        return None  # two tables of the same size: ambiguous, the caller asks for hints
    tables = []  # more tables the tokens read with the first, for a read PE
    read = sorted(((n, t) for n, t in candidates if min(len(rows[n]), _rows(t)) >= 4),
                  key=lambda nt: -len(rows[nt[0]]))
    if read and (not pes or len(rows[read[0][0]]) > len(rows[pes[0][0]])):
        # tables the tokens read through a map (resized, gathered at position ids), feeding more of them than any
        # table of one row each (NaFlexViT's four register tokens): those of the most rows
        group = [(n, t) for n, t in read if rows[n] == rows[read[0][0]]]
        for tried in dict.fromkeys((tuple(group), tuple(group[:1]))):
            reader = table_reader(model, images, list(tried), first[0], base.shape[1])
            if reader is not None:
                pes, tables = list(tried[:1]), list(tried[1:])
                break
    if not pes:
        return None
    pe_name, pe = pes[0]
    pe_rows = set(rows[pe_name])
    if reader is not None:  # the tokens the table feeds, by its reading, in token order
        pe_rows = set(torch.nonzero(reader.abs().amax(1) > 0).flatten().tolist())
        reader = reader[sorted(pe_rows)]
    tokens = [(n, t) for n, t in one_to_one if n != pe_name and set(rows[n]) <= pe_rows | set(range(len(base[0])))
              and len(rows[n]) < len(pe_rows)]
    token_rows = sorted(r for n, _ in tokens for r in rows[n])
    grid_rows = sorted(pe_rows - set(token_rows))
    if not grid_rows or grid_rows != list(range(grid_rows[0], grid_rows[-1] + 1)):
        return None
    others = sorted(set(range(base.shape[1])) - set(grid_rows))
    if sorted(token_rows) != others:
        return None  # rows from nowhere: not a layout structinit can describe
    # Tokens off the grid count as prefix tokens wherever they sit (vit-pytorch appends its registers
    # after the grid): what reads the maps puts them first (structinit.adapters.token_order).
    tokens.sort(key=lambda nt: min(rows[nt[0]]))
    return Discovery(pe, pe_name, None, len(others), tuple(tokens), "traced", pos_reader=reader,
                     pos_tables=tuple(tables)), len(grid_rows)


def table_reader(model: nn.Module, inputs, tables: list[tuple[str, torch.Tensor]], layer: str,
                 tokens: int) -> torch.Tensor | None:
    """(T, R) float64 A such that the model's T tokens are content + A·``tables`` (their (R, D)
    rows one after the other), the same A on every channel: how tables the tokens do not get one
    row each of are read (one resized to the call's grid as SigLIP-2's, gathered at position ids,
    a row and a column table summed as Pix2Struct's). Read where their sum with the content is
    not yet normalised: the output of a module that holds the tables (nearest first), else the
    input of a module that receives the tokens before attention layer ``layer`` does
    (:func:`_token_takers`). A comes from one backward per D tokens (token t's cotangent one-hot
    on channel t mod D) and is checked on a random change of the tables, restored bit for bit.
    None when no such place shows a linear, per-channel reading."""
    if any(leaf_of(t) is not t or not t.is_floating_point() for _, t in tables):
        return None  # a view or a computed tensor: no rows to write through
    modules = dict(model.named_modules())
    ancestors = lambda path: [p for p in (".".join(path.split(".")[:i]) for i in range(path.count(".") + 1, 0, -1))
                              if p in modules]
    # the first table's holder and its parents (a place that sees one table of several reads the others as none)
    holder = tables[0][0].rpartition(".")[0]
    sites = [(modules[p], True) for p in ancestors(holder) if p and not layer.startswith(p + ".")]
    sites += [(m, False) for m in _token_takers(model, modules[layer], inputs, tokens, tables[0][1].shape[-1])]
    for module, output in sites:
        reader = _reading_at(model, inputs, [t for _, t in tables], module, output, tokens)
        if reader is not None:
            return reader
    return None


def _token_takers(model: nn.Module, layer: nn.Module, inputs, tokens: int, width: int) -> list[nn.Module]:
    """The modules that receive (B, T, D) tokens (or one packed (T, D) sequence) before attention
    layer ``layer`` does, the layer's own ancestors included, nearest first (a pre-norm block's
    norm, the block, the encoder): where the tokens may still be the tables' sum with the content."""
    found, handles = [], []

    def note(module, args, kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if x is not None and x.ndim in (2, 3) and tuple(x.shape[-2:]) == (tokens, width) and module not in found:
            found.append(module)

    for module in model.modules():
        if module is not model and module is not layer:
            handles.append(module.register_forward_pre_hook(note, with_kwargs=True))
    try:
        tensor_at(model, layer, inputs, output=False)
    finally:
        for handle in handles:
            handle.remove()
    return found[::-1][:_SITES]


_SITES = 6  # places a table's reading is tried at, nearest the attention layer first


def _reading_at(model, inputs, tables, module, output, tokens) -> torch.Tensor | None:
    width, sizes = tables[0].shape[-1], [_rows(t) for t in tables]
    with contextlib.ExitStack() as stack:
        leaves = [stack.enter_context(recording(t)) for t in tables]
        y = None if None in leaves else tensor_at(model, module, inputs, output, keep_graph=True)
        y = y[None] if y is not None and y.ndim == 2 else y  # one packed sequence, (T, D)
        if y is None or y.ndim != 3 or tuple(y.shape[1:]) != (tokens, width) or not y.requires_grad:
            return None
        reader = torch.zeros(tokens, sum(sizes), dtype=torch.float64)
        for start in range(0, tokens, width):
            span = torch.arange(start, min(start + width, tokens))
            cot = torch.zeros_like(y)
            cot[0, span, span - start] = 1
            grads = torch.autograd.grad(y, leaves, cot, retain_graph=True, allow_unused=True)
            if any(g is None for g in grads):
                return None
            rows = torch.cat([g.reshape(-1, width) for g in grads])
            reader[span] = rows[:, span - start].T.double()
        base = y[0].detach().double()
    with torch.no_grad():  # linear and the same on every channel: a random change moves the tokens by A·change
        saved = [t.detach().clone() for t in tables]
        gen = torch.Generator().manual_seed(2)
        changes = [torch.randn(t.shape, generator=gen, dtype=torch.float64) * (float(s.double().std(correction=0)) + 1)
                   for t, s in zip(tables, saved)]
        try:
            for t, c in zip(tables, changes):
                t.add_(c.to(t.dtype))
            after = tensor_at(model, module, inputs, output)
        finally:
            for t, s in zip(tables, saved):
                t.copy_(s)
    after = after[None] if after is not None and after.ndim == 2 else after
    if after is None or after.shape != y.shape:
        return None
    moved = after[0].double() - base
    predicted = reader @ torch.cat([c.reshape(-1, width) for c in changes])
    ok = (moved - predicted).abs().amax() <= 1e-4 * (1 + float(predicted.abs().amax()) + float(base.abs().amax()))
    return reader if bool(ok) and bool(reader.abs().amax() > 0) else None


def _with_grid(model: nn.Module, found: Discovery, n: int, image: tuple[int, int] | None) -> Discovery:
    """``found`` with its grid of ``n`` tokens: the probe image cut into the model's patches (with
    no patch convolution, n square ones) when that gives ``n``, else the square grid of ``n``."""
    pe = found.pos_embed
    grid = None if image is None else _grid_from(image, _patch(model) or square_patch(image, n))
    if grid is None or min(grid) < 2 or grid[0] * grid[1] not in (n, _rows(pe)):  # (1, n): patches packed in a row
        side = square_side(n)
        grid = (side, side) if side else None
    return dataclasses.replace(found, grid=grid, source="traced")


def consistent(found: Discovery, first_layer_tokens: int | None) -> bool:
    """Whether a name-based :class:`Discovery`'s PE rows fit its grid and prefix tokens (when the
    grid is unknown, whether the rows left after the prefix tokens form a square), and the
    first attention layer receives as many tokens (``first_layer_tokens``, None when unknown)
    as they add up to (a wrapper may append tokens the name-based finder cannot see)."""
    if found.pos_embed is None:
        return False
    rows, prefix = _rows(found.pos_embed), found.num_prefix_tokens or 0
    if found.grid is None:
        fits = square_side(rows - prefix) is not None or (not prefix and square_side(rows) is not None)
    else:
        n = math.prod(found.grid)
        fits = rows in (n, n + prefix) and (found.num_prefix_tokens is not None or rows == n)
    count = first_layer_tokens
    return fits and (count is None or count in (rows, rows + prefix))


@torch.no_grad()
def traced_patch_embedding(survey, layer=None,
                           pos_embed=None) -> list[tuple[str, torch.Tensor, torch.Tensor | None]] | None:
    """The layers that write patch content into the tokens, found by tracing: the last Linear or
    Conv2d to the model width that runs before the first attention layer, as (name, weight,
    bias), then the bias of each width-D LayerNorm between it and the position embedding
    (vit-pytorch normalises the patch embedding's output): a reservation projects those. Their
    outputs do not depend on the PE, which tells them from the norms the tokens pass after it.
    With ``layer`` (name, adapter) and its ``pos_embed``, those of a later stage's tokens (its
    merge). ValueError when such a LayerNorm has a non-constant weight (it would mix position
    back in); None when nothing is found."""
    model, first = survey.model, layer or survey.first_layer
    found = survey.position.pos_embed if pos_embed is None else pos_embed
    if first is None or found is None or survey.probe is None:
        return None
    adapter, names = first[1], {id(m): n for n, m in model.named_modules()}
    inside = {id(m) for m in adapter.module.modules()}
    with torch.no_grad():
        images = first_sample(survey.probe)
        calls = _calls(model, adapter, images, inside)
        if calls is None:
            return None
        width = lambda m: m.out_features if isinstance(m, nn.Linear) else getattr(m, "out_channels", None)
        patch = [i for i, (m, _) in enumerate(calls)
                 if isinstance(m, (nn.Linear, nn.Conv2d)) and width(m) == adapter.dim]
        if not patch:
            return None
        saved = found.detach().clone()
        found.add_(torch.randn(found.shape, generator=torch.Generator().manual_seed(1)).to(found.dtype))
        try:
            perturbed = _calls(model, adapter, images, inside)
        finally:
            found.copy_(saved)
        if perturbed is None:  # the model refuses the perturbed PE: no answer
            return None
        same = [i < len(perturbed) and perturbed[i][0] is m and torch.equal(out, perturbed[i][1])
                for i, (m, out) in enumerate(calls)]
        patch = [i for i in patch if same[i]]
        if not patch:
            return None
        m = calls[patch[-1]][0]
        writes = [(names[id(m)], m.weight, m.bias)]
        for norm, _ in (calls[i] for i in range(patch[-1] + 1, len(calls)) if same[i]):
            if isinstance(norm, nn.LayerNorm) and norm.normalized_shape == (adapter.dim,):
                writes += _norm_writes(names[id(norm)], norm)
        return writes


def _norm_writes(name: str, norm: nn.LayerNorm) -> list[tuple[str, torch.Tensor, None]]:
    weight = norm.weight
    if weight is not None and not bool((weight == weight.flatten()[0]).all()):
        raise ValueError(f"{name} (LayerNorm after the patch embedding) has a non-constant weight, which would "
                         "mix content back into the position directions")
    return [] if norm.bias is None else [(f"{name}.bias", norm.bias, None)]


def _calls(model, adapter, images, inside) -> list[tuple[nn.Module, torch.Tensor]] | None:
    """(module, output) of every Linear / Conv2d / LayerNorm outside the attention module, in
    the order they run before the first attention layer; None when the forward fails."""
    calls, handles = [], []
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.LayerNorm)) and id(m) not in inside:
            handles.append(m.register_forward_hook(lambda mod, args, out: calls.append((mod, out.detach().clone()))))
    try:
        ok = tokens_at(model, adapter, images) is not None
    finally:
        for h in handles:
            h.remove()
    return calls if ok else None

