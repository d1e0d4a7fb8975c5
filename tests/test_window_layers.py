"""Attention layers that a name adapter claims but that take (B, H, W, D) image maps: those that
cut, pad and shift their own windows (torchvision's Swin) are judged on the tokens their q
projection receives and the output their output projection returns; those whose maps cannot be
compared are refused before any write; a map as large as the grid (SAM's ViT) is checked on the
grid's own rows. Each test reads the layer's own softmax in its forward."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from styled_vit import StyledViT
from torch import nn

import structinit
from rejection import check_rejected
from structinit.schemes.checks import diagonal_strength


class _WindowAdapter(structinit.AttentionAdapter):
    """A name adapter for the test's window layers: its fused qkv and proj, nothing about windows."""

    def __init__(self, module):
        self.module, self.num_heads = module, module.h
        self.dim = module.qkv.in_features
        self.head_dim, self.scale = self.dim // module.h, (self.dim // module.h) ** -0.5

    def linear_views(self):
        from structinit.adapters.attention import split_views

        m = self.module
        return split_views(m.qkv.weight, m.qkv.bias, self.dim) | {"o": (m.proj.weight, m.proj.bias)}


@pytest.fixture
def window_adapter():
    from attention_styles import ShiftedWindowAttention

    structinit.register_adapter(ShiftedWindowAttention, _WindowAdapter)
    yield
    structinit.unregister_adapter(ShiftedWindowAttention)


def test_a_layer_that_pads_shifts_and_cuts_its_own_windows_is_judged_on_its_projections_tokens(window_adapter):
    """torchvision's Swin receives (B, H, W, D) maps and pads, rolls and cuts them into windows
    itself, with a mask built inside: the tokens its maps are made of are the ones its q projection
    receives, and its output before the windows are put back is its output projection's. Read so,
    the layer is judged (checked) and mimetic's check after the write runs on it: a layer that then
    misreads its keys is caught, where it used to be passed unchecked."""
    from structinit.adapters.survey import ModelSurvey
    from structinit.schemes.checks import mimetic_check

    model = StyledViT("shifted-windows")
    survey = ModelSurvey(model)
    assert [(v.kind, v.checked) for v in survey.attention.verdicts] == [("self", True)] * 2
    structinit.init_(model, "mimetic", seed=0)
    assert all(v.checked for v in ModelSurvey(model).attention.verdicts)
    model.attns[1].misread = True
    with pytest.raises(ValueError, match=r"head \d of layer 'attns\.1' .* shows a diagonal of strength"):
        mimetic_check(ModelSurvey(model), [(v.name, v.adapter) for v in survey.attention.verdicts])()


def test_a_window_layer_whose_maps_are_not_its_projections_is_refused_untouched(window_adapter):
    model = StyledViT("shifted-windows")
    model.attns[1].misread = True
    check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"layer 'attns\.1' \(ShiftedWindowAttention\): its q kᵀ is not that of the projections")


def test_impulse_on_image_maps_channels_last_designs_and_checks_on_their_grid():
    """SAM's ViT hands its attention (B, H, W, D) maps (a window as large as the grid): the
    position-only input the design is checked on is the grid rows of LayerNorm(PE) in the map's
    row-major order, not zeros (every head then missed its target: the write was undone)."""
    from attention_styles import WindowAttention

    model = StyledViT("windows")
    model.attns = nn.ModuleList(WindowAttention(48, 3, window=8) for _ in model.attns)
    structinit.register_adapter(WindowAttention, _WindowAdapter)  # named, as timm's SAM attention is
    try:
        structinit.init_(model, "impulse", seed=0)
    finally:
        structinit.unregister_adapter(WindowAttention)
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


