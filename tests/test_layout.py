"""Token layout inference: grid and prefix tokens from the model, or given explicitly."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from attention_modules import SepViT

# ---------------------------------------------------------------------------------------------
# layout inference
# ---------------------------------------------------------------------------------------------


class PosOnly(nn.Module):
    def __init__(self, rows, dim=8, cls=False, reg=0, no_embed_class=False):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, rows, dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if cls else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg, dim)) if reg else None
        self.no_embed_class = no_embed_class


def test_layout_from_patch_embed_grid_size():
    model = structinit.create_model("vit_micro_patch2_16")
    assert structinit.infer_layout(model) == structinit.TokenLayout((8, 8), 0)
    cls = structinit.create_model("vit_micro_patch2_16", img_size=12, class_token=True, global_pool="token")
    lay = structinit.infer_layout(cls)
    assert lay.grid == (6, 6) and lay.num_prefix_tokens == 1 and lay.num_patches == 36


def test_layout_patch_embed_wins_over_pos_embed_shape():
    model = SepViT(img=(8, 12))  # grid 4×6 from patch_embed, pos_embed has 24 rows
    assert structinit.infer_layout(model).grid == (4, 6)


@settings(max_examples=20, deadline=None)
@given(side=st.integers(1, 12), cls=st.booleans(), reg=st.integers(0, 3), no_embed_class=st.booleans())
def test_layout_from_square_pos_embed(side, cls, reg, no_embed_class):
    prefix = int(cls) + reg
    rows = side * side + (0 if no_embed_class else prefix)
    model = PosOnly(rows, cls=cls, reg=reg, no_embed_class=no_embed_class)
    lay = structinit.infer_layout(model)
    assert lay.grid == (side, side)
    assert lay.num_prefix_tokens == prefix


def test_explicit_grid_and_prefix_win_where_the_model_agrees():
    model = structinit.create_model("vit_micro_patch2_16")
    assert structinit.infer_layout(model, grid=(4, 16)).grid == (4, 16)
    assert structinit.infer_layout(model, num_prefix_tokens=0).num_prefix_tokens == 0
    assert structinit.infer_layout(PosOnly(24), grid=(4, 6)).grid == (4, 6)
    # A hand-written model whose class token has another name: the PE's extra row agrees.
    assert structinit.infer_layout(PosOnly(25), grid=(4, 6), num_prefix_tokens=1).num_prefix_tokens == 1


def test_prefix_count_that_contradicts_the_model_raises():
    model = structinit.create_model("vit_micro_patch2_16")  # no class token, 64-row PE
    with pytest.raises(ValueError, match=r"num_prefix_tokens=2, but VisionTransformer has 0 prefix"):
        structinit.infer_layout(model, num_prefix_tokens=2)
    cls = structinit.create_model("vit_micro_patch2_16", class_token=True, global_pool="token")
    with pytest.raises(ValueError, match=r"num_prefix_tokens=0, .* has 1 prefix token\(s\) \(parameters: cls_token\)"):
        structinit.infer_layout(cls, num_prefix_tokens=0)


def test_more_prefix_tokens_than_the_parameters_found_by_name_are_taken_from_the_caller():
    """A hand-written model's class token is found by its name; tokens under other names (here
    2 registers named ``memory``) are not, so a larger count the caller gives is taken, and a
    smaller one, which the named parameters contradict, is refused."""
    model = PosOnly(16, cls=True)
    model.memory = nn.Parameter(torch.zeros(1, 2, 8))
    assert structinit.infer_layout(model, num_prefix_tokens=3) == structinit.TokenLayout((4, 4), 3)
    with pytest.raises(ValueError, match=r"num_prefix_tokens=0, but PosOnly has 1 prefix token\(s\) \(parameters: "
                                         r"cls_token\); omit num_prefix_tokens= or pass 1 or more"):
        structinit.infer_layout(model, num_prefix_tokens=0)


def test_prefix_tokens_the_model_shows_no_sign_of_raise():
    # 64 PE rows = the 8×8 grid, no prefix parameter: five prefix tokens cannot come from anywhere.
    with pytest.raises(ValueError, match=r"num_prefix_tokens=5, but the model has no prefix-token .*64 rows"):
        structinit.infer_layout(PosOnly(64), num_prefix_tokens=5)


def test_registers_without_position_rows_leave_the_grid_rows_last():
    """A class token with a row and 4 registers without (Hugging Face's DINOv2 with registers):
    65 rows for 1 + 4 prefix tokens and an 8×8 grid; the grid rows are the last 64."""
    model = PosOnly(65, cls=True, reg=4)
    layout = structinit.infer_layout(model, grid=(8, 8))
    assert layout == structinit.TokenLayout((8, 8), 5)
    from structinit.adapters.layout import grid_pos_embed, prefix_pos_rows

    assert grid_pos_embed(model, layout).data_ptr() == model.pos_embed[0, 1:].data_ptr()
    assert prefix_pos_rows(model, layout)[1].shape == (1, 8)


@pytest.mark.parametrize("rows", [63, 66, 70])
def test_pe_rows_must_be_grid_or_grid_plus_prefix(rows):
    with pytest.raises(ValueError, match=rf"has {rows} rows, but a 8×8 grid with 1 prefix token\(s\) needs 64 to 65"):
        structinit.infer_layout(PosOnly(rows, cls=True), grid=(8, 8))


@settings(max_examples=20, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9))
def test_non_square_pos_embed_without_grid_raises(h, w):
    n = h * w
    if math.isqrt(n) ** 2 == n:
        n += 1  # make it non-square
    with pytest.raises(ValueError, match=r"grid=") as info:
        structinit.infer_layout(PosOnly(n))
    assert "PosOnly" in str(info.value)


def test_no_pos_embed_no_patch_embed_raises():
    with pytest.raises(ValueError, match=r"grid="):
        structinit.infer_layout(nn.Linear(3, 3))


@pytest.mark.parametrize("grid", [(0, 4), (4, -1), (4,), (1, 2, 3)])
def test_invalid_explicit_grid_raises(grid):
    with pytest.raises(ValueError, match=r"grid="):
        structinit.infer_layout(nn.Linear(3, 3), grid=grid)


@pytest.mark.parametrize("grid", [(4.5, 4), (4, 3.9)])
def test_non_integer_explicit_grid_is_rejected_not_truncated(grid):
    """The message promises 'two positive ints'; a float grid must not be silently truncated."""
    with pytest.raises((TypeError, ValueError), match=r"grid="):
        structinit.infer_layout(nn.Linear(3, 3), grid=grid)
