"""structinit's ViTs and timm's ``VisionTransformer`` of the same configuration share state dicts
both ways (strict loading, the same keys and shapes) and give the same logits in eval mode."""

import pytest
import torch

import structinit

timm_vit = pytest.importorskip("timm.models.vision_transformer")

# A RoPE ViT has no twin here: timm's RoPE ViTs are Eva models, with other parameter names.
NAMES = [n for n in structinit.list_models() if n.startswith("vit_") and "_rope_" not in n]


def timm_twin(ours: structinit.VisionTransformer):
    """timm's VisionTransformer with ``ours``'s configuration (read off the built model)."""
    attn = ours.blocks[0].attn
    return timm_vit.VisionTransformer(
        img_size=ours.patch_embed.img_size, patch_size=ours.patch_embed.patch_size,
        in_chans=ours.patch_embed.proj.in_channels, num_classes=ours.num_classes, embed_dim=ours.embed_dim,
        depth=len(ours.blocks), num_heads=attn.num_heads,
        mlp_ratio=ours.blocks[0].mlp.fc1.out_features / ours.embed_dim, qkv_bias=attn.qkv.bias is not None,
        class_token=ours.cls_token is not None, global_pool=ours.global_pool,
        no_embed_class=ours.no_embed_class).eval()


def images(model, n=2):
    c, (h, w) = model.patch_embed.proj.in_channels, model.patch_embed.img_size
    return torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", NAMES)
def test_our_state_dict_loads_strictly_into_timm_with_the_same_logits(name):
    torch.manual_seed(0)
    ours = structinit.create_model(name).eval()
    structinit.init_(ours, "impulse", seed=0)  # structured q/k and a rewritten PE travel too
    theirs = timm_twin(ours)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = images(ours)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_timm_state_dict_loads_strictly_into_ours_with_the_same_logits(name):
    torch.manual_seed(0)
    ours = structinit.create_model(name).eval()
    theirs = timm_twin(ours)
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = images(ours)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_our_mixer_and_timms_share_state_dicts_and_logits():
    timm_mixer = pytest.importorskip("timm.models.mlp_mixer")
    torch.manual_seed(0)
    ours = structinit.create_model("mixer_cpu_patch4_32").eval()
    theirs = timm_mixer.MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=6, embed_dim=128).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), rtol=1e-5, atol=1e-5)
    ours.load_state_dict(timm_mixer.MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=6,
                                             embed_dim=128).state_dict(), strict=True)
