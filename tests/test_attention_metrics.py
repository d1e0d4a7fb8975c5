"""Where attention looks: mean attention distance, entropy and local mass, exact on hand-built
maps, bounded on random ones, blind to prefix tokens, and reduced over a real model."""

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from structinit.analysis import metrics
from structinit.functional.targets import target_index


def reflected_shift(grid, offset, dtype=torch.float64):
    """(N, N) one-hot map: token (y, x) → (y+dy, x+dx), reflected to (y−dy, x−dx) per axis
    where that leaves the grid, so every row sits exactly at distance |offset|."""
    h, w = grid
    out = torch.zeros(h * w, h * w, dtype=dtype)
    for y in range(h):
        for x in range(w):
            ty = y + offset[0] if 0 <= y + offset[0] < h else y - offset[0]
            tx = x + offset[1] if 0 <= x + offset[1] < w else x - offset[1]
            out[y * w + x, ty * w + tx] = 1
    return out


def random_probs(seed, lead, heads, tokens, sharpness=3.0):
    g = torch.Generator().manual_seed(seed)
    return (sharpness * torch.randn(*lead, heads, tokens, tokens, generator=g, dtype=torch.float64)).softmax(-1)


def with_prefix(grid_probs, prefix, seed):
    """Embed (H, N, N) grid maps in (H, P+N, P+N): prefix rows arbitrary, and each grid row
    gives an arbitrary share of its mass to the prefix keys."""
    g = torch.Generator().manual_seed(seed)
    heads, n, _ = grid_probs.shape
    t = prefix + n
    out = torch.rand(heads, t, t, generator=g, dtype=torch.float64)
    out = out / out.sum(-1, keepdim=True)
    share = torch.rand(heads, n, 1, generator=g, dtype=torch.float64)  # mass left on the grid
    out[:, prefix:, prefix:] = share * grid_probs
    out[:, prefix:, :prefix] *= (1 - share) / out[:, prefix:, :prefix].sum(-1, keepdim=True)
    return out


