"""Our VisionTransformer must match timm's ``vision_transformer`` layout and numerics exactly
(timm itself cannot be imported here, so its layout is written out by hand below)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import structinit
from structinit import VisionTransformer

# ---------------------------------------------------------------------------------------------
# state_dict layout
# ---------------------------------------------------------------------------------------------


def timm_keys(depth, dim, patch, in_chans, num_pe, num_classes, mlp_hidden, cls_token, fc_norm):
    """Key → shape of timm's VisionTransformer state_dict, written out from timm's source."""
    keys = {}
    if cls_token:
        keys["cls_token"] = (1, 1, dim)
    keys["pos_embed"] = (1, num_pe, dim)
    keys["patch_embed.proj.weight"] = (dim, in_chans, patch, patch)
    keys["patch_embed.proj.bias"] = (dim,)
    for i in range(depth):
        b = f"blocks.{i}."
        keys[b + "norm1.weight"] = (dim,)
        keys[b + "norm1.bias"] = (dim,)
        keys[b + "attn.qkv.weight"] = (3 * dim, dim)
        keys[b + "attn.qkv.bias"] = (3 * dim,)
        keys[b + "attn.proj.weight"] = (dim, dim)
        keys[b + "attn.proj.bias"] = (dim,)
        keys[b + "norm2.weight"] = (dim,)
        keys[b + "norm2.bias"] = (dim,)
        keys[b + "mlp.fc1.weight"] = (mlp_hidden, dim)
        keys[b + "mlp.fc1.bias"] = (mlp_hidden,)
        keys[b + "mlp.fc2.weight"] = (dim, mlp_hidden)
        keys[b + "mlp.fc2.bias"] = (dim,)
    if fc_norm:
        keys["fc_norm.weight"] = (dim,)
        keys["fc_norm.bias"] = (dim,)
    else:
        keys["norm.weight"] = (dim,)
        keys["norm.bias"] = (dim,)
    keys["head.weight"] = (num_classes, dim)
    keys["head.bias"] = (num_classes,)
    return keys


def shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_small_data_preset_matches_timm_avg_pool_layout():
    # timm: vit_tiny_patch16_224(img_size=32, patch_size=2, class_token=False, global_pool='avg', num_classes=10)
    model = structinit.create_model("vit_tiny_patch2_32")
    expected = timm_keys(depth=12, dim=192, patch=2, in_chans=3, num_pe=256, num_classes=10,
                         mlp_hidden=768, cls_token=False, fc_norm=True)
    got = shapes(model)
    assert got == expected
    assert "norm.weight" not in got and "cls_token" not in got
    assert got["blocks.0.attn.qkv.weight"] == (576, 192)
    assert got["blocks.11.mlp.fc1.weight"] == (768, 192)


def test_class_token_preset_matches_timm_token_pool_layout():
    model = structinit.create_model("vit_tiny_patch16_224")
    expected = timm_keys(depth=12, dim=192, patch=16, in_chans=3, num_pe=197, num_classes=1000,
                         mlp_hidden=768, cls_token=True, fc_norm=False)
    got = shapes(model)
    assert got == expected
    assert got["cls_token"] == (1, 1, 192) and got["pos_embed"] == (1, 197, 192)
    assert "fc_norm.weight" not in got


def test_no_embed_class_drops_the_class_row():
    model = structinit.create_model("vit_tiny_patch16_224", no_embed_class=True, depth=1)
    got = shapes(model)
    assert got["pos_embed"] == (1, 196, 192)
    assert got["cls_token"] == (1, 1, 192)


def test_state_dict_round_trips_strictly_between_instances():
    a = structinit.create_model("vit_micro_patch2_16")
    b = structinit.create_model("vit_micro_patch2_16")
    with torch.no_grad():
        for p in a.parameters():
            p.add_(torch.randn_like(p))
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# sin-cos position embedding
# ---------------------------------------------------------------------------------------------


def test_sincos_pos_embed_entries_follow_the_timm_formula():
    model = structinit.create_model("vit_micro_patch2_16")  # 8×8 grid, D = 32
    d, w = 32, 8
    pe = model.pos_embed[0]
    assert isinstance(model.pos_embed, torch.nn.Parameter)
    assert model.pos_embed.requires_grad is False
    torch.testing.assert_close(pe, structinit.sincos_2d((8, 8), d), rtol=0, atol=0)
    q = d // 4
    for y, x in [(3, 5), (0, 7), (7, 0), (6, 2)]:
        row = pe[y * w + x].double()
        for j in range(q):
            om = 10000.0 ** (-j / q)
            assert row[j].item() == pytest.approx(math.sin(y * om), abs=1e-6)
            assert row[q + j].item() == pytest.approx(math.sin(x * om), abs=1e-6)
            assert row[2 * q + j].item() == pytest.approx(math.cos(y * om), abs=1e-6)
            assert row[3 * q + j].item() == pytest.approx(math.cos(x * om), abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 7), w=st.integers(1, 7), quarter=st.integers(1, 6))
def test_sincos_2d_matches_formula(h, w, quarter):
    d = 4 * quarter
    pe = structinit.sincos_2d((h, w), d, dtype=torch.float64)
    assert pe.shape == (h * w, d)
    om = torch.tensor([10000.0 ** (-j / quarter) for j in range(quarter)], dtype=torch.float64)
    for y in range(h):
        for x in range(w):
            expected = torch.cat([torch.sin(y * om), torch.sin(x * om), torch.cos(y * om), torch.cos(x * om)])
            torch.testing.assert_close(pe[y * w + x], expected)


def test_pos_embed_scale_multiplies_sincos_and_class_row_is_zero():
    base = structinit.sincos_2d((4, 4), 32)
    scaled = VisionTransformer(img_size=8, patch_size=2, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                               class_token=False, global_pool="avg", pos_embed="sincos", pos_embed_scale=2.5)
    torch.testing.assert_close(scaled.pos_embed[0], 2.5 * base)
    with_cls = VisionTransformer(img_size=8, patch_size=2, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                                 pos_embed="sincos")
    assert with_cls.pos_embed.shape == (1, 17, 32)
    assert torch.equal(with_cls.pos_embed[0, 0], torch.zeros(32))
    torch.testing.assert_close(with_cls.pos_embed[0, 1:], base)


def test_learned_pos_embed_is_trainable_and_scaled():
    torch.manual_seed(0)
    a = VisionTransformer(img_size=8, patch_size=2, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    torch.manual_seed(0)
    b = VisionTransformer(img_size=8, patch_size=2, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                          pos_embed_scale=3.0)
    assert a.pos_embed.requires_grad
    torch.testing.assert_close(b.pos_embed, 3.0 * a.pos_embed)


# ---------------------------------------------------------------------------------------------
# an independent reference forward pins the fused-qkv layout and the pooling
# ---------------------------------------------------------------------------------------------


def reference_forward(sd, x, depth, heads, pool, prefix):
    """timm's ViT forward from a state_dict, with plain torch ops."""
    ln = lambda t, name: F.layer_norm(t, t.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps=1e-6)
    tok = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=sd[
        "patch_embed.proj.weight"].shape[-1])
    tok = tok.flatten(2).transpose(1, 2)
    if prefix:
        cls = sd["cls_token"].expand(x.shape[0], -1, -1)
        tok = torch.cat([cls, tok], dim=1)
    tok = tok + sd["pos_embed"]
    d = tok.shape[-1]
    r = d // heads
    for i in range(depth):
        p = f"blocks.{i}."
        h = ln(tok, p + "norm1")
        qkv = h @ sd[p + "attn.qkv.weight"].T + sd[p + "attn.qkv.bias"]
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        outs = []
        for hd in range(heads):
            sl = slice(hd * r, (hd + 1) * r)
            a = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(r), dim=-1)
            outs.append(a @ v[..., sl])
        att = torch.cat(outs, dim=-1) @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
        tok = tok + att
        h = ln(tok, p + "norm2")
        h = F.gelu(h @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"])
        tok = tok + h @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"]
    if pool == "avg":
        feat = ln(tok[:, prefix:].mean(dim=1), "fc_norm")
    else:
        feat = ln(tok, "norm")[:, 0]
    return feat @ sd["head.weight"].T + sd["head.bias"]


def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.ndim == 1 and p.shape[0] % 2 else 0.0))