class _EinsumWindows(nn.Module):
    """Cuts 4×4 windows out of the (B, 8, 8, D) maps it receives and projects them with einsum on
    its own weights: no F.linear shows which tokens its maps are made of."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, hh, ww, c = x.shape
        win = x.view(b, 2, 4, 2, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16, c)
        qkv = torch.einsum("ntc,oc->nto", win, self.qkv.weight) + self.qkv.bias
        q, k, v = qkv.reshape(-1, 16, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        out = ((q @ k.transpose(-2, -1)) * (c // self.h) ** -0.5).softmax(-1) @ v
        out = torch.einsum("ntc,oc->nto", out.transpose(1, 2).reshape(-1, 16, c), self.proj.weight) + self.proj.bias
        return out.view(b, 2, 2, 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, c)


def test_mimetic_refuses_a_layer_whose_maps_it_cannot_compare_before_writing():
    """A name adapter on a layer that cuts its own windows and projects them with einsum: neither
    its input nor an F.linear holds the tokens its maps are made of, so the probe cannot compare
    them with the adapter's, and mimetic refuses before any write (it used to write it unchecked)."""
    model = StyledViT("windows")
    model.attns = nn.ModuleList(_EinsumWindows(48, 3) for _ in model.attns)
    structinit.register_adapter(_EinsumWindows, _WindowAdapter)
    try:
        check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                       r"mimetic cannot check its write to layer 'attns\.0' \(_EinsumWindows\).*layers=")
    finally:
        structinit.unregister_adapter(_EinsumWindows)


