"""Weights a model computes in its forward from other parameters (``weight_norm``, a
``torch.nn.utils.parametrize`` parametrisation): a write to the parameters is not the weight the
model uses, so an init either refuses it before writing or sees it in the model's own maps after
the write and undoes it, naming the parametrisation. Never written silently."""

import warnings

import pytest
from styled_vit import StyledViT
from torch import nn

import structinit
from rejection import check_rejected


class _Twice(nn.Module):
    """A parametrisation that doubles the weight (one that keeps nothing of the trace's projection)."""

    def forward(self, w):
        return 2.0 * w

    def right_inverse(self, w):
        return w / 2.0


def _derive(module: nn.Module, how: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        if how == "weight_norm":
            nn.utils.weight_norm(module)
        elif how == "parametrizations.weight_norm":
            nn.utils.parametrizations.weight_norm(module)
        else:
            nn.utils.parametrize.register_parametrization(module, "weight", _Twice())


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
@pytest.mark.parametrize("how", ["weight_norm", "parametrizations.weight_norm"])
def test_a_weight_the_forward_computes_from_other_parameters_is_never_silently_written(how, scheme):
    """weight_norm makes W = g·v/‖v‖ in every forward, with g = ‖v‖ at the start, so before a write
    the maps are those of the projections read. Where the adapter's view is W itself (the fused qkv
    of structinit's ViT), W is made anew by the next forward: refused before anything is written.
    Where the trace reads v (a traced layer), a write to v leaves g as it was and the model uses
    another q kᵀ: mimetic's check sees the maps are not those written (its diagonal is as strong,
    so a diagonal check alone passed it), impulse's sees the argmax miss. Each names the weight."""
    vit = structinit.create_model("vit_micro_patch2_16", depth=2)
    _derive(vit.blocks[0].attn.qkv, how)
    check_rejected(vit, lambda m: structinit.init_(m, scheme, seed=0), ValueError,
                   r"would write a \(32, 32\) tensor that is none of the model's parameters or buffers, or one its "
                   r"forward makes anew.*nothing was "
                   r"written\. The model computes weights from other parameters in its forward "
                   r"\(blocks\.0\.attn\.qkv\.weight by _?[Ww]eight_?[Nn]orm\).*remove_weight_norm")
    styled = StyledViT("linear-subclass")
    _derive(styled.attns[0].b, how)
    check_rejected(styled, lambda m: structinit.init_(m, scheme, seed=0), ValueError,
                   r"after the write.*layer 'attns\.0'.*the write was undone\. The model computes weights from other "
                   r"parameters in its forward \(b\.weight by _?[Ww]eight_?[Nn]orm\)")
    structinit.init_(StyledViT("linear-subclass"), scheme, seed=0)  # the same model, its weights its own: written


def test_a_parametrisation_that_transforms_the_projection_is_refused_by_name():
    styled = StyledViT("linear-subclass")
    _derive(styled.attns[0].b, "twice")
    check_rejected(styled, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"attns\.0 \(SubclassAttention:.*it computes weights from other parameters in its forward "
                   r"\(b\.weight by _Twice\), which the trace cannot read as projections: remove that for the init")
