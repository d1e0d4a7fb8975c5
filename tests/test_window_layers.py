"""Attention layers that a name adapter claims but that take (B, H, W, D) image maps: those that
cut, pad and shift their own windows (torchvision's Swin) are judged on the tokens their q
projection receives and the output their output projection returns; those whose maps cannot be
compared are refused before any write; a map as large as the grid (SAM's ViT) is checked on the
grid's own rows. Each test reads the layer's own softmax in its forward."""

import pytest
import torch
from attention_styles import StyledViT
from torch import nn

import structinit
from rejection import check_rejected


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
