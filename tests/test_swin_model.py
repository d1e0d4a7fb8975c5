"""structinit's Swin Transformer: the CPU entry point's size, window partition, the shifted-window
mask and relative position index against brute-force recomputations, a block's attention against
a dense recomputation over the whole map, seeded determinism, and that it trains."""

from __future__ import annotations

import math

import pytest
import torch

import structinit
from structinit.models import SwinTransformer, SwinTransformerBlock
from structinit.models.swin import MASK_LOGIT, shifted_window_mask, window_partition, window_reverse


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tiny(**kw) -> SwinTransformer:
    return SwinTransformer(**{"img_size": 16, "patch_size": 2, "embed_dim": 16, "depths": (2, 2),
                              "num_heads": (1, 2), "window_size": 4, "mlp_ratio": 2.0, "num_classes": 10, **kw})


def test_output_shape_and_data_sizes():
    model = structinit.create_model("swin_cpu_patch2_32")
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # 28×28 images: 14×14 and 7×7 maps, windows padded to whole ones
    mnist = structinit.create_model("swin_cpu_patch2_32", num_classes=7, in_chans=1, img_size=28)
    assert mnist(torch.randn(2, 1, 28, 28)).shape == (2, 7)
    assert [s.output_resolution for s in mnist.layers] == [(14, 14), (7, 7), (4, 4)]
    assert structinit.create_model("swin_cpu_patch2_32", num_classes=0)(torch.randn(1, 3, 32, 32)).shape == (1, 192)


def test_cpu_swin_size_and_windows():
    model = structinit.create_model("swin_cpu_patch2_32")
    assert n_params(model) == 879_254
    assert 0.5 < n_params(model) / n_params(structinit.create_model("vit_cpu_patch4_32")) < 1.5
    blocks = [b for stage in model.layers for b in stage.blocks]
    assert [b.shift_size for b in blocks] == [(0, 0), (2, 2), (0, 0), (2, 2), (0, 0), (0, 0)]  # last map = one window
    assert [b.attn.num_heads for b in blocks] == [2, 2, 4, 4, 8, 8] and {b.attn.head_dim for b in blocks} == {24}
    assert [None if b.attn_mask is None else tuple(b.attn_mask.shape) for b in blocks] == [
        None, (16, 16, 16), None, (4, 16, 16), None, None]
    assert model.no_weight_decay() == {f"layers.{i}.blocks.{j}.attn.relative_position_bias_table"
                                       for i in range(3) for j in range(2)}
    assert not any(k.endswith(("relative_position_index", "attn_mask")) for k in model.state_dict())


def test_window_partition_round_trip():
    x = torch.randn(2, 8, 12, 5)
    windows = window_partition(x, (4, 3))
    assert windows.shape == (2 * 2 * 4, 4, 3, 5)
    torch.testing.assert_close(windows[4 + 1], x[0, 4:8, 3:6], rtol=0, atol=0)  # image 0, window row 1, column 1
    assert torch.equal(window_reverse(windows, (4, 3), 8, 12), x)


def region_labels(size: int, window: int, shift: int) -> torch.Tensor:
    """Band of each row (or column) of the rolled map: the part that did not wrap, the last
    window's part that did not, and the wrapped part."""
    i = torch.arange(size)
    return torch.where(i < size - window, 0, torch.where(i < size - shift, 1, 2))


@pytest.mark.parametrize("resolution, window, shift", [((8, 8), (4, 4), (2, 2)), ((12, 8), (4, 4), (1, 3)),
                                                       ((6, 9), (3, 3), (1, 1))])
