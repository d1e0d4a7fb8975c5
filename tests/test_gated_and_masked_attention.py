"""Attention beyond plain softmax(q kᵀ)·v that the schemes read correctly, checked on what the
model itself computes: ConViT's gated positional attention (the published code's, under a
class name structinit does not know), LSA's learned temperature and masked diagonal, and a
class token that joins in front of the grid after the first layers."""

import warnings

import pytest
import torch
from broken_attention import LateClassViT, PublishedGPSA, SelfMaskedAttention, micro_vit_with_module

import structinit
from rejection import check_rejected
from structinit.adapters import GatedPositionalAdapter
from structinit.adapters.observe import observe, real_maps
from structinit.adapters.traced import TracedAdapter
from structinit.schemes.checks import diagonal_strength


def _images(n: int = 4, size: int = 16) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def _hits(model) -> torch.Tensor:
    """(layers, heads): how often each head's own map puts its argmax on its target, on images."""
    return structinit.impulse_fidelity(model, _images(), batch_size=4)["hit"]


def test_published_gpsa_is_read_by_its_parts_and_its_maps_are_the_models_own():
    model = micro_vit_with_module(PublishedGPSA)
    layers = structinit.find_attention_layers(model)
    assert layers and all(isinstance(ad, GatedPositionalAdapter) for _, ad in layers)
    _, ad = layers[0]
    x = torch.randn(2, 64, model.embed_dim, generator=torch.Generator().manual_seed(0))
    ad.module(x)  # builds its rel_indices, as the published forward does
    calls, _ = observe(model, _images(2), [(a.module, a.input_module, a) for _, a in layers])
    real = real_maps(model, _images(2), layers, calls)[0].probs
    with torch.no_grad():
        ours = ad.attention_probs(calls[ad.module].x.float())
    torch.testing.assert_close(real, ours, atol=1e-5, rtol=1e-4)


def test_impulse_aims_both_halves_of_a_gpsa_head_at_its_offset():
    model = micro_vit_with_module(PublishedGPSA)
    structinit.init_(model, "impulse", seed=0)
    assert (_hits(model) >= 0.95).all()
    for _, ad in structinit.find_attention_layers(model):
        offsets = structinit.get_record(ad.module, "impulse")["offsets"]
        want = torch.tensor([[2.0 * dx, 2.0 * dy, -1.0] for dy, dx in offsets])
        torch.testing.assert_close(ad.module.pos_proj.weight.detach(), want)  # a Gaussian around each offset
        assert not ad.module.pos_proj.bias.detach().any()
        # the positional half alone points at the offset too: its argmax is the target wherever that is on the grid
        pos = ad.positional_probs(64)
        for h, (dy, dx) in enumerate(offsets):
            target = structinit.functional.targets.target_index((8, 8), (dy, dx))
            rows = torch.nonzero(target >= 0).squeeze(1)
            assert torch.equal(pos[h, rows].argmax(-1), target[rows])


def test_impulse_on_structinits_own_convit_hits_in_every_gpsa_layer():
    model = structinit.create_model("convit_cpu_patch4_32", num_classes=10)
    structinit.init_(model, "impulse", seed=0)
    hits = structinit.impulse_fidelity(model, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
                                       batch_size=4)["hit"]
    assert (hits >= 0.95).all(), hits


def test_mimetic_on_gpsa_leaves_the_positional_half_and_shows_in_the_content_logits():
    model = micro_vit_with_module(PublishedGPSA)
    before = [ad.module.pos_proj.weight.detach().clone() for _, ad in structinit.find_attention_layers(model)]
    structinit.init_(model, "mimetic", seed=0)
    layers = structinit.find_attention_layers(model)
    assert all(torch.equal(ad.module.pos_proj.weight, b) for (_, ad), b in zip(layers, before))
    calls, _ = observe(model, _images(), [(ad.module, ad.input_module, ad) for _, ad in layers])
    for _, ad in layers:  # the model's own content softmax: the one of its two that is not the positional
        positional = ad.positional_probs(64)
        content = [m for m in calls[ad.module].maps if not torch.allclose(m.probs, positional.expand_as(m.probs))]
        assert len(content) == 1 and content[0].logits is not None
        assert (diagonal_strength(content[0].logits) > 0.25).all()