@pytest.mark.parametrize(
    "kwargs, pool, prefix",
    [
        (dict(), "avg", 0),
        (dict(class_token=True, global_pool="token", pos_embed="learn"), "token", 1),
        (dict(class_token=True, global_pool="avg"), "avg", 1),
        (dict(num_heads=4), "avg", 0),
    ],
)
def test_forward_matches_independent_reference(kwargs, pool, prefix):
    model = structinit.create_model("vit_micro_patch2_16", **kwargs).eval()
    randomise(model, seed=1)
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    heads = kwargs.get("num_heads", 2)
    expected = reference_forward(sd, x, depth=2, heads=heads, pool=pool, prefix=prefix)
    with torch.no_grad():
        got = model(x)
    assert got.shape == (3, 10)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_reference_detects_swapped_q_and_k():
    """Sanity: the reference is sensitive to the qkv layout (so the test above can fail)."""
    model = structinit.create_model("vit_micro_patch2_16").eval()
    randomise(model, seed=3)
    x = torch.randn(2, 3, 16, 16)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = sd["blocks.0.attn.qkv.weight"]
    sd["blocks.0.attn.qkv.weight"] = torch.cat([w[32:64], w[:32], w[64:]])
    with torch.no_grad():
        assert not torch.allclose(model(x), reference_forward(sd, x, 2, 2, "avg", 0), atol=1e-4)


