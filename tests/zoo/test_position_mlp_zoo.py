"""Impulse through the continuous position bias of the packages' own models: timm's and Hugging
Face's and torchvision's Swin-V2 (cosine attention, 16·sigmoid of an MLP) and timm's relpos-MLP
ViTs, with an MLP per layer or one the model shares among them (``shared_rel_pos``). The
adapter's logits are the model's own (the probe says 'self'), the planner fits the MLP, and each
model's own attention maps on real images put every head's argmax on its target."""

import copy
import warnings

import pytest
import torch
import zoo

import structinit
from rejection import check_rejected
from structinit.adapters.survey import attention_survey, layer_relative_bias

MODELS = ("timm_swinv2_tiny_window8_64px", "timm_vit_relpos_small_32px", "timm_vit_srelpos_small_32px",
          "hf_Swinv2ForImageClassification", "tv_swin_v2_t_64px")
SHARED = {"timm_vit_srelpos_small_32px"}  # one MLP, made by the model and handed to every layer
COSINE = {"timm_swinv2_tiny_window8_64px", "hf_Swinv2ForImageClassification", "tv_swin_v2_t_64px"}


@pytest.fixture(scope="module", params=MODELS)
def built(request):
    entry = zoo.BY_NAME[request.param]
    return entry, zoo.build(entry)


def test_the_adapter_computes_what_the_model_computes(built):
    entry, model = built
    survey = attention_survey(model)
    assert [v.kind for v in survey.verdicts] == ["self"] * len(survey.verdicts), survey.verdicts
    for name, ad in structinit.find_attention_layers(model):
        pb = layer_relative_bias(model, name, ad)
        assert type(pb).__name__ == "PositionMlpBias" and pb.num_heads == ad.num_heads
        assert (ad.cosine is not None) == (entry.name in COSINE)
        assert pb.activation == ("sigmoid" if entry.name in COSINE else "identity")
        assert pb.received == (entry.name in SHARED)


def test_a_shared_position_mlp_is_fitted_once_and_is_the_table_every_layer_receives():
    model = zoo.build(zoo.BY_NAME["timm_vit_srelpos_small_32px"])
    layers = structinit.find_attention_layers(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        structinit.init_(model, "impulse", seed=0)
    tables = {id(layer_relative_bias(model, name, ad).mlp) for name, ad in layers}
    assert tables == {id(model.shared_rel_pos.mlp)}
    received = []  # what the model hands each layer, read from the call itself
    hooks = [ad.module.register_forward_pre_hook(lambda m, a, k: received.append(k["shared_rel_pos"]),
                                                 with_kwargs=True) for _, ad in layers]
    model.eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    for h in hooks:
        h.remove()
    bias = received[0][0]  # (heads, T, T): the class token's row and column are 0
    offsets = structinit.get_record(layers[0][1].module)["offsets"]
    grid = (8, 8)
    for head, (dy, dx) in enumerate(offsets):
        for qy, qx in ((3, 3), (4, 5)):
            q = 1 + qy * grid[1] + qx
            assert int(bias[head, q, 1:].argmax()) == (qy + dy) * grid[1] + qx + dx
    assert all(torch.equal(r, received[0]) for r in received)
    assert len({tuple(map(tuple, structinit.get_record(ad.module)["offsets"])) for _, ad in layers}) == 1
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=1, per_layer_offsets=True), ValueError,
                   "share one position MLP")


def test_impulse_hits_on_the_models_own_maps_of_real_images(built):
    entry, base = built
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        structinit.init_(model, "impulse", seed=0)
    for _, ad in structinit.find_attention_layers(model):
        record = structinit.get_record(ad.module)
        assert record["solver"] == "position-mlp" and record["mass"] >= 0.95 - 1e-6
        if entry.name in COSINE:
            assert all(0 < s < 8 for s in record["logit_scale"])
        else:
            wq, bq, _, _ = ad.read_qk()
            assert bool((wq == 0).all()) and (bq is None or bool((bq == 0).all()))
    images, _ = zoo.real_images(8, entry.image_size)
    fid = structinit.impulse_fidelity(model, images, batch_size=4)
    summary = structinit.fidelity_summary(fid)
    assert summary.hit_first >= 0.95 and summary.hit_mean >= 0.90, summary


def test_a_refusal_leaves_the_model_bit_identical(built):
    entry, base = built
    model = copy.deepcopy(base)
    if entry.name in COSINE:  # the 16·sigmoid table caps the margin a head's bias can hold
        check_rejected(model, lambda m: structinit.init_(m, "impulse", target_mass=1 - 1e-12), ValueError,
                       "capped.*lower target_mass")
    check_rejected(model, lambda m: structinit.init_(m, "impulse", pe_scale=2.0), ValueError, "pe_scale")
    check_rejected(model, lambda m: structinit.init_(m, "impulse", solver="closed_form"), ValueError,
                   "an MLP generates")