def _window_hits(model, layer: int) -> torch.Tensor:
    """Per head, the share of grid rows whose argmax in layer ``layer``'s own map is the token at
    its offset, on the position-only input the test builds itself: the block's norm of the PE,
    padded and cut as the model cuts it; rows whose target is off the grid or in another window
    are not counted."""
    with torch.no_grad():
        attn = model.attns[layer]
        attn(model.windows(model.norms[layer](model.pos_embed)))
        probs = attn.last_probs  # (windows, heads, 9, 9), as the module computed them
    s, n = model.window, math.ceil(8 / model.window)
    hits = []
    for h, (dy, dx) in enumerate(attn.structinit_impulse["offsets"]):
        got = []
        for w in range(n * n):
            for t in range(s * s):
                y, x = (w // n) * s + t // s, (w % n) * s + t % s
                ty, tx = y + dy, x + dx
                if y >= 8 or x >= 8 or not (0 <= ty < 8 and 0 <= tx < 8) or (ty // s, tx // s) != (y // s, x // s):
                    continue
                got.append(int(probs[w, h, t].argmax()) == (ty % s) * s + tx % s)
        hits.append(sum(got) / len(got))
    return torch.tensor(hits)


def test_impulse_on_windows_padded_and_cut_from_a_grid_with_an_absolute_embedding_hits_in_each_window():
    """SAM's layout: an absolute PE on the grid, windows cut (and padded) by the model before each
    windowed layer's call. Which grid position each window token holds is read off the forward;
    the layer's own maps on its position-only windows then hit every head's target wherever the
    target shares the query's window, and impulse_fidelity, reading the same maps, agrees."""
    from layout_models import PaddedWindowViT

    torch.manual_seed(0)
    model = PaddedWindowViT()
    structinit.init_(model, "impulse", seed=0)
    for layer in (0, 2):  # the windowed layers (9 windows of 3×3, the last row and column padding)
        assert (_window_hits(model, layer) == 1).all(), layer
    assert (structinit.impulse_fidelity(model)["hit"] == 1).all()
    # On images, a batch is scored image by image (each image's windows put on its own grid): the same as
    # the images one at a time
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    together = structinit.impulse_fidelity(model, images)["hit"]
    alone = torch.stack([structinit.impulse_fidelity(model, images[i:i + 1])["hit"] for i in range(3)]).mean(0)
    assert torch.allclose(together, alone, atol=1e-6) and bool((together > 0.5).all())


def _cut(h: int, w: int, s: int) -> torch.Tensor:
    """The grid index of each token of the s×s windows of an h×w grid padded to whole windows
    (−1 for padding), slices row-major: what SAM's partition hands each windowed layer."""
    grid = torch.full(((h + s - 1) // s * s, (w + s - 1) // s * s), -1)
    grid[:h, :w] = torch.arange(h * w).reshape(h, w)
    ny, nx = grid.shape[0] // s, grid.shape[1] // s
    return grid.reshape(ny, s, nx, s).permute(0, 2, 1, 3).reshape(ny * nx, s * s)


@given(h=st.integers(1, 9), w=st.integers(1, 9), s=st.integers(1, 5), seed=st.integers(0, 99))
@settings(max_examples=60, deadline=None)
def test_windows_cut_from_a_grid_are_told_from_tokens_of_other_windows(h, w, s, seed):
    from structinit.adapters.token_order import cut_from_grid

    windows = _cut(h, w, s)
    is_window = windows.shape[0] > 1 or bool((windows < 0).any())  # else the grid itself, not windows
    assert cut_from_grid(windows, (h, w)) == is_window
    shuffled = windows[:, torch.randperm(windows.shape[1], generator=torch.Generator().manual_seed(seed))]
    assert cut_from_grid(shuffled, (h, w)) == is_window  # the order inside a window is free (Hiera's unrolled units)
    if windows.shape[0] > 1:  # a token of the first window that holds a position of the last: not a window cut
        real = torch.nonzero(windows[0] >= 0).flatten()
        moved = windows.clone()
        moved[0, real[seed % len(real)]] = windows[-1][windows[-1] >= 0][0]
        assert not cut_from_grid(moved, (h, w))


_WINDOW_ORDER = torch.arange(64).reshape(2, 4, 2, 4).permute(0, 2, 1, 3).flatten()  # StyledViT("segments")


def _segment_hits(model, layer: int) -> torch.Tensor:
    """Per head, the share of grid rows whose argmax in layer ``layer``'s own per-window maps is the
    token at its offset, on the block's norm of the PE put in window order as the model puts its
    tokens; rows whose target is off the grid or in another window are not counted."""
    with torch.no_grad():
        attn = model.attns[layer]
        attn(model.norms[layer](model.pos_embed[:, _WINDOW_ORDER]), cu_seqlens=torch.arange(0, 65, 16))
    hits = []
    for h, (dy, dx) in enumerate(attn.structinit_impulse["offsets"]):
        got = []
        for w, probs in enumerate(attn.last_probs):  # window w: grid positions _WINDOW_ORDER[16w:16w + 16]
            cells = _WINDOW_ORDER[16 * w:16 * w + 16].tolist()
            for t, cell in enumerate(cells):
                target = (cell // 8 + dy) * 8 + cell % 8 + dx
                if 0 <= cell // 8 + dy < 8 and 0 <= cell % 8 + dx < 8 and target in cells:
                    got.append(int(probs[0, h, t].argmax()) == cells.index(target))
        hits.append(sum(got) / len(got))
    return torch.tensor(hits)


def test_attention_within_segments_one_softmax_each_is_one_map_with_the_pairs_across_closed():
    """Eager attention over a packed sequence computes one softmax per segment (MiniCPM-V's window
    merger: its tokens put in window order, each window a segment). Read as one map whose pairs
    across segments are closed, the layer is plain attention: mimetic's diagonal shows in every
    segment's own logits, and impulse's heads hit their targets in each window's own map, as the
    test counts it and impulse_fidelity agrees; a layer whose segment maps are not its
    projections' is refused, the model left as it was."""
    from attention_styles import SegmentAttention

    torch.manual_seed(0)
    model = StyledViT("segments")
    assert [(v.kind, v.checked) for v in structinit.adapters.attention_survey(model).verdicts] == [("self", True)] * 2
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    for attn in model.attns:
        assert len(attn.last_logits) == 4 and all((diagonal_strength(lg) > 0.25).all() for lg in attn.last_logits)
    torch.manual_seed(0)
    model = StyledViT("segments")
    structinit.init_(model, "impulse", seed=0, reserve="none")
    for layer in range(2):
        assert (_segment_hits(model, layer) == 1).all(), layer
    assert (structinit.impulse_fidelity(model)["hit"] == 1).all()
    broken = StyledViT("segments")
    broken.attns[1].misread = True
    assert isinstance(broken.attns[1], SegmentAttention)
    check_rejected(broken, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError, r"attns\.1")


def _block_shifts(probs: torch.Tensor, blocks: int, size: int) -> list[float]:
    """Per head, the share of the rows whose target lies in the query's block that put their
    argmax on the head's most common (dy, dx) shift, read on the image's own grid (NesT's blocks
    are row-major over the image, tokens row-major inside a block)."""
    side = round(blocks**0.5)
    t, n = torch.meshgrid(torch.arange(blocks), torch.arange(size * size), indexing="ij")
    y, x = (t // side) * size + n // size, (t % side) * size + n % size
    shares = []
    for head in probs[0].argmax(-1):  # (blocks, n): the key each query puts its argmax on
        dy, dx = torch.gather(y, 1, head) - y, torch.gather(x, 1, head) - x
        pairs = torch.stack([dy.flatten(), dx.flatten()], 1)
        shift, _ = max(((p, int((pairs == p).all(1).sum())) for p in pairs.unique(dim=0)), key=lambda c: c[1])
        ty, tx = y + shift[0], x + shift[1]
        inside = ((ty // size == y // size) & (tx // size == x // size) & (ty >= 0) & (tx >= 0)).flatten()
        shares.append(float((pairs[inside] == shift).all(1).float().mean()))
    return shares


def test_impulse_on_position_embeddings_added_block_by_block_hits_on_the_image_grid():
    """NesT adds each level's (1, blocks, n, D) position embedding after cutting the grid into
    blocks, so its rows run block by block: impulse reads where each row sits on the image from
    the model's own spatial maps, lays each level's layers out as windows of that level's grid,
    and every head of both levels puts its argmax on one shift of the image grid in the model's
    own maps on the position-only input (the patch and the pooling silenced)."""
    from nested_models import NestedViT

    torch.manual_seed(0)
    model = NestedViT().eval()
    structinit.init_(model, "impulse", seed=0)
    record = structinit.get_record(model, "init")
    assert record["layers"] == ["levels.0.attn", "levels.1.attn"]
    zero = lambda module, args, out: torch.zeros_like(out)
    handles = [model.patch.register_forward_hook(zero), model.levels[1].pool.register_forward_hook(zero)]
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    for handle in handles:
        handle.remove()
    for level, blocks in zip(model.levels, (16, 4)):
        assert min(_block_shifts(level.attn.last_probs, blocks, 4)) == 1.0
        assert level.pos_embed.grad is None and not torch.equal(level.pos_embed, torch.zeros_like(level.pos_embed))
    assert bool((structinit.impulse_fidelity(model)["hit"].nan_to_num(1.0) == 1).all())


def test_the_rows_of_a_block_by_block_embedding_are_placed_on_the_image_grid():
    """The survey's position embedding of NestedViT permutes its rows onto the 16×16 grid as
    blockify does: grid position (y, x) reads row (block, index in the block)."""
    from nested_models import NestedViT

    from structinit.adapters.layout import grid_positions
    from structinit.adapters.survey import ModelSurvey

    found = ModelSurvey(NestedViT()).position
    assert found.pos_embed_name == "levels.0.pos_embed" and found.grid == (16, 16)
    y, x = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    row_of_position = ((y // 4) * 4 + x // 4) * 16 + (y % 4) * 4 + x % 4  # blockify's order
    positions = grid_positions(found, 256)
    assert torch.equal(positions[row_of_position.flatten()], torch.arange(256))


class _PixelsInPatches(nn.Module):
    """TNT's two levels: attention over the 3×3 pixels inside each 3×3 patch of a 12×12 image,
    with one (9, 16) pixel position embedding added to every patch alike (windows of
    (B·16, 9, 16)), then attention over the 4×4 patches with their own embedding."""

    def __init__(self):
        super().__init__()
        from attention_modules import SepAttention

        self.pixel = nn.Conv2d(3, 16, 1)
        self.pixel_pos = nn.Parameter(structinit.sincos_2d((3, 3), 16)[None])
        self.inner = SepAttention(16, 2)
        self.merge = nn.Linear(144, 32)
        self.patch_pos = nn.Parameter(structinit.sincos_2d((4, 4), 32)[None])
        self.outer = SepAttention(32, 2)
        self.image_size = 12

    def forward(self, images):
        b = len(images)
        x = self.pixel(images).reshape(b, 16, 4, 3, 4, 3).permute(0, 2, 4, 3, 5, 1).reshape(b * 16, 9, 16)
        x = x + self.pixel_pos
        x = x + self.inner(x)
        x = self.merge(x.reshape(b, 16, 144)) + self.patch_pos
        return (x + self.outer(x)).mean(1)


def test_an_embedding_added_to_every_window_alike_is_found_on_the_windows():
    """The pixel embedding changes each window's 9 rows one to one, the same in every window: its
    grid is a window's (3×3), not the image's (a reading of the image's tokens as one sample, right
    for NesT's blocks, found no embedding, and impulse refused TNT); both levels are written and
    checked in the model's own maps."""
    torch.manual_seed(0)
    model = _PixelsInPatches()
    structinit.init_(model, "impulse", seed=0, reserve="none")
    assert structinit.get_record(model, "init")["layers"] == ["inner", "outer"]
    assert [structinit.get_record(model.inner)["grid"], structinit.get_record(model.outer)["grid"]] == [(3, 3), (4, 4)]
