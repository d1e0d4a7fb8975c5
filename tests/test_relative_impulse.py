"""Impulse on attention with a relative position bias: Swin's (shifted) window attention and a
BEiT-style layer with class-token rows. The claim: each head's table holds β at the row of
its offset and 0 elsewhere, so softmax(bias) puts exactly ``target_mass`` on the target of
every query whose target is in its window, and the argmax stays there on real images."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from real_images import digit_images
from rejection import check_rejected
from structinit.adapters.relative import call_logit_terms, find_relative_bias
from structinit.analysis.capture import attention_maps
from structinit.functional.relative import offset_row, relative_position_index
from structinit.functional.targets import target_index


def swin(**kw):
    torch.manual_seed(0)
    return structinit.create_model("swin_cpu_patch2_32", **kw)


def images(n=8, size=32):
    return digit_images(n, size)


class BeitLikeAttention(nn.Module):
    """BEiT's layout: a class token first, its pairs on three extra table rows, q/v biases kept
    apart from the qkv Linear (timm's ``beit.Attention``, rebuilt here without timm)."""

    def __init__(self, dim=32, num_heads=2, window=(4, 4)):
        super().__init__()
        self.num_heads, self.scale, self.window_size = num_heads, (dim // num_heads) ** -0.5, window
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.proj = nn.Linear(dim, dim)
        rows = (2 * window[0] - 1) * (2 * window[1] - 1)
        self.relative_position_bias_table = nn.Parameter(torch.randn(rows + 3, num_heads) * 0.02)
        n = window[0] * window[1]
        index = torch.zeros(n + 1, n + 1, dtype=torch.long)
        index[1:, 1:] = relative_position_index(*window)
        index[0, :], index[:, 0], index[0, 0] = rows, rows + 1, rows + 2
        self.register_buffer("relative_position_index", index, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        qkv = nn.functional.linear(x, self.qkv.weight, torch.cat([self.q_bias, self.k_bias, self.v_bias]))
        q, k, v = qkv.reshape(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        bias = self.relative_position_bias_table[self.relative_position_index].permute(2, 0, 1)
        attn = ((q * self.scale) @ k.transpose(-2, -1) + bias).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class BeitLike(nn.Module):
    def __init__(self, depth=2, **kw):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": BeitLikeAttention(**kw)}) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block["attn"](x)
        return x


def softmax_rows(model):
    """Per attention layer: (adapter, softmax of the bias alone (heads, T, T), record)."""
    out = []
    for _, ad in structinit.find_attention_layers(model):
        out.append((ad, ad.relative.bias().detach().softmax(-1), structinit.get_record(ad.module)))
    return out


def check_impulse_tables(model, target_mass):
    for ad, probs, record in softmax_rows(model):
        rb, p = ad.relative, ad.relative.num_prefix_tokens
        assert record["grid"] == rb.grid and record["solver"] == "relative"
        for h, offset in enumerate(record["offsets"]):
            column = rb.table[:, h].detach()
            row = rb.row_of(offset)
            assert column[row] == pytest.approx(record["logit"])
            assert torch.count_nonzero(column) == 1  # β at the offset, 0 everywhere else (class rows too)
            t = target_index(rb.grid, offset)
            inside = torch.nonzero(t >= 0).squeeze(1)
            torch.testing.assert_close(probs[h, inside + p, t[inside] + p],
                                       torch.full((len(inside),), target_mass), atol=1e-6, rtol=0)
            outside = torch.nonzero(t < 0).squeeze(1)  # no key to raise: the row stays uniform
            uniform = torch.full_like(probs[h, outside + p], 1 / probs.shape[-1])
            torch.testing.assert_close(probs[h, outside + p], uniform)


def test_swin_tables_hold_the_impulse_and_softmax_gives_the_target_mass():
    model = swin()
    structinit.init_(model, "impulse", seed=0)
    check_impulse_tables(model, 0.5)
    fid = structinit.impulse_fidelity(model)  # content-free: the bias alone, in the model's own forward
    assert torch.equal(fid["hit"][~fid["hit"].isnan()], torch.ones(int((~fid["hit"].isnan()).sum())))
    # the target's mass is the design's 0.5 where a window sees all its keys; where the shifted
    # windows' mask removes keys (blocks 1 and 3, whose windows are smaller than the grid), more
    unshifted, shifted = fid["mass"][[0, 2, 4, 5]], fid["mass"][[1, 3]]
    torch.testing.assert_close(unshifted[~unshifted.isnan()], torch.full((int((~unshifted.isnan()).sum()),), 0.5))
    assert (shifted[~shifted.isnan()] > 0.55).all()


def test_beit_layout_class_token_rows_stay_zero_and_count_as_keys():
    model = BeitLike()
    structinit.init_(model, "impulse", seed=3, target_mass=0.8)
    check_impulse_tables(model, 0.8)
    record = structinit.get_record(model.blocks[0]["attn"])
    assert record["num_prefix_tokens"] == 1
    assert record["logit"] == pytest.approx(math.log(0.8 * 16 / 0.2))  # 17 keys: 16 grid + the class token


@pytest.mark.parametrize("init", ["timm", "pytorch"])
def test_real_images_keep_the_argmax_on_target(init):
    model = swin()
    structinit.init_(model, init, seed=0)  # the content logits q·k come from this init
    structinit.init_(model, "impulse", seed=0)
    fid = structinit.impulse_fidelity(model, images())
    hit = fid["hit"].nanmean(1)
    assert hit[0] >= 0.95 and hit.mean() >= 0.90, hit


def test_captured_maps_reproduce_every_window_attention_output_with_the_shift_mask():
    """The maps the adapter computes (bias + the call's mask, tiled over images) are the ones the
    module uses: attn @ v through proj gives the module's own output, shifted blocks included."""
    model = swin().eval()
    structinit.init_(model, "impulse", seed=0)
    x = images(2)
    outputs, inputs = {}, {}
    layers = structinit.find_attention_layers(model)
    hooks = [ad.module.register_forward_hook(lambda m, a, kw, out, n=name: outputs.__setitem__(n, out),
                                             with_kwargs=True) for name, ad in layers]
    hooks += [ad.module.register_forward_pre_hook(lambda m, a, kw, n=name: inputs.__setitem__(n, a[0]),
                                                  with_kwargs=True) for name, ad in layers]
    maps = attention_maps(model, x)
    for h in hooks:
        h.remove()
    shifted = 0
    for (name, ad), probs in zip(layers, maps):
        block = model.get_submodule(name.rsplit(".", 1)[0])
        shifted += any(block.shift_size)
        v = ad.module.qkv(inputs[name]).reshape(*inputs[name].shape[:2], 3, ad.num_heads, -1)[:, :, 2].transpose(1, 2)
        out = ad.module.proj((probs @ v).transpose(1, 2).reshape(*inputs[name].shape[:2], -1))
        torch.testing.assert_close(out, outputs[name], atol=1e-5, rtol=1e-5)
    assert shifted == 2  # the first two stages each have a shifted block


def test_fidelity_skips_targets_the_shift_mask_removes():
    model = swin().eval()
    structinit.init_(model, "impulse", seed=0, offsets=[(0, 1)] * 2, layers=[1])  # block 1: shifted
    block = model.layers[0].blocks[1]
    mask = block.attn_mask  # (windows, 16, 16) of 0 / −100
    t = target_index((4, 4), (0, 1))
    rows = torch.nonzero(t >= 0).squeeze(1)
    open_targets = int((mask[:, rows, t[rows]] == 0).sum())
    assert open_targets < mask.shape[0] * len(rows)  # some targets sit across a seam
    fid = structinit.impulse_fidelity(model, images(1), layers=[1])
    # every open target has mass e^β / (e^β + keys open in its row − 1) up to content; none are masked ones
    assert fid["hit"][0, 0] >= 0.95 and fid["mass"][0, 0] > 0.45


def test_call_terms_tile_window_masks_over_images_and_pass_head_biases():
    mask = torch.randn(4, 5, 5)
    terms = call_logit_terms((None, mask), {}, batch=8, heads=2, tokens=5)
    assert terms.shape == (8, 1, 5, 5) and torch.equal(terms[5, 0], mask[1])
    shared = torch.randn(1, 2, 5, 5)
    assert torch.equal(call_logit_terms((None,), {"shared_rel_pos_bias": shared}, 3, 2, 5), shared)
    assert call_logit_terms((None,), {"mask": torch.randn(5, 6)}, 3, 2, 5) is None  # not (T, T)


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 6), w=st.integers(1, 6), dy=st.integers(-5, 5), dx=st.integers(-5, 5))
def test_row_of_reads_the_offset_row_from_the_index(h, w, dy, dx):
    attn = BeitLikeAttention(window=(h, w)) if h * w > 1 else None
    if attn is None:
        return
    rb = find_relative_bias(attn)
    if abs(dy) < h and abs(dx) < w and (h > 1 or w > 1):
        assert rb.row_of((dy, dx)) == offset_row((dy, dx), h, w)
    elif not (abs(dy) < h and abs(dx) < w):
        with pytest.raises(ValueError, match="outside the"):
            rb.row_of((dy, dx))


def test_an_index_without_one_row_per_offset_is_refused():
    attn = BeitLikeAttention()
    attn.relative_position_index[1:, 1:] = 5  # every grid pair on one row: no offset has a row of its own
    with pytest.raises(ValueError, match="one table row of its own"):
        find_relative_bias(attn).row_of((0, 1))


@pytest.mark.parametrize("options, match", [
    ({"solver": "gd"}, "solver='gd'"),
    ({"pe_scale": 2.0}, "pe_scale"),
    ({"grid": (4, 4)}, "grid="),
    ({"reserve": "patch"}, "reserve="),
    ({"kernel_size": 9, "offsets": [(4, 0)] * 2, "layers": [0]}, "outside the 4×4 window"),
    ({"offsets": [(0, 0), (1, 0)]}, r"has 4 heads; .*the chosen layers have 2, 4, 8 heads: init each group"),
])
def test_options_about_a_position_embedding_are_refused_and_nothing_is_written(options, match):
    check_rejected(swin(), lambda m: structinit.init_(m, "impulse", seed=0, **options), ValueError, match)


def test_a_stage_merged_to_one_token_takes_only_the_centre_tap():
    """At 8×8 pixels the last stage is one token in a 1×1 window: its map is the identity, so an
    off-centre offset there is refused, naming the layer and the fix, and nothing is written."""
    small = swin(img_size=8)
    assert [ad.relative.grid for _, ad in structinit.find_attention_layers(small)][-1] == (1, 1)
    check_rejected(small, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"layer 'layers\.2\.blocks\.0\.attn' attends within a 1×1 window.*leave the layer out with layers=")
    structinit.init_(small, "impulse", seed=0, layers=[0, 1, 2, 3])  # the first two stages
    assert structinit.get_record(small.layers[2].blocks[0].attn) is None
    structinit.init_(small, "impulse", seed=0, kernel_size=1)  # the centre tap fits every window
    last = small.layers[2].blocks[1].attn
    assert structinit.get_record(last)["logit"] == 0.0 and not last.relative_position_bias_table.any()
    assert structinit.impulse_fidelity(small)["hit"].nan_to_num(1.0).eq(1.0).all()


def test_explicit_offsets_go_stage_by_stage_where_head_counts_differ():
    model = swin()
    heads = [ad.num_heads for _, ad in structinit.find_attention_layers(model)]  # 2, 2, 4, 4, 8, 8
    stages = {h: [i for i, n in enumerate(heads) if n == h] for h in sorted(set(heads))}
    chosen = {h: [(0, 0), (1, 0), (0, 1), (-1, 0), (0, -1), (1, 1), (-1, -1), (1, -1)][:h] for h in stages}
    for h, layers in stages.items():
        structinit.init_(model, "impulse", offsets=chosen[h], layers=layers, seed=0)
    for (_, ad), h in zip(structinit.find_attention_layers(model), heads):
        assert [tuple(o) for o in structinit.get_record(ad.module)["offsets"]] == chosen[h]


def test_same_seed_same_tables_and_baselines_rewrite_the_tables():
    a, b = swin(), swin()
    structinit.init_(a, "impulse", seed=7)
    structinit.init_(b, "impulse", seed=7)
    for (_, ad_a), (_, ad_b) in zip(structinit.find_attention_layers(a), structinit.find_attention_layers(b)):
        assert torch.equal(ad_a.relative.table, ad_b.relative.table)
    for scheme in ("timm", "pytorch", "jax", "xavier"):
        structinit.init_(a, scheme, seed=1)
        tables = [ad.relative.table.detach() for _, ad in structinit.find_attention_layers(a)]
        # N(0, 0.02²) everywhere, no β left
        assert all(0.012 < t.std() < 0.03 and t.abs().max() < 0.12 for t in tables), scheme
        assert structinit.get_record(a.layers[0].blocks[0].attn) is None  # the impulse record went with it


def test_mimetic_on_swin_writes_qk_inside_windows():
    model = swin()
    structinit.init_(model, "mimetic", seed=0)
    ad = structinit.find_attention_layers(model)[0][1]
    wq, _, wk, _ = ad.read_qk()
    assert wq.shape == (2, 48, 24) and not torch.equal(wq, wk)


class BiasTable(nn.Module):
    """A relative bias held apart from the attention (Hugging Face's BEiT keeps one per layer
    beside it; timm's BEiT with a shared bias keeps one for the model), class token first."""

    def __init__(self, num_heads=2, window=(4, 4)):
        super().__init__()
        self.window_size = window
        template = BeitLikeAttention(num_heads=num_heads, window=window)
        self.relative_position_bias_table = nn.Parameter(template.relative_position_bias_table.detach().clone())
        self.register_buffer("relative_position_index", template.relative_position_index.clone(), persistent=False)

    def forward(self):
        return self.relative_position_bias_table[self.relative_position_index].permute(2, 0, 1)  # (H, T, T)


class HandedAttention(BeitLikeAttention):
    """BEiT's attention without a table of its own: the bias comes with the call."""

    def __init__(self, **kw):
        super().__init__(**kw)
        del self.relative_position_bias_table, self.relative_position_index

    def forward(self, x, relative_position_bias=None):
        b, t, d = x.shape
        qkv = nn.functional.linear(x, self.qkv.weight, torch.cat([self.q_bias, self.k_bias, self.v_bias]))
        q, k, v = qkv.reshape(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = ((q * self.scale) @ k.transpose(-2, -1) + relative_position_bias).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class HandedBias(nn.Module):
    def __init__(self, shared, depth=2):
        super().__init__()
        self.shared = BiasTable() if shared else None
        parts = lambda: {"attn": HandedAttention(), **({} if shared else {"rel": BiasTable()})}
        self.blocks = nn.ModuleList(nn.ModuleDict(parts()) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block["attn"](x, relative_position_bias=(self.shared or block["rel"])())
        return x


@pytest.mark.parametrize("shared", [False, True], ids=["beside each layer", "shared by the model"])
def test_a_bias_handed_to_the_layer_is_found_written_and_measured(shared):
    torch.manual_seed(0)
    model = HandedBias(shared).eval()
    structinit.init_(model, "impulse", seed=0, target_mass=0.7)
    tables = [model.shared] if shared else [b["rel"] for b in model.blocks]
    record = structinit.get_record(model.blocks[0]["attn"])
    for table in tables:  # β = log(0.7 · 16 / 0.3) at each head's offset row, 0 elsewhere
        assert torch.count_nonzero(table.relative_position_bias_table) == 2
    assert record["num_prefix_tokens"] == 1 and record["logit"] == pytest.approx(math.log(0.7 * 16 / 0.3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it takes tokens: probed with zero tokens, its own forward is read
        fid = structinit.impulse_fidelity(model)  # content-free: the handed bias alone
    torch.testing.assert_close(fid["mass"], torch.full((2, 2), 0.7))
    x = torch.randn(3, 17, 32)
    maps = attention_maps(model, x)  # the handed bias arrives as a call term, counted once
    bias = (model.shared or model.blocks[0]["rel"])()
    attn = model.blocks[0]["attn"]
    q, k = structinit.find_attention_layers(model)[0][1].qk_features(x)
    torch.testing.assert_close(maps[0], ((q @ k.transpose(-2, -1)) * attn.scale + bias).softmax(-1))
    if shared:
        check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0, per_layer_offsets=True), ValueError,
                       "share one relative position bias table")
