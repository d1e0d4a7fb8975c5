"""A transform a layer applies to its q kᵀ before the softmax is named for what it is: a
per-head temperature (not talking heads), a soft-cap and a per-key content bias (not "another
head layout"), a 2-D ALiBi bias (not a rotation). Impulse refuses each, naming it and leaving
the model as it was; mimetic, which sets only the projections, writes each and its check in
the model's own forward passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import structinit
from attention_modules import SepViT
from rejection import check_rejected
from structinit.adapters.logit_transforms import HEAD_SCALE, KEY_BIAS, LOGIT_CAP, POSITION_BIAS
from structinit.adapters.survey import ModelSurvey


class _Transformed(nn.Module):
    """Plain attention with one transform of its logits (``kind``) between q kᵀ and the softmax."""

    kind = ""

    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.temperature = nn.Parameter(torch.linspace(0.5, 2.0, heads).reshape(heads, 1, 1))
        self.u = nn.Parameter(0.1 * torch.randn(heads, dim // heads))  # small: the diagonal survives it

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) * (d // self.h) ** -0.5
        if self.kind == "temperature":
            logits = logits * self.temperature
        elif self.kind == "soft-cap":
            logits = 2.0 * torch.tanh(logits / 2.0)
        elif self.kind == "wide-cap":  # Gemma-2's cap of 50: at init, logits too small to bend (no transform seen)
            logits = 50.0 * torch.tanh(logits / 50.0)
        elif self.kind == "key-bias":  # Transformer-XL's content bias: u·k_j, the same for every query
            logits = logits + torch.einsum("hd,bhjd->bhj", self.u, k)[:, :, None, :]
        elif self.kind == "alibi":  # a 2-D ALiBi: −slope_h · |Δy| + |Δx| on the 8×8 grid, 0 on the diagonal
            cell = torch.arange(t)
            far = ((cell[:, None] // 8 - cell[None] // 8).abs() + (cell[:, None] % 8 - cell[None] % 8).abs()).float()
            logits = logits - self.temperature * far
        self.last_probs = logits.softmax(-1)
        return self.proj((self.last_probs @ v).transpose(1, 2).reshape(b, t, d))


CASES = {  # kind → (code, words impulse's refusal must name)
    "temperature": (HEAD_SCALE, r"each head's logits are its q kᵀ scaled by a factor of its own \(0\.5, 1, 1\.5, 2: "
                                r"a learned per-head temperature\), not mixed with other heads"),
    "soft-cap": (LOGIT_CAP, r"its logits pass an elementwise, order-keeping function after q kᵀ \(a soft-cap"),
    "key-bias": (KEY_BIAS, r"a logit term that depends on each key alone, the same for every query \(a per-key"),
    # 0 on the diagonal, as a rotation's change is: named for what it is, a term that does not depend on content
    "alibi": (POSITION_BIAS, r"it adds a logit term that does not depend on content \(a position bias"),
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    attn = type(f"Attn_{kind}", (_Transformed,), {"kind": kind})
    return SepViT(dim=32, heads=4, attn_cls=attn)


@pytest.mark.parametrize("kind", CASES)
def test_a_transform_of_the_logits_is_named_for_what_it_is(kind):
    code, words = CASES[kind]
    model = _model(kind)
    verdicts = ModelSurvey(model).attention.verdicts
    assert [(v.kind, v.code) for v in verdicts] == [("refused", code)] * 2, [v.reason for v in verdicts]
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"), ValueError,
                   rf"impulse cannot set the attention of layer 'blocks\.0\.attn' .*{words}.*nothing was written\. "
                   r"Use 'mimetic'")


@pytest.mark.parametrize("kind", CASES)
def test_mimetic_writes_through_a_transform_of_the_logits_and_checks_it_in_the_models_own_maps(kind):
    model = _model(kind)
    structinit.init_(model, "mimetic", seed=0)  # its check after the write reads the model's own maps
    assert structinit.get_record(model, "init")["layers"] == ["blocks.0.attn", "blocks.1.attn"]


def test_a_soft_cap_the_probe_cannot_see_before_the_write_passes_mimetics_check_by_its_diagonal():
    """A cap of 50 leaves the small logits of an init as they are, so the probe judges the layer
    plain; the larger logits mimetic writes bend under it. The check after the write finds each
    head's logits an order-keeping function of the q kᵀ written and judges the diagonal there (it
    refused Gemma-2 as "not the maps of the q kᵀ written")."""
    model = _model("wide-cap")
    assert {(v.kind, v.code) for v in ModelSurvey(model).attention.verdicts} == {("self", "")}
    structinit.init_(model, "mimetic", seed=0)
    assert structinit.get_record(model, "init")["layers"] == ["blocks.0.attn", "blocks.1.attn"]