# ------------------------------------------------------------------------------- exact values
def test_uniform_on_a_2x2_grid():
    probs = torch.full((2, 3, 4, 4), 0.25, dtype=torch.float64)
    torch.testing.assert_close(structinit.mean_attention_distance(probs, (2, 2)),
                               torch.full((2, 3), (2 + math.sqrt(2)) / 4, dtype=torch.float64))
    torch.testing.assert_close(structinit.attention_entropy(probs),
                               torch.full((2, 3), math.log(4), dtype=torch.float64))
    # 3×3 window around any token of a 2×2 grid covers the whole grid
    torch.testing.assert_close(structinit.local_attention_mass(probs, (2, 2)), torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(structinit.local_attention_mass(probs, (2, 2), kernel_size=1),
                               torch.full((2, 3), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("grid", [(5, 5), (4, 7)])
def test_uniform_entropy_is_log_n(grid):
    n = grid[0] * grid[1]
    probs = torch.full((1, n, n), 1 / n, dtype=torch.float64)
    torch.testing.assert_close(structinit.attention_entropy(probs), torch.tensor([math.log(n)], dtype=torch.float64))


@pytest.mark.parametrize("offset", [(0, 0), (1, 0), (0, -1), (1, 1), (-1, 1), (2, 0), (-2, 1), (2, -2), (0, 3)])
def test_one_hot_shift(offset):
    grid = (5, 6)
    probs = torch.stack([reflected_shift(grid, offset), reflected_shift(grid, (0, 0))])  # heads: shift, identity
    inside = max(map(abs, offset)) <= 1
    d = structinit.mean_attention_distance(probs, grid)
    torch.testing.assert_close(d, torch.tensor([math.hypot(*offset), 0.0], dtype=torch.float64))
    torch.testing.assert_close(structinit.attention_entropy(probs), torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(structinit.local_attention_mass(probs, grid, kernel_size=3),
                               torch.tensor([float(inside), 1.0], dtype=torch.float64))
    torch.testing.assert_close(structinit.local_attention_mass(probs, grid, kernel_size=5),
                               torch.tensor([float(max(map(abs, offset)) <= 2), 1.0], dtype=torch.float64))
    # pixels: each axis scaled by its patch side
    px = structinit.mean_attention_distance(probs, grid, patch_size=(4, 2))
    torch.testing.assert_close(px[0], torch.tensor(math.hypot(4 * offset[0], 2 * offset[1]), dtype=torch.float64))


def test_rows_without_grid_mass_are_left_out():
    """impulse_matrix has all-zero rows where the target leaves the grid: they are not scored,
    and a head with no scored row is NaN."""
    grid, offset = (4, 4), (1, -1)
    probs = torch.stack([structinit.impulse_matrix(grid, offset), torch.zeros(16, 16)])
    d = structinit.mean_attention_distance(probs, grid)
    assert d[0].item() == pytest.approx(math.sqrt(2)) and math.isnan(d[1].item())
    assert structinit.local_attention_mass(probs, grid)[0].item() == 1.0
    assert structinit.attention_entropy(probs)[0].item() == 0.0


def test_entropy_with_prefix_rows_scores_the_full_rows():
    probs = random_probs(0, (), 2, 1 + 9)
    full = -(probs * probs.log()).sum(-1).mean(-1)
    torch.testing.assert_close(structinit.attention_entropy(probs, 1, include_prefix=True), full)
    grid_only = probs[:, 1:, 1:] / probs[:, 1:, 1:].sum(-1, keepdim=True)
    torch.testing.assert_close(structinit.attention_entropy(probs, 1),
                               -(grid_only * grid_only.log()).sum(-1).mean(-1))


# ------------------------------------------------------------------------------- properties
@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 5), w=st.integers(1, 5), heads=st.integers(1, 3), batch=st.integers(0, 2),
       prefix=st.integers(0, 2), k=st.sampled_from([1, 3, 5]), sharp=st.floats(0.0, 20.0), seed=st.integers(0, 99))
def test_metrics_are_bounded(h, w, heads, batch, prefix, k, sharp, seed):
    lead = (2,) * batch
    n = h * w
    probs = random_probs(seed, lead, heads, prefix + n, sharp)
    d = structinit.mean_attention_distance(probs, (h, w), prefix)
    ent = structinit.attention_entropy(probs, prefix)
    local = structinit.local_attention_mass(probs, (h, w), k, prefix)
    for out in (d, ent, local):
        assert out.shape == (*lead, heads) and torch.isfinite(out).all()
    assert (d >= 0).all() and (d <= math.hypot(h - 1, w - 1) + 1e-9).all()
    assert (ent >= -1e-12).all() and (ent <= math.log(n) + 1e-9).all()
    assert (local >= 0).all() and (local <= 1 + 1e-12).all()
    ent_all = structinit.attention_entropy(probs, prefix, include_prefix=True)
    assert (ent_all <= math.log(prefix + n) + 1e-9).all()


@settings(max_examples=30, deadline=None)
@given(h=st.integers(1, 4), w=st.integers(1, 4), heads=st.integers(1, 3), prefix=st.integers(1, 3),
       seed=st.integers(0, 99))
def test_prefix_tokens_do_not_change_grid_metrics(h, w, heads, prefix, seed):
    grid_probs = random_probs(seed, (), heads, h * w)
    probs = with_prefix(grid_probs, prefix, seed)
    torch.testing.assert_close(probs.sum(-1), torch.ones(heads, prefix + h * w, dtype=torch.float64))
    for fn, args in ((structinit.mean_attention_distance, ((h, w),)), (structinit.attention_entropy, ()),
                     (structinit.local_attention_mass, ((h, w), 3))):
        torch.testing.assert_close(fn(probs, *args, num_prefix_tokens=prefix), fn(grid_probs, *args))


def test_float32_maps_give_float32_metrics():
    probs = random_probs(0, (2,), 2, 16).float()
    assert structinit.mean_attention_distance(probs, (4, 4)).dtype == torch.float32


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call, match", [
    (lambda: structinit.mean_attention_distance(torch.ones(4, 4), (2, 2)),
     r"probs: expected .*\(\.\.\., heads, T, T\)"),
    (lambda: structinit.mean_attention_distance(torch.ones(1, 4, 5), (2, 2)), r"probs: expected"),
    (lambda: structinit.mean_attention_distance([[0.5]], (1, 1)), r"probs: expected"),
    (lambda: structinit.mean_attention_distance(torch.ones(1, 4, 4, dtype=torch.long), (2, 2)), r"probs: expected"),
    (lambda: structinit.mean_attention_distance(torch.ones(1, 5, 5), (2, 2)),
     r"T=5 tokens, but num_prefix_tokens=0 \+ grid 2×2 = 4"),
    (lambda: structinit.mean_attention_distance(torch.ones(1, 4, 4), (2, 0)), r"grid=\(2, 0\): expected a positive"),
    (lambda: structinit.mean_attention_distance(torch.ones(1, 4, 4), (2, 2), patch_size=-1), r"patch_size=-1"),
    (lambda: structinit.mean_attention_distance(torch.full((1, 4, 4), float("nan")), (2, 2)), r"NaN/Inf"),
    (lambda: structinit.attention_entropy(torch.ones(1, 4, 4), num_prefix_tokens=4), r"num_prefix_tokens=4, but"),
    (lambda: structinit.attention_entropy(torch.ones(1, 4, 4), num_prefix_tokens=-1), r"num_prefix_tokens=-1"),
    (lambda: structinit.local_attention_mass(torch.ones(1, 4, 4), (2, 2), kernel_size=2), r"kernel_size=2: .*odd"),
    (lambda: structinit.local_attention_mass(torch.ones(1, 4, 4), (2, 2), kernel_size=0), r"kernel_size=0"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------------------------- a real model
@pytest.fixture(scope="module")
def images():
    return torch.randn(24, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def micro(init=None, **options):
    torch.manual_seed(0)
    model = structinit.create_model("vit_micro_patch2_16")
    if init is not None:
        structinit.init_(model, init, seed=0, **options)
    return model


def test_model_metrics_equal_the_tensor_functions_on_attention_maps(images):
    model = micro("impulse")
    out = structinit.attention_metrics(model, images, batch_size=5)  # 5 batches, the last one short
    maps = structinit.attention_maps(model, images)
    for i, probs in enumerate(maps):
        torch.testing.assert_close(out["distance"][i], structinit.mean_attention_distance(probs, (8, 8)).mean(0))
        torch.testing.assert_close(out["distance_px"][i], 2 * out["distance"][i])  # patch 2 read from the model
        torch.testing.assert_close(out["entropy"][i], structinit.attention_entropy(probs).mean(0))
        torch.testing.assert_close(out["local_mass"][i], structinit.local_attention_mass(probs, (8, 8)).mean(0))
    assert all(v.shape == (2, 2) and v.dtype == torch.float32 for v in out.values())
    one = structinit.attention_metrics(model, images, layers=[-1], kernel_size=5, patch_size=(3, 3))
    assert one["local_mass"].shape == (1, 2) and (one["local_mass"] >= out["local_mass"][1]).all()
    torch.testing.assert_close(one["distance_px"], 3 * out["distance"][1:])


@pytest.mark.parametrize("size, spans", [(32, [2, 2, 4, 4, 8, 8]), (28, [2, 2, 4, 4, 8, 8])])
def test_window_layers_count_the_pixels_their_merged_tokens_span(size, spans):
    """Swin at 32 px: 16×16 → 8×8 → 4×4 maps, patch 2, so a token spans 2, 4, 8 pixels. At 28 px
    the 14×14 and 7×7 maps are computed in padded whole windows (16×16, 8×8): the span is the same."""
    torch.manual_seed(0)
    model = structinit.create_model("swin_cpu_patch2_32", img_size=size, in_chans=1)
    structinit.init_(model, "impulse", seed=0)
    out = structinit.attention_metrics(model, torch.randn(3, 1, size, size))
    for i, span in enumerate(spans):
        torch.testing.assert_close(out["distance_px"][i], span * out["distance"][i], equal_nan=True)
    assert out["distance"][:, :2].isfinite().all()  # every layer has at least 2 heads with grid rows


def test_impulse_init_is_more_local_than_the_pytorch_default(images):
    base = structinit.attention_metrics(micro("pytorch"), images)
    sharp = structinit.attention_metrics(micro("impulse", target_mass=0.99, pe_scale=4.0), images)
    assert (sharp["local_mass"] > base["local_mass"] + 0.3).all()
    assert (sharp["entropy"] < base["entropy"] - 1.0).all()
    assert (sharp["distance"] < base["distance"]).all()
    # Near-uniform default maps on an 8×8 grid: local mass near (mean window size)/64.
    assert (base["local_mass"] < 0.3).all()


def test_centre_impulse_stays_put(images):
    """Every head targets its own token, so no row loses its target at the border."""
    model = micro("impulse", offsets=[(0, 0), (0, 0)], target_mass=0.99, pe_scale=4.0)
    out = structinit.attention_metrics(model, images, layers=[0])
    assert (out["local_mass"] > 0.97).all() and (out["distance"] < 0.1).all() and (out["entropy"] < 0.3).all()


def test_shifted_impulse_distance_is_near_the_offset_length(images):
    """Rows whose target is inside the grid look exactly |offset| away; rows at the border whose
    target leaves the grid spread their mass, so compare over the interior only."""
    model = micro("impulse", offsets=[(0, 1), (1, 1)], target_mass=0.99, pe_scale=4.0)
    probs = structinit.attention_maps(model, images, layers=[0])[0]
    for h, offset in enumerate([(0, 1), (1, 1)]):
        rows = torch.nonzero(target_index((8, 8), offset) >= 0).squeeze(1)
        p, _ = metrics._grid_rows(probs[:, h : h + 1], 0)
        d = metrics._row_distance(p, (8, 8))[:, 0, rows].mean()
        assert d.item() == pytest.approx(math.hypot(*offset), abs=0.1)


def test_training_mode_is_restored(images):
    model = micro("impulse")
    model.train()
    structinit.attention_metrics(model, images[:4])
    assert model.training


class MHAModel(nn.Module):
    """Tokens in, one nn.MultiheadAttention: no patch embedding, so no patch size."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def test_model_without_patch_embedding_has_no_pixel_distance():
    tokens = torch.randn(3, 9, 16)
    out = structinit.attention_metrics(MHAModel(), tokens, grid=(3, 3))
    assert sorted(out) == ["distance", "entropy", "local_mass"]
    assert "distance_px" in structinit.attention_metrics(MHAModel(), tokens, grid=(3, 3), patch_size=8)


def test_model_level_errors(images):
    with pytest.raises(ValueError, match=r"layers contains 2, but the model has 2 attention layers"):
        structinit.attention_metrics(micro(), images, layers=[2])
    with pytest.raises(ValueError, match=r"received 9 tokens, but the layout has 0 prefix \+ 16 grid"):
        structinit.attention_metrics(MHAModel(), torch.randn(2, 9, 16), grid=(4, 4))
    with pytest.raises(ValueError, match=r"grid=\(4, 8\), but the impulse init recorded grid=\(8, 8\)"):
        structinit.attention_metrics(micro("impulse"), images, grid=(4, 8))
    with pytest.raises(ValueError, match=r"batch_size=0"):
        structinit.attention_metrics(micro(), images, batch_size=0)
    with pytest.raises(ValueError, match=r"kernel_size=4"):
        structinit.attention_metrics(micro(), images, kernel_size=4)
    with pytest.raises(ValueError, match=r"images=.*at least one image"):
        structinit.attention_metrics(micro(), images[:0])


def test_hugging_face_patch_size_and_class_token():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_attention_heads=2,
                                    num_hidden_layers=1, intermediate_size=64)
    model = transformers.ViTModel(config, add_pooling_layer=False)
    assert metrics._model_patch_size(model) == (4, 4)
    out = structinit.attention_metrics(model, torch.randn(4, 3, 16, 16))  # 1 class token + 4×4 grid
    torch.testing.assert_close(out["distance_px"], 4 * out["distance"])


def test_docstring_examples_run():
    result = doctest.testmod(metrics, extraglobs={"structinit": structinit, "torch": torch},
                             optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
