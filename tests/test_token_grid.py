"""Impulse writes each head's offset on a grid: the grid must be where the model's own image
puts the tokens. A patch map flattened column by column, or a grid= of the other shape, is
either written in the tokens' true geometry or refused, never written on the wrong one, whether
the patches come from a convolution's map or are cut from the image by a reshape."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from structinit.adapters.row_reading import image_maps, image_positions, read_rows, with_pixel_patches

DIM, HEADS, PATCH = 48, 3, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, HEADS, -1).transpose(1, 2)
        logits = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(DIM // HEADS)
        probs = logits.softmax(-1)
        self.last = probs.detach()  # the model's own map, read by the test
        return self.o((probs @ split(self.v(x))).transpose(1, 2).reshape(b, t, DIM))


# How each order reads an h×w patch map into tokens, and where a grid offset (dy, dx) lands on the image.
ORDERS = {
    "rows": (lambda x: x, lambda dy, dx: (dy, dx)),
    "columns": (lambda x: x.transpose(2, 3), lambda dy, dx: (dx, dy)),
    "reversed": (lambda x: x.flip(2, 3), lambda dy, dx: (-dy, -dx)),
    "mirrored": (lambda x: x.flip(3), lambda dy, dx: (dy, -dx)),
}
SCATTERED = torch.randperm(24, generator=torch.Generator().manual_seed(0))  # the 6×4 map's positions, shuffled


class PatchViT(nn.Module):
    """Patches of an h×w map read in one of :data:`ORDERS`, with a learned position embedding
    added in token order; the map made by a patch convolution (``cut="conv"``) or by a Linear on
    patches cut from the image by a reshape (``cut="reshape"``: no module returns a map)."""

    def __init__(self, h: int, w: int, order: str, pe_name: str = "pos_embed", cut: str = "conv"):
        super().__init__()
        self.order, self.pe_name, self.cut = order, pe_name, cut
        self.patch_embed = nn.Conv2d(3, DIM, PATCH, PATCH) if cut == "conv" else nn.Linear(3 * PATCH**2, DIM)
        setattr(self, pe_name, nn.Parameter(torch.randn(1, h * w, DIM) * 0.02))  # another name: found by tracing
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.blocks = nn.ModuleList(Attention() for _ in range(2))

    def patch_map(self, images):
        if self.cut == "conv":
            return self.patch_embed(images)
        b, c, height, width = images.shape
        cut = images.reshape(b, c, height // PATCH, PATCH, width // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
        return self.patch_embed(cut.flatten(3)).permute(0, 3, 1, 2)  # (B, D, h, w), from no module

    def forward(self, images):
        x = self.patch_map(images)
        x = x.flatten(2)[..., SCATTERED] if self.order == "scattered" else ORDERS[self.order][0](x).flatten(2)
        x = x.transpose(1, 2) + getattr(self, self.pe_name)
        for norm, attn in zip(self.norms, self.blocks):
            x = x + attn(norm(x))
        return x.mean(1)


def _model(h, w, order, pe_name="pos_embed", cut="conv"):
    torch.manual_seed(0)
    model = PatchViT(h, w, order, pe_name, cut).eval()
    nn.init.zeros_(model.patch_embed.bias)  # zero images then carry position alone
    return model


def _positions(model, h, w):
    """(T, 2): where on the h×w patch map each token comes from, (row, column)."""
    index = torch.arange(h * w).reshape(1, 1, h, w)
    at = ORDERS[model.order][0](index).flatten()  # the row-major position each token holds
    return torch.stack([at // w, at % w], 1)


def _image_offsets(model, h, w):
    """Per layer and head, the offsets on the image (dy, dx) from each token to the key its own
    softmax map puts its argmax on, for a zero image (position alone)."""
    with torch.no_grad():
        model(torch.zeros(1, 3, PATCH * h, PATCH * w))
    at = _positions(model, h, w)
    return [[at[block.last[0, head].argmax(-1)] - at for head in range(HEADS)] for block in model.blocks]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_conv_on_image(model, h, w):
    """Each head's argmax lands where its recorded offset goes on the image (transposed or
    negated by the tokens' order) for every token whose target lies on the image."""
    for block, per_head in zip(model.blocks, _image_offsets(model, h, w)):
        for (dy, dx), got in zip(structinit.get_record(block)["offsets"], per_head):
            want = torch.tensor(ORDERS[model.order][1](dy, dx))
            target = _positions(model, h, w) + want
            inside = (target[:, 0] >= 0) & (target[:, 0] < h) & (target[:, 1] >= 0) & (target[:, 1] < w)
            assert bool((got[inside] == want).all()), (dy, dx, got[inside].tolist())


