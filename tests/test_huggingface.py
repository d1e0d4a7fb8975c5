"""The inits on a Hugging Face ``transformers`` ViT built from a config, with no hints: the
position embedding, class token and grid are found; impulse and mimetic work; fidelity on
real images (sklearn's digits, upsampled) matches the same-size structinit ViT."""

import warnings

import pytest
import torch

import structinit
from structinit.functional.posembed import sincos_2d
from structinit.functional.reservation import position_basis

transformers = pytest.importorskip("transformers")

CONFIG = dict(image_size=32, patch_size=4, hidden_size=192, num_attention_heads=3, num_hidden_layers=4,
              intermediate_size=768, num_labels=10)


def hf_vit(seed=0, **overrides):
    torch.manual_seed(seed)
    return transformers.ViTForImageClassification(transformers.ViTConfig(**{**CONFIG, **overrides}))


def same_size_vit(seed=0):
    torch.manual_seed(seed)
    return structinit.models.VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=192, depth=4,
                                               num_heads=3, mlp_ratio=4.0, class_token=True, global_pool="token")


@pytest.fixture(scope="module")
def digits():
    """64 real images: sklearn's 8×8 handwritten digits, upsampled to 32×32 RGB, normalised."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images[:64], dtype=torch.float32)[:, None] / 16
    x = torch.nn.functional.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    return (x - x.mean()) / x.std()


def test_layout_is_found_without_hints():
    model = hf_vit()
    found = structinit.find_position_embedding(model)
    assert found.source == "huggingface" and found.pos_embed_name == "vit.embeddings.position_embeddings"
    assert [n for n, _ in found.prefix_tokens] == ["vit.embeddings.cls_token"]
    assert structinit.infer_layout(model) == structinit.TokenLayout((8, 8), 1)


def test_impulse_without_hints_writes_sincos_reserves_and_records_the_layout():
    model = hf_vit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 'auto' finds everything it reserves: no warning
        structinit.init_(model, "impulse", seed=0)
    pe = model.vit.embeddings.position_embeddings.detach()[0].double()
    torch.testing.assert_close(pe[1:], sincos_2d((8, 8), 192, dtype=torch.float64), atol=1e-6, rtol=0)
    record = structinit.get_record(model.vit.layers[0].attention)
    assert record["grid"] == (8, 8) and record["num_prefix_tokens"] == 1
    # The reservation reached HF's own residual writers (outputs, channel first) and prefix vectors.
    basis = position_basis(pe[1:]).float()
    emb = model.vit.embeddings
    outputs = [emb.patch_embeddings.projection.weight.flatten(1), emb.patch_embeddings.projection.bias[:, None]]
    for layer in model.vit.layers:
        for lin in (layer.attention.o_proj, layer.mlp.fc2):
            outputs += [lin.weight, lin.bias[:, None]]
    for w in outputs:
        assert (basis.T @ w.detach()).abs().max() < 1e-5
    for token in (emb.cls_token[0], emb.position_embeddings[0, :1]):
        assert (token.detach() @ basis).abs().max() < 1e-5
    fid = structinit.impulse_fidelity(model)
    assert bool((fid["hit"] == 1).all())


def hf_weights_in_structinit_layout(hf) -> dict[str, torch.Tensor]:
    """The HF model's weights under structinit's (timm's) names, q/k/v fused into qkv."""
    sd = {k.removeprefix("vit."): v for k, v in hf.state_dict().items()}
    out = {"cls_token": sd["embeddings.cls_token"], "pos_embed": sd["embeddings.position_embeddings"],
           "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
           "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
           "norm.weight": sd["layernorm.weight"], "norm.bias": sd["layernorm.bias"],
           "head.weight": sd["classifier.weight"], "head.bias": sd["classifier.bias"]}
    for i in range(CONFIG["num_hidden_layers"]):
        a, b = f"layers.{i}.", f"blocks.{i}."
        for t in ("weight", "bias"):
            out[b + "attn.qkv." + t] = torch.cat([sd[a + f"attention.{n}_proj.{t}"] for n in "qkv"])
            out[b + "attn.proj." + t] = sd[a + "attention.o_proj." + t]
            out[b + "norm1." + t] = sd[a + "layernorm_before." + t]
            out[b + "norm2." + t] = sd[a + "layernorm_after." + t]
            out[b + "mlp.fc1." + t], out[b + "mlp.fc2." + t] = sd[a + "mlp.fc1." + t], sd[a + "mlp.fc2." + t]
    return out


def test_fidelity_on_real_images_matches_the_same_size_structinit_vit(digits):
    theirs = hf_vit()
    ours = same_size_vit()
    ours.load_state_dict(hf_weights_in_structinit_layout(theirs))  # one starting point for both
    for model in (ours, theirs):
        structinit.init_(model, "impulse", seed=0)
    torch.testing.assert_close(hf_weights_in_structinit_layout(theirs), ours.state_dict())  # the same writes
    a = structinit.impulse_fidelity(ours, digits)
    b = structinit.impulse_fidelity(theirs, digits)
    assert bool((a["hit"] == 1).all()) and bool((b["hit"] == 1).all())
    torch.testing.assert_close(a["mass"], b["mass"], atol=1e-4, rtol=0)  # LayerNorm eps 1e-6 vs 1e-12 only


def test_mimetic_without_hints_equals_mimetic_on_the_same_size_structinit_vit():
    ours, theirs = same_size_vit(), hf_vit()
    for model in (ours, theirs):
        structinit.init_(model, "mimetic", seed=0)
    for (_, a), (_, b) in zip(structinit.find_attention_layers(ours), structinit.find_attention_layers(theirs)):
        for x, y in zip(a.read_qk(), b.read_qk()):
            if x is not None:
                torch.testing.assert_close(x, y)


def test_capture_equals_hf_own_attentions(digits):
    model = hf_vit()
    model.config._attn_implementation = "eager"  # the attention path that returns its maps
    structinit.init_(model, "impulse", seed=0)
    model.eval()
    with torch.no_grad():
        theirs = model(digits[:4], output_attentions=True).attentions
    ours = structinit.attention_maps(model, digits[:4])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fidelity_arguments_that_contradict_the_record_raise(digits):
    model = hf_vit()
    structinit.init_(model, "impulse", seed=0)
    with pytest.raises(ValueError, match=r"num_prefix_tokens=0, but the impulse init recorded num_prefix_tokens=1"):
        structinit.impulse_fidelity(model, digits[:2], num_prefix_tokens=0)
    with pytest.raises(ValueError, match=r"grid=\(4, 16\), but the impulse init recorded grid=\(8, 8\)"):
        structinit.impulse_fidelity(model, digits[:2], grid=(4, 16))


def test_deit_distillation_token_is_a_prefix_token():
    torch.manual_seed(0)
    config = transformers.DeiTConfig(**CONFIG)
    model = transformers.DeiTForImageClassificationWithTeacher(config)
    assert structinit.infer_layout(model) == structinit.TokenLayout((8, 8), 2)
    structinit.init_(model, "impulse", seed=0)
    names = [n for n, _ in structinit.find_position_embedding(model).prefix_tokens]
    assert names == ["deit.embeddings.cls_token", "deit.embeddings.distillation_token"]
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


@pytest.mark.parametrize("scheme", ["timm", "pytorch"])
def test_baselines_reinitialise_hf_position_embedding_and_class_token(scheme):
    model = hf_vit()
    emb = model.vit.embeddings
    with torch.no_grad():
        emb.position_embeddings.fill_(5.0)
        emb.cls_token.fill_(5.0)
    structinit.init_(model, scheme, seed=0)
    assert emb.position_embeddings.detach().abs().max() < 1  # trunc-normal / N(0, 0.02²), not 5
    assert emb.cls_token.detach().abs().max() < 1


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_as_many_tokens_as_channels_is_plain_attention(scheme, digits):
    # SigLIP's tower (no class token) at width 64 on an 8×8 grid: its tokens, handed to the attention
    # as hidden_states=…, are (B, 64, 64), the shape of a mask over 64 tokens. They are the tokens,
    # not a logit term: the layer is written and its own maps carry the structure.
    config = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=32, patch_size=4)
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(config)
    structinit.init_(model, scheme, seed=0)
    if scheme == "impulse":
        fid = structinit.impulse_fidelity(model, digits[:8])
        assert bool((fid["hit"] > 0.9).all()), fid["hit"]
