"""A model structinit cannot build an input for (a vision tower that takes packed patches and
their grid sizes) is refused until its caller hands over one call of its forward
(``example_inputs=``); with it, the write is checked in that forward, the maps the model's own
softmax forms are the designed ones, and nothing else changes."""

import pytest
import torch
from layout_models import PackedTower

import structinit
from rejection import check_rejected
from structinit.adapters.probe import ModelCall, as_call
from structinit.schemes.checks import diagonal_strength


def _call(images: int = 2, h: int = 8, w: int = 8, patch: int = 2):
    """Packed patches of ``images`` h×w-patch images and their grid sizes, as a tower's processor
    hands them over."""
    patches = torch.randn(images * h * w, 3 * patch * patch, generator=torch.Generator().manual_seed(0))
    return patches, torch.tensor([[1, h, w]] * images)


@pytest.mark.parametrize("scheme", ["mimetic", "impulse"])
def test_a_model_structinit_cannot_call_is_refused_naming_example_inputs_and_left_as_it_was(scheme):
    check_rejected(PackedTower(), lambda m: structinit.init_(m, scheme, seed=0, reserve="none")
                   if scheme == "impulse" else structinit.init_(m, scheme, seed=0),
                   ValueError, r"could not run PackedTower.s forward.*example_inputs=")


def test_mimetic_with_an_example_call_is_checked_in_it_and_shows_in_the_towers_own_logits():
    torch.manual_seed(0)
    model = PackedTower()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    structinit.init_(model, "mimetic", seed=0, example_inputs=_call())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("attns.") for n in changed)
    with torch.no_grad():
        model(*_call(3))  # another call than the example: three images
    for attn in model.attns:
        logits = attn.last_logits
        assert torch.isneginf(logits[0, 0, 0, 64:]).all()  # the tower's own mask, across images, still holds
        assert (diagonal_strength(logits) > 0.25).all()


def test_an_example_call_the_forward_does_not_take_is_named_with_the_forwards_error():
    patches, grid = _call()
    check_rejected(PackedTower(), lambda m: structinit.init_(m, "mimetic", seed=0, example_inputs=(patches[:-1], grid)),
                   ValueError, r"example_inputs: PackedTower's forward does not take it \(RuntimeError")


@pytest.mark.parametrize("given, args, kwargs", [
    (torch.ones(2), 1, 0), ((torch.ones(2), torch.zeros(1)), 2, 0), ([torch.ones(2)], 1, 0),
    ({"hidden_states": torch.ones(2)}, 0, 1),
])
def test_example_inputs_takes_a_tensor_a_tuple_or_list_of_arguments_or_a_dict_of_keywords(given, args, kwargs):
    call = as_call(given)
    assert isinstance(call, ModelCall) and len(call.args) == args and len(call.kwargs) == kwargs
    assert call.main is not None and as_call(call) is call


@pytest.mark.parametrize("given", [3, "images", {1: torch.ones(1)}, None.__class__])
def test_example_inputs_of_another_kind_is_refused_naming_the_parameter(given):
    with pytest.raises(ValueError, match=r"example_inputs=.*give a tensor"):
        as_call(given)
    check_rejected(PackedTower(), lambda m: structinit.init_(m, "mimetic", example_inputs=given),
                   ValueError, r"example_inputs=")


def test_an_image_model_that_states_no_size_is_probed_at_the_grid_given():
    """A model of images with no stated size: impulse with grid= builds its probe at that grid,
    so the write is checked in the model's own forward (the hit of its own maps)."""
    from test_adapters import GRID46, IMG46, EncoderNet

    torch.manual_seed(1)
    model = EncoderNet(batch_first=True)
    structinit.impulse_init_(model, grid=GRID46, seed=3)
    survey = structinit.adapters.survey.ModelSurvey(model, grid=GRID46)
    assert survey.attention.probed and tuple(survey.probe.shape[-2:]) == IMG46