def test_shifted_window_mask_is_zero_within_a_region_and_minus_100_across(resolution, window, shift):
    mask = shifted_window_mask(resolution, window, shift)
    (h, w), (wh, ww) = resolution, window
    rows, cols = region_labels(h, wh, shift[0]), region_labels(w, ww, shift[1])
    n_cols = w // ww
    assert mask.shape == ((h // wh) * n_cols, wh * ww, wh * ww)
    for win in range(mask.shape[0]):
        top, left = (win // n_cols) * wh, (win % n_cols) * ww
        for i in range(wh * ww):
            for j in range(wh * ww):
                (yi, xi), (yj, xj) = divmod(i, ww), divmod(j, ww)
                same = bool(rows[top + yi] == rows[top + yj]) and bool(cols[left + xi] == cols[left + xj])
                assert float(mask[win, i, j]) == (0.0 if same else MASK_LOGIT)
    assert shifted_window_mask(resolution, window, (0, 0)) is None


def test_relative_position_index_is_the_offset_of_every_pair():
    attn = SwinTransformerBlock(8, (6, 10), 2, window_size=(3, 5)).attn
    index = attn.relative_position_index
    assert index.dtype == torch.long and index.shape == (15, 15)
    assert attn.relative_position_bias_table.shape == ((2 * 3 - 1) * (2 * 5 - 1), 2)
    for i in range(15):
        for j in range(15):
            (yi, xi), (yj, xj) = divmod(i, 5), divmod(j, 5)
            assert int(index[i, j]) == (yi - yj + 2) * 9 + (xi - xj + 4)


def dense_attention(block: SwinTransformerBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's attention branch over the whole (B, H, W, D) map at once: query p and key q
    interact iff they fall in the same window of the rolled map; the logit adds the bias of
    their offset inside that window and −100 if they come from different regions."""
    b, h, w, d = x.shape
    (wh, ww), (sh, sw), attn = block.window_size, block.shift_size, block.attn
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ys, xs = (ys.flatten() - sh) % h, (xs.flatten() - sw) % w  # coordinates on the rolled map
    same_window = (ys[:, None] // wh == ys[None] // wh) & (xs[:, None] // ww == xs[None] // ww)
    rows, cols = region_labels(h, wh, sh) if sh else torch.zeros(h), region_labels(w, ww, sw) if sw else torch.zeros(w)
    same_region = (rows[ys][:, None] == rows[ys][None]) & (cols[xs][:, None] == cols[xs][None])
    row = (ys[:, None] % wh - ys[None] % wh + wh - 1) * (2 * ww - 1) + (xs[:, None] % ww - xs[None] % ww + ww - 1)
    bias = attn.relative_position_bias_table[row].permute(2, 0, 1)  # (heads, HW, HW)
    tokens = block.norm1(x).reshape(b, h * w, d)
    q, k, v = attn.qkv(tokens).reshape(b, h * w, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    logits = q @ k.transpose(-2, -1) * attn.head_dim ** -0.5 + bias + MASK_LOGIT * (~same_region)
    probs = logits.masked_fill(~same_window, float("-inf")).softmax(-1)
    return attn.proj((probs @ v).transpose(1, 2).reshape(b, h * w, d)).reshape(b, h, w, d)


@pytest.mark.parametrize("shift", [0, 2])
def test_block_attention_equals_a_dense_recomputation(shift):
    torch.manual_seed(0)
    block = SwinTransformerBlock(12, (8, 8), 3, window_size=4, shift_size=shift).double()
    with torch.no_grad():
        block.attn.relative_position_bias_table.normal_()  # a bias large enough to matter
        block.mlp.fc2.weight.zero_(), block.mlp.fc2.bias.zero_()  # the block is then x + attention(norm1(x))
        x = torch.randn(2, 8, 8, 12, dtype=torch.float64)
        torch.testing.assert_close(block(x), x + dense_attention(block, x), rtol=1e-10, atol=1e-10)


def test_same_seed_same_weights():
    def build():
        torch.manual_seed(3)
        return structinit.create_model("swin_cpu_patch2_32").state_dict()

    a, b = build(), build()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(4)
    other = structinit.create_model("swin_cpu_patch2_32").state_dict()
    assert not torch.equal(a["layers.0.blocks.0.attn.qkv.weight"], other["layers.0.blocks.0.attn.qkv.weight"])


def test_init_is_timms():
    torch.manual_seed(0)
    model = structinit.create_model("swin_cpu_patch2_32")
    attn = model.layers[2].blocks[0].attn
    qkv, table = attn.qkv.weight.detach(), attn.relative_position_bias_table.detach()
    assert abs(float(qkv.std()) - 0.02) < 0.002 and float(qkv.abs().max()) <= 2.0
    assert not attn.qkv.bias.any() and abs(float(table.std()) - 0.02) < 0.004
    assert torch.equal(model.norm.weight, torch.ones(192)) and not model.layers[1].downsample.norm.bias.any()


def test_it_trains():
    torch.manual_seed(0)
    model = tiny()
    x, y = torch.randn(16, 3, 16, 16), torch.randint(10, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_heads"):
        tiny(num_heads=(1,))
    with pytest.raises(ValueError, match="dim=16 is not divisible by num_heads=3"):
        tiny(num_heads=(3, 2))
    with pytest.raises(ValueError, match="shift_size"):
        SwinTransformerBlock(8, (8, 8), 2, window_size=4, shift_size=4)


def test_weight_init_chooses_what_a_structured_init_is_added_to():
    torch.manual_seed(0)
    timm_like = structinit.create_model("swin_cpu_patch2_32")
    torch.manual_seed(0)
    plain = structinit.create_model("swin_cpu_patch2_32", weight_init="pytorch")
    for (name, a), b in zip(timm_like.named_modules(), plain.modules()):
        if isinstance(a, torch.nn.Linear):
            bound = 1 / math.sqrt(a.in_features)  # PyTorch's Linear: U(−1/√fan_in, 1/√fan_in)
            assert 0.015 < a.weight.std() < 0.025, name  # trunc-normal 0.02
            assert b.weight.abs().max() <= bound and b.weight.std() > 0.8 * bound / math.sqrt(3), name
    tables = [m.relative_position_bias_table for m in plain.modules() if hasattr(m, "relative_position_bias_table")]
    assert tables and all(0.01 < t.std() < 0.03 for t in tables)
    structinit.init_(plain, "impulse", seed=0)  # impulse keeps the PyTorch-default q/k/v and MLPs
    assert plain.layers[0].blocks[0].mlp.fc1.weight.std() > 0.05
    with pytest.raises(ValueError, match="weight_init='jax'"):
        structinit.create_model("swin_cpu_patch2_32", weight_init="jax")


@pytest.mark.parametrize("scheme", ["pytorch", "timm"])
def test_a_baseline_gives_the_same_model_whichever_way_it_was_built(scheme):
    """pytorch and timm rewrite every weight from their own seed: runs of a Swin built with
    weight_init='pytorch' can take their baselines from the default Swin's runs."""
    states = []
    for weight_init in ("timm", "pytorch"):
        torch.manual_seed(0)
        model = structinit.create_model("swin_cpu_patch2_32", weight_init=weight_init)
        states.append(structinit.init_(model, scheme, seed=0).state_dict())
    assert states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])