def test_lsa_is_read_with_its_temperature_and_mask_and_mimetic_sets_it():
    model = micro_vit_with_module(SelfMaskedAttention)
    layers = structinit.find_attention_layers(model)
    assert all(isinstance(ad, TracedAdapter) and ad.masks_self for _, ad in layers)
    assert layers[0][1].scale == pytest.approx(float(model.blocks[0].attn.temperature.detach().exp()))
    structinit.init_(model, "mimetic", seed=0)
    calls, _ = observe(model, _images(), [(ad.module, ad.input_module, ad) for _, ad in layers])
    for (name, ad), real in zip(layers, real_maps(model, _images(), layers, calls)):
        eye = torch.eye(64, dtype=torch.bool)
        assert (real.probs[..., eye] < 1e-30).all(), name  # the model still masks the diagonal
        with torch.no_grad():
            q, k = ad.qk_features(calls[ad.module].x.float())
        assert (diagonal_strength(q @ k.transpose(-2, -1)) > 0.25).all()  # mimetic's q kᵀ, as the model forms it
        torch.testing.assert_close(real.probs, ad.attention_probs(calls[ad.module].x.float()), atol=1e-5, rtol=1e-4)


def test_impulse_refuses_a_masked_diagonal_and_writes_nothing():
    model = micro_vit_with_module(SelfMaskedAttention)
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"impulse cannot set the attention of layer 'blocks\.0\.attn' \(SelfMaskedAttention\): it masks "
                   r"each token's logit on itself.*Use 'mimetic'")


def test_a_class_token_that_joins_later_is_a_prefix_of_the_later_layers_only():
    model = LateClassViT()
    found = structinit.find_position_embedding(model)
    assert (found.num_prefix_tokens, found.joining_prefix_tokens) == (0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        structinit.init_(model, "impulse", seed=0)
    layers = structinit.find_attention_layers(model)
    assert [structinit.get_record(ad.module, "impulse")["num_prefix_tokens"] for _, ad in layers] == [0, 1, 1]
    assert (_hits(model) >= 0.95).all()  # the model's own maps, read with each layer's own layout


def test_a_later_token_count_nothing_explains_is_refused_before_writing():
    check_rejected(LateClassViT(joins=2), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"attention layer 'blocks\.1\.attn' \(Attention\) receives 66 tokens.*nothing was written")


def test_figures_and_metrics_read_each_layer_with_its_own_layout(tmp_path):
    """A class token joining after layer 0: every layer is drawn and measured on its own grid
    block, and one layout for all layers is refused with the fix."""
    model = LateClassViT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        structinit.init_(model, "impulse", seed=0)
    layouts = structinit.analysis.attention_layouts(model)
    assert [lay.num_prefix_tokens for lay in layouts] == [0, 1, 1]
    assert {lay.grid for lay in layouts} == {(8, 8)}
    maps = [m[0] for m in structinit.analysis.attention_maps(model, _images(1))]
    assert [m.shape[-1] for m in maps] == [64, 65, 65]  # what the model itself computed
    fig = structinit.analysis.attention_figure(maps, layouts, layer_names=["0", "1", "2"], path=tmp_path / "m.png")
    # each row's full panel is that layer's grid block: the class token's row and column are dropped
    shown = [ax.images[0].get_array() for ax in fig.axes if ax.images and ax.get_title().endswith("(all N×N)")]
    heads = maps[0].shape[0]
    for layer, lay in enumerate(layouts):
        p = lay.num_prefix_tokens
        torch.testing.assert_close(torch.as_tensor(shown[layer * heads].data), maps[layer][0, p:, p:].float())
    assert (tmp_path / "m.png").stat().st_size > 0
    with pytest.raises(ValueError, match=r"65 tokens, but the layout has 0 prefix \+ 64 grid"):
        structinit.analysis.attention_figure(maps, layouts[0], layer_names=["0", "1", "2"])
    with pytest.raises(ValueError, match=r"layout: expected one TokenLayout or a list of 3"):
        structinit.analysis.attention_figure(maps, layouts[:2], layer_names=["0", "1", "2"])
    metrics = structinit.analysis.attention_metrics(model, _images())
    assert metrics["distance"].shape == (3, heads) and torch.isfinite(metrics["distance"]).all()