@pytest.mark.parametrize("cut", ["conv", "reshape"])
@pytest.mark.parametrize("order, grid, message", [
    ("columns", (6, 4), r"its own 6×4 patch map column by column; pass grid=\(4, 6\), .* landing at \(dx, dy\)"),
    ("rows", (4, 6), r"its own 6×4 patch map row by row; pass grid=\(6, 4\)"),
    ("scattered", (6, 4), r"6×4 patch map in an order that no grid of rows and columns follows"),
    ("reversed", (4, 6), r"row by row, from the bottom up, from right to left; pass grid=\(6, 4\), .* \(−dy, −dx\)"),
])
def test_a_grid_that_is_not_where_the_image_puts_the_tokens_is_refused_and_the_model_kept(order, grid, message,
                                                                                           cut):
    model = _model(6, 4, order, cut=cut)
    before = _state(model)
    with pytest.raises(ValueError, match=message):
        structinit.init_(model, "impulse", seed=0, grid=grid, example_inputs=torch.randn(2, 3, 12, 8))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tokens_read_column_by_column_on_the_transposed_grid_are_a_convolution_on_the_image():
    model = _model(6, 4, "columns")
    structinit.init_(model, "impulse", seed=0, grid=(4, 6), example_inputs=torch.randn(2, 3, 12, 8))
    _assert_conv_on_image(model, 6, 4)


@settings(max_examples=16, deadline=None, derandomize=True)
@given(h=st.integers(3, 6), w=st.integers(3, 6), order=st.sampled_from(sorted(ORDERS)), swap=st.booleans(),
       cut=st.sampled_from(["conv", "reshape"]))
def test_every_grid_and_token_order_is_written_on_the_image_or_refused(h, w, order, swap, cut):
    """Whatever the patch map's shape, how it is cut, the order its tokens are read in and which
    way round grid= is given, impulse either refuses (the model kept) or writes convolutions on
    the image."""
    model = _model(h, w, order, cut=cut)
    before = _state(model)
    grid = (w, h) if swap else (h, w)
    try:
        structinit.init_(model, "impulse", seed=0, grid=grid, example_inputs=torch.randn(2, 3, PATCH * h, PATCH * w))
    except ValueError as err:
        assert "grid=" in str(err)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert grid != ((w, h) if order == "columns" else (h, w))  # the tokens' own grid is never refused
        return
    _assert_conv_on_image(model, h, w)


def test_rows_are_read_right_when_the_gradient_is_a_view_of_a_larger_one():
    """One sample whose embedded tokens are sliced out of a longer sequence's gradient (a token
    prepended after the embedding is added): the gradient is a strided view, read as laid out."""
    pe = nn.Parameter(torch.randn(1, 6, 4))
    with torch.enable_grad():
        x = torch.cat([torch.zeros(1, 1, 4), torch.ones(1, 6, 4) + pe, torch.zeros(1, 2, 4)], 1)
        order = read_rows(x, pe, pe, 6)
    assert order.tolist() == [[-1, 0, 1, 2, 3, 4, 5, -1, -1]]


