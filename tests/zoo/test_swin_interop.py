"""structinit's Swin and timm's ``SwinTransformer`` of the same configuration share state dicts
both ways (strict loading, the same keys and shapes), build the same unsaved buffers (relative
position index, shifted-window masks) and give the same logits in eval mode."""

import pytest
import torch

import structinit

timm_swin = pytest.importorskip("timm.models.swin_transformer")

CONFIGS = {
    "cifar": {},
    "mnist": {"img_size": 28, "in_chans": 1, "num_classes": 7},  # 14×14 and 7×7 maps: padded windows, odd merge
    "rect_window": {"img_size": 24, "window_size": (4, 2), "depths": (2, 2, 4), "num_classes": 0},
}


def build_pair(overrides: dict):
    """Our swin_cpu_patch2_32 with ``overrides`` and timm's twin, both in eval mode."""
    torch.manual_seed(0)
    ours = structinit.create_model("swin_cpu_patch2_32", **overrides).eval()
    stage = ours.layers[0]
    theirs = timm_swin.SwinTransformer(
        img_size=ours.patch_embed.img_size, patch_size=ours.patch_embed.patch_size,
        in_chans=ours.patch_embed.proj.in_channels, num_classes=ours.num_classes, embed_dim=ours.embed_dim,
        depths=tuple(len(s.blocks) for s in ours.layers),
        num_heads=tuple(s.blocks[0].attn.num_heads for s in ours.layers),
        window_size=overrides.get("window_size", 4), mlp_ratio=stage.blocks[0].mlp.fc1.out_features / ours.embed_dim,
        drop_path_rate=0.0).eval()
    return ours, theirs


def scramble_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, so that norms, biases and tables all carry information."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def images(model, n=2):
    c, (h, w) = model.patch_embed.proj.in_channels, model.patch_embed.img_size
    return torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("direction", ["ours→timm", "timm→ours"])
@pytest.mark.parametrize("config", CONFIGS)
def test_state_dicts_load_strictly_both_ways_with_the_same_logits(config, direction):
    ours, theirs = build_pair(CONFIGS[config])
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    src, dst = (ours, theirs) if direction == "ours→timm" else (theirs, ours)
    scramble_(src, 0 if direction == "ours→timm" else 1)  # every parameter carries information
    dst.load_state_dict(src.state_dict(), strict=True)
    x = images(ours)
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", CONFIGS)
def test_unsaved_buffers_and_windows_are_timms(config):
    ours, theirs = build_pair(CONFIGS[config])
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    for (name, a), (_, b) in zip(ours.named_buffers(), theirs.named_buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for stage, their_stage in zip(ours.layers, theirs.layers):
        for block, their_block in zip(stage.blocks, their_stage.blocks):
            assert (block.window_size, block.shift_size) == (their_block.window_size, their_block.shift_size)
            assert block.attn.window_size == their_block.attn.window_size
    assert ours.no_weight_decay() == theirs.no_weight_decay()
