"""A projection followed by a BatchNorm, each with a bias (EfficientFormer-V2's q, k and v): the
trace reads the two biases as one shift of each channel, their sum, and every write of the role
sets the bias nearest the product and zeroes the other, so the bias written is the channel's
whole shift. Checked on the module's own forward; a norm whose running mean is not zero shifts
the channels by more than the biases, and the trace refuses it."""

import pytest
import torch
from styled_vit import StyledViT

import structinit
from rejection import check_rejected
from structinit.adapters.attention import adapter_logits
from structinit.adapters.traced import TracedAdapter


def _model(seed=0):
    torch.manual_seed(seed)
    model = StyledViT("conv-norm-maps").eval()
    with torch.no_grad():  # both biases of every role nonzero: the read must add them
        for attn in model.attns:
            for proj in (attn.q, attn.k, attn.v):
                proj[1].bias.normal_(generator=torch.Generator().manual_seed(1))
    return model


def test_both_biases_of_a_role_are_found_and_read_as_their_sum():
    model = _model()
    for (name, ad), attn in zip(structinit.find_attention_layers(model), model.attns):
        assert isinstance(ad, TracedAdapter), name
        assert ad.param_names["q"] == "q.0.weight"
        for role, proj in (("q", attn.q), ("k", attn.k), ("v", attn.v)):
            (more,) = ad.more_biases[role]
            bias = ad.linear_views()[role][1]  # where a write goes: the norm's bias, nearest the product
            assert bias.data_ptr() == proj[1].bias.data_ptr() and more.data_ptr() == proj[0].bias.data_ptr()
            assert torch.equal(ad.read_views()[role][1], proj[0].bias.detach() + proj[1].bias.detach())
        assert "o" not in ad.more_biases


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_write_zeroes_the_projections_own_bias_and_sets_the_norms(scheme):
    model = _model()
    options = {"reserve": "none", "value_init": "mimetic"} if scheme == "impulse" else {}
    structinit.init_(model, scheme, seed=0, **options)
    for attn in model.attns:
        for proj in (attn.q, attn.k, attn.v):  # q kᵀ and W_v W_o as designed: no shift left
            assert not proj[0].bias.any() and not proj[1].bias.any()
        assert not attn.out.bias.any()


@pytest.mark.parametrize("written", [False, True])
def test_the_logits_read_are_the_models_own_before_and_after_a_write(written):
    model = _model()
    if written:
        structinit.init_(model, "mimetic", seed=0)
    (_, ad), attn = structinit.find_attention_layers(model)[0], model.attns[0]  # its probe runs the model: first
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(x)
        tokens = model.norms[0](model.patch(x).flatten(2).transpose(1, 2).add(model.pos_embed)
                                .transpose(1, 2).reshape(2, -1, 8, 8))
        ours = adapter_logits(ad, tokens.flatten(2).transpose(1, 2), None)
    # the norm's scale 1/√(1 + eps), which the read leaves out, is one number well inside the tolerance
    torch.testing.assert_close(attn.last_logits, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_norm_whose_running_mean_shifts_q_is_refused_and_the_model_left_as_it_was(scheme):
    model = _model()
    with torch.no_grad():
        model.attns[0].q[1].running_mean.normal_(generator=torch.Generator().manual_seed(3))
    check_rejected(model, lambda m: structinit.init_(m, scheme, seed=0), ValueError,
                   "no adapter understands.*attns.0 .*running statistics")