# ---------------------------------------------------------------------------------------------
# attention maps
# ---------------------------------------------------------------------------------------------


def block_by_block_maps(model, x):
    """Every block's attention maps from the model's own modules, walked by hand: an oracle
    independent of the hook-based capture path."""
    maps = []
    with torch.no_grad():
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for blk in model.blocks:
            attn = blk.attn
            b, t, _ = tokens.shape
            qkv = attn.qkv(blk.norm1(tokens)).reshape(b, t, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            q, k = qkv[0], qkv[1]
            maps.append(torch.softmax(q @ k.transpose(-2, -1) * attn.head_dim**-0.5, dim=-1))
            tokens = blk(tokens)
    return maps


@pytest.mark.parametrize("kwargs", [dict(), dict(class_token=True, global_pool="token")])
def test_attention_maps_capture_path_equals_block_by_block_walk(kwargs):
    model = structinit.create_model("vit_micro_patch2_16", **kwargs)
    randomise(model, seed=4)
    model.train()
    x = torch.randn(2, 3, 16, 16)
    own = block_by_block_maps(model, x)
    generic = structinit.attention_maps(model, x)
    assert model.training  # the generic path restores the mode
    t = 64 + (1 if kwargs else 0)
    assert len(own) == len(generic) == 2
    for a, b in zip(own, generic):
        assert a.shape == b.shape == (2, 2, t, t)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 2, t))


def test_attention_maps_match_reference_softmax():
    model = structinit.create_model("vit_micro_patch2_16")
    randomise(model, seed=5)
    x = torch.randn(1, 3, 16, 16)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tok = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=2).flatten(2).transpose(1, 2)
    tok = tok + sd["pos_embed"]
    h = F.layer_norm(tok, (32,), sd["blocks.0.norm1.weight"], sd["blocks.0.norm1.bias"], eps=1e-6)
    qkv = h @ sd["blocks.0.attn.qkv.weight"].T + sd["blocks.0.attn.qkv.bias"]
    q, k = qkv[..., :32], qkv[..., 32:64]
    head1 = torch.softmax(q[..., 16:] @ k[..., 16:].transpose(1, 2) / 4.0, dim=-1)
    torch.testing.assert_close(structinit.attention_maps(model, x, layers=[0])[0][:, 1], head1,
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# create_model and input checks
# ---------------------------------------------------------------------------------------------


def test_unknown_model_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"vit_nope") as info:
        structinit.create_model("vit_nope")
    for name in structinit.list_models():
        assert name in str(info.value)


def test_overrides_apply():
    model = structinit.create_model("vit_micro_patch2_16", num_classes=100, depth=3)
    assert model.head.out_features == 100
    assert len(model.blocks) == 3
    assert model(torch.randn(1, 3, 16, 16)).shape == (1, 100)


def test_all_presets_listed_and_sorted():
    names = structinit.list_models()
    assert names == sorted(names)
    assert {"vit_tiny_patch2_32", "vit_micro_patch2_16", "vit_tiny_patch16_224"} <= set(names)


def test_img_size_not_divisible_by_patch_raises():
    with pytest.raises(ValueError, match=r"img_size=15.*patch_size=2"):
        structinit.create_model("vit_micro_patch2_16", img_size=15)


def test_wrong_input_size_raises_clear_error():
    model = structinit.create_model("vit_micro_patch2_16")
    with pytest.raises(ValueError, match=r"\(32, 32\).*img_size"):
        model(torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_pool="max"), r"global_pool='max'"),
        (dict(class_token=False, global_pool="token"), r"class_token"),
        (dict(pos_embed="alibi"), r"pos_embed='alibi': expected 'learn', 'sincos' or 'rope'"),
        (dict(embed_dim=30, num_heads=4), r"dim=30.*num_heads=4"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VisionTransformer(img_size=8, patch_size=2, depth=1, **{"embed_dim": 32, "num_heads": 2, **kwargs})
