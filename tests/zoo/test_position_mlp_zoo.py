"""Impulse through the continuous position bias of the packages' own models: timm's and Hugging
Face's and torchvision's Swin-V2 (cosine attention, 16·sigmoid of an MLP) and timm's relpos-MLP
ViT. The adapter's logits are the model's own (the probe says 'self'), the planner fits the MLP,
and each model's own attention maps on real images put every head's argmax on its target."""

import copy
import warnings

import pytest
import zoo

import structinit
from rejection import check_rejected
from structinit.adapters.registry import attention_survey, layer_relative_bias

MODELS = ("timm_swinv2_tiny_window8_64px", "timm_vit_relpos_small_32px", "hf_Swinv2ForImageClassification",
          "tv_swin_v2_t_64px")
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
