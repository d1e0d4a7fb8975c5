"""Impulse on a ViT whose position is 2-D axial RoPE: the probe reads the rotation from the
model's own logits, impulse writes the q/k biases, and the model's own maps on real images are
the impulse; what cannot hold is refused with the model untouched."""

import dataclasses

import pytest
import torch
from torch import nn

import structinit
from real_images import digit_images
from rejection import check_rejected
from structinit.adapters.survey import attention_survey
from structinit.analysis.capture import attention_maps
from structinit.functional.targets import target_index
from structinit.models.rope import Rotary2d


def rope_vit(**kw):
    torch.manual_seed(0)
    return structinit.create_model("vit_cpu_rope_patch4_32", **kw)


def images(n=16):
    return digit_images(n)


def test_the_probe_reads_the_rotation_from_the_models_own_logits():
    survey = attention_survey(rope_vit())
    assert [v.kind for v in survey.verdicts] == ["self"] * 6


def test_a_description_that_is_not_what_the_model_computes_is_refused(monkeypatch):
    real = Rotary2d.rotary

    def swapped(self):  # rows and columns exchanged: the model turns by y where this says x
        r = real(self)
        bands = r.angles.shape[-1] // 2
        angles = torch.cat([r.angles[..., bands:], r.angles[..., :bands]], -1)
        return type(r)(angles, r.pairs, r.grid, r.num_prefix_tokens)

    monkeypatch.setattr(Rotary2d, "rotary", swapped)
    check_rejected(rope_vit(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"impulse cannot set the attention of layer 'blocks.0.attn'")


@pytest.mark.parametrize("target_mass", [0.5, 0.9])
def test_every_layers_own_maps_on_real_images_are_the_impulse(target_mass):
    model = rope_vit()
    structinit.init_(model, "impulse", seed=0, target_mass=target_mass)
    fid = structinit.impulse_fidelity(model, images())
    assert bool((fid["hit"] == 1).all()), fid["hit"]
    # Every query whose target is on the grid puts at least target_mass on it, whatever the image.
    maps = attention_maps(model, images(4))
    for i, (name, ad) in enumerate(structinit.find_attention_layers(model)):
        for h, offset in enumerate(structinit.get_record(ad.module)["offsets"]):
            t = target_index((8, 8), offset)
            rows = torch.nonzero(t >= 0).squeeze(1)
            assert float(maps[i][:, h, rows, t[rows]].min()) >= target_mass - 1e-4, (name, h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_whose_angles_are_rounded_still_hits(dtype):
    """In 16 bits the model's own angles are rounded (bf16: by up to ~0.02 rad on an 8×8 grid),
    which is not a non-linear rotation: the init is not refused, and the model's own maps hit."""
    model = rope_vit().to(dtype)
    structinit.init_(model, "impulse", seed=0)
    assert bool((structinit.impulse_fidelity(model, images().to(dtype))["hit"] == 1).all())


def test_a_bend_larger_than_rounding_is_refused_in_16_bits():
    rotary = rope_vit().blocks[0].attn.rope.rotary()
    bent = rotary.angles.clone()
    bent[0, 9, 0] += 0.3
    with pytest.raises(ValueError, match="not linear in the grid position"):
        dataclasses.replace(rotary, angles=bent.to(torch.bfloat16)).frequencies()


def test_a_class_token_is_not_rotated_and_the_grid_still_hits():
    model = rope_vit(class_token=True, global_pool="token")
    structinit.init_(model, "impulse", seed=0, target_mass=0.9)
    record = structinit.get_record(model.blocks[0].attn)
    assert record["num_prefix_tokens"] == 1 and record["solver"] == "rotary"
    fid = structinit.impulse_fidelity(model, images())
    assert float(fid["hit"].min()) >= 0.95


def test_the_content_weights_start_at_zero_and_still_learn():
    model = rope_vit()
    structinit.init_(model, "impulse", seed=0)
    qk = model.blocks[0].attn.qkv.weight[:256]
    assert bool((qk == 0).all())
    nn.functional.cross_entropy(model(images(4)), torch.arange(4)).backward()
    assert float(model.blocks[0].attn.qkv.weight.grad[:256].abs().sum()) > 0


def test_without_q_k_biases_a_pre_norm_channel_carries_the_impulse():
    model = rope_vit(qkv_bias=False)
    structinit.init_(model, "impulse", seed=0)
    fid = structinit.impulse_fidelity(model, images())
    assert bool((fid["hit"] == 1).all()), fid["hit"]
    for block in model.blocks:
        record = structinit.get_record(block.attn)
        assert (record["solver"], record["channel"]) == ("rotary-norm", 127)
        assert float(block.norm1.weight.detach()[-1]) == 0.0 and float(block.norm1.bias.detach()[-1]) == 1.0
        assert bool((block.norm1.weight[:-1] == 1).all())  # the other channels keep the norm's init
        wq = block.attn.qkv.weight[:128]  # (out, in): q reads the reserved channel alone
        assert bool((wq[:, :-1] == 0).all()) and float(wq.detach()[:, -1].abs().sum()) > 0


class _Tapped(nn.Module):
    """Passes the tokens to ``inner`` and also hands them to ``reader``, a second module
    that reads the pre-norm's output beside the attention."""

    def __init__(self, inner, dim):
        super().__init__()
        self.inner, self.reader = inner, nn.Linear(dim, dim)

    def forward(self, x):
        return self.inner(x) + 0 * self.reader(x)


def test_without_biases_or_a_usable_pre_norm_impulse_is_refused_and_points_to_mimetic():
    no_norm = rope_vit(qkv_bias=False)
    for block in no_norm.blocks:
        block.norm1 = nn.LayerNorm(128, bias=False)
    msg = check_rejected(no_norm, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                         r"(?s)rotates q and k by position \(RoPE\).*no learned q and k biases, and no affine "
                         r"LayerNorm \(with a bias\) feeds it")
    assert "'mimetic'" in msg
    structinit.init_(no_norm, "mimetic", seed=0)  # needs no position channel
    shared = rope_vit(qkv_bias=False)
    shared.blocks[0].attn = _Tapped(shared.blocks[0].attn, 128)
    check_rejected(shared, lambda m: structinit.init_(m, "impulse", seed=0, layers=[0]), ValueError,
                   r"its pre-norm 'blocks.0.norm1' is also read by blocks.0.attn.reader")


@pytest.mark.parametrize(("options", "match"), [
    ({"solver": "closed_form"}, r"solver='closed_form': the chosen layers .* carry position in the rotation"),
    ({"pe_scale": 2.0}, r"pe_scale: the chosen layers"),
    ({"pos_embed": torch.zeros(64, 128)}, r"(?s)pos_embed=.*omit it"),
])
def test_options_about_a_position_embedding_are_refused(options, match):
    check_rejected(rope_vit(), lambda m: structinit.init_(m, "impulse", seed=0, **options), ValueError, match)


def test_head_dim_not_a_multiple_of_four_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"head_dim=6: 2-D rotary embedding needs a multiple of 4"):
        structinit.create_model("vit_cpu_rope_patch4_32", embed_dim=24, num_heads=4)


@pytest.mark.parametrize(("kw", "prefix"), [({}, 0), ({"class_token": True, "global_pool": "token"}, 1)])
def test_the_token_layout_of_a_rope_model_comes_from_its_rotation(kw, prefix):
    layout = structinit.infer_layout(rope_vit(**kw))  # no position embedding to read it from
    assert layout.grid == (8, 8) and layout.num_prefix_tokens == prefix


class _Cropping(nn.Module):
    """A RoPE ViT that states 34 px images and takes only those: it crops them to the 32 px
    its 4 px patches cover (as a 14 px patch conv drops the last 8 px of 64 px images), so
    images built from its 8×8 grid (32 px) fail in its forward."""

    def __init__(self):
        super().__init__()
        self.vit, self.img_size = rope_vit(), 34

    def forward(self, x):
        if x.shape[-2:] != (34, 34):
            raise ValueError(f"Input height ({x.shape[-2]}) doesn't match model (34)")
        return self.vit(x[..., 1:33, 1:33])


def test_a_rotation_is_read_on_the_images_the_model_states_when_its_grid_is_theirs():
    """The survey's probe (34 px) makes the 8×8 grid the impulse is designed for: its rotation is
    used as read, with no second probe of images made from the grid (32 px, which this forward
    refuses); the check after the write runs on the survey's probe too."""
    model = _Cropping()
    structinit.init_(model, "impulse", seed=0, target_mass=0.9)
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())
