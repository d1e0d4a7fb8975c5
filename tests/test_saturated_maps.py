"""Maps whose softmax saturates: logits of thousands at init (random weights grow so in models
whose norms do not normalise yet) with near ties, where the float32 rounding of the
recomputation moves probabilities by more than the probability tolerance while the logits agree
to the rounding of their size. Such a map is the model's own plain attention, judged and written
so, not a rotation; logits that differ off the diagonal are still another map."""

import pytest
import torch
import torch.nn.functional as F
from styled_vit import StyledViT
from torch import nn

import structinit
from structinit.adapters.survey import ModelSurvey


def test_logits_that_agree_to_their_rounding_are_the_same_map_however_saturated():
    """A map whose logits are the recomputation's to float32 rounding of their size is the same
    map even where, saturated, its probabilities differ by more than the probability tolerance;
    logits that differ off the diagonal (a rotation) are not."""
    from structinit.adapters.observe import AttentionMap
    from structinit.adapters.provenance_tokens import same_logits

    gen = torch.Generator().manual_seed(0)
    ours = torch.randn(2, 3, 9, 9, generator=gen) * 2000
    ours[..., 1] = ours[..., 0] + 0.001  # a near tie in every row
    rounded = ours * (1 + 5e-7 * torch.randn(ours.shape, generator=gen))
    probs = lambda t: t.softmax(-1)
    assert float((probs(rounded) - probs(ours)).abs().max()) > 1e-4
    as_map = lambda t: AttentionMap(probs=probs(t), logits=t, source="softmax")
    assert same_logits(ours, [as_map(rounded)], torch.float32)
    rotated = ours + (1 - torch.eye(9)) * 0.5
    assert not same_logits(ours, [as_map(rotated)], torch.float32)


class _Float64Logits(nn.Module):
    """Raw-Parameter attention whose logits are computed in float64 and rounded to float32 before
    the softmax: the recomputation in float32 rounds them otherwise."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.w_in = nn.Parameter(torch.randn(3 * dim, dim) * dim**-0.5)
        self.w_out = nn.Parameter(torch.randn(dim, dim) * dim**-0.5)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x.double(), self.w_in.double()).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = ((q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5).float()
        return F.linear((logits.softmax(-1) @ v.float()).transpose(1, 2).reshape(b, t, d), self.w_out)


@pytest.mark.parametrize("seed", range(3))
def test_a_map_whose_large_logits_saturate_its_softmax_is_judged_on_its_logits(seed):
    """Logits of a few thousand (random weights grow so at init in models whose norms do not
    normalise yet, Visformer's last stage) and tokens in near-identical pairs: rows whose two largest
    logits nearly tie, whose probabilities the float32 rounding of the recomputation moves by more
    than 1e-4 while the logits agree to about 1e-7 of their size. Plain attention, judged and
    written so; it was taken for a rotation."""
    torch.manual_seed(seed)
    model = StyledViT("raw-linear")
    model.attns = nn.ModuleList(_Float64Logits(48, 3) for _ in range(2))
    with torch.no_grad():
        model.patch.weight.zero_()
        model.pos_embed[0, 1::2] = model.pos_embed[0, 0::2] + 1e-6 * torch.randn(32, 48)
        for attn in model.attns:
            attn.w_in[:96] *= 40
    survey = ModelSurvey(model)
    assert [v.kind for v in survey.attention.verdicts] == ["self", "self"]
    structinit.init_(model, "mimetic", seed=0)  # checked in the model's own forward