def test_image_positions_read_a_map_flattened_column_by_column():
    conv = nn.Conv2d(3, 8, 2, 2)
    with torch.enable_grad(), image_maps(conv, 12) as maps:
        x = conv(torch.randn(1, 3, 6, 8)).transpose(2, 3).flatten(2).transpose(1, 2)  # a 3×4 map, column by column
        (h, w), at = image_positions(x, maps)
    t = torch.arange(12)
    assert (h, w) == (3, 4) and at.tolist() == ((t % 3) * 4 + t // 3).tolist()


def test_image_positions_read_patches_cut_from_the_image_itself():
    """No module returns a map: the image, spread from a leaf of one entry a patch, is the map."""
    images = torch.randn(1, 3, 6, 8)
    with torch.enable_grad():
        maps = []
        moved = with_pixel_patches(images, 12, maps)
        cut = moved.reshape(1, 3, 3, 2, 4, 2).permute(0, 4, 2, 1, 3, 5).flatten(3).flatten(1, 2)  # column by column
        (h, w), at = image_positions(cut, maps)
    t = torch.arange(12)
    assert (h, w) == (3, 4) and at.tolist() == ((t % 3) * 4 + t // 3).tolist()
    assert torch.equal(moved, images) and with_pixel_patches(images, 7, []) is images  # 7 square patches tile no 6×8


@pytest.mark.parametrize("cut", ["conv", "reshape"])
def test_without_grid_the_grid_is_the_example_images_patches_and_is_checked_against_the_tokens(cut):
    """A model that states no image size gets its grid from the image it is called with, cut
    by its patch convolution or, with none, into square patches as many as its tokens; tokens
    read column by column are then refused naming the grid that fits them (before, the model's
    24 rows, no square, left no grid to infer)."""
    model = _model(6, 4, "rows", cut=cut)
    structinit.init_(model, "impulse", seed=0, example_inputs=torch.randn(2, 3, 12, 8))
    assert tuple(structinit.get_record(model.blocks[0])["grid"]) == (6, 4)
    _assert_conv_on_image(model, 6, 4)
    model = _model(6, 4, "columns", cut=cut)
    with pytest.raises(ValueError, match=r"grid=\(6, 4\) does not match .* column by column; pass grid=\(4, 6\)"):
        structinit.init_(model, "impulse", seed=0, example_inputs=torch.randn(2, 3, 12, 8))


def test_patches_packed_in_one_row_are_read_as_the_square_grid_of_their_count():
    """An image that is a strip of patches (a vision tower's packed input) gives no 1×N grid: N
    tokens are laid out on the square grid, as for a model that states no image (its position
    embedding under a name no finder knows, so the forward's trace finds it and its grid)."""
    model = _model(1, 16, "rows", pe_name="where")
    structinit.init_(model, "impulse", seed=0, example_inputs=torch.randn(2, 3, PATCH, 16 * PATCH))
    assert tuple(structinit.get_record(model.blocks[0])["grid"]) == (4, 4)


class ClassTokenAt(PatchViT):
    """A 4×4 grid with a class token put at sequence index ``at``, a 17-row position embedding
    added to every token: prefix tokens first is what structinit reads an embedding as."""

    def __init__(self, at: int):
        super().__init__(4, 4, "rows")
        self.at = at
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, DIM) * 0.02)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([x[:, :self.at], self.cls_token.expand(len(x), -1, -1), x[:, self.at:]], 1) + self.pos_embed
        for norm, attn in zip(self.norms, self.blocks):
            x = x + attn(norm(x))
        return x.mean(1)


@pytest.mark.parametrize("at", [16, 8])
def test_a_class_token_after_or_among_the_patches_is_refused_not_written_one_token_off(at):
    """Read as prefix-first, the embedding's grid rows would feed the patches one token off (the
    last patch row wrapping onto the class token): the check sees the image feed other tokens."""
    torch.manual_seed(0)
    model = ClassTokenAt(at).eval()
    before = _state(model)
    with pytest.raises(ValueError, match=rf"grid rows do not feed the tokens the image does: token 0, from patch "
                                         rf"\(0, 0\) .* takes no grid row, and token {at}, which no patch feeds"):
        structinit.init_(model, "impulse", seed=0, example_inputs=torch.randn(2, 3, 8, 8))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.manual_seed(0)
    structinit.init_(ClassTokenAt(0).eval(), "impulse", seed=0, example_inputs=torch.randn(2, 3, 8, 8))  # first: fine
