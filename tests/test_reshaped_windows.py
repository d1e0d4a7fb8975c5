"""Attention that takes (B, H, W, D) maps, normalises them inside, and reshapes them into
windows before its projections, with a relative position bias from a table of its own
(vit-pytorch's MaxViT). The trace reads the layer where its projection takes the windows. The
bias is a logit term that does not depend on content, which no adapter models: impulse refuses
it; mimetic, which sets only the projections, writes the layer, and its check in the model's own
forward finds the maps those of the q kᵀ written plus the term the layer added before the write.
A term made from the weights the write sets fails that check, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch
from attention_styles import _Records
from styled_vit import StyledViT
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.logit_transforms import POSITION_BIAS
from structinit.adapters.provenance import trace_attention
from structinit.adapters.survey import ModelSurvey

DIM, HEADS, SIDE = 48, 3, 4


class NormedWindows(_Records):
    """A LayerNorm of the (B, H, W, D) map, SIDE×SIDE windows cut by a reshape, one fused qkv
    Linear, an optional relative bias from an Embedding table (``bias='table'``) or one scaled by
    the norm of the qkv weight (``bias='weighted'``: a term the same for every image that a write
    of the projections changes), and the windows put back after the output projection."""

    def __init__(self, dim, heads, bias="table"):
        super().__init__()
        self.h, self.bias = heads, bias
        self.norm = nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.table = nn.Embedding((2 * SIDE - 1) ** 2, heads)
        cell = torch.stack(torch.meshgrid(torch.arange(SIDE), torch.arange(SIDE), indexing="ij")).flatten(1)
        rel = (cell[:, :, None] - cell[:, None, :] + SIDE - 1).permute(1, 2, 0)
        self.register_buffer("index", rel[..., 0] * (2 * SIDE - 1) + rel[..., 1], persistent=False)

    def forward(self, x):
        b, hh, ww, c = x.shape
        x = self.norm(x)
        win = x.view(b, hh // SIDE, SIDE, ww // SIDE, SIDE, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, SIDE * SIDE, c)
        n = win.shape[0]
        q, k, v = self.qkv(win).reshape(n, SIDE * SIDE, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) * (c // self.h) ** -0.5
        if self.bias != "none":
            bias = self.table(self.index).permute(2, 0, 1)
            logits = logits + (bias * self.qkv.weight.norm() if self.bias == "weighted" else bias)
        out = self.proj((self.keep(logits, logits.softmax(-1)) @ v).transpose(1, 2).reshape(n, SIDE * SIDE, c))
        return out.view(b, hh // SIDE, ww // SIDE, SIDE, SIDE, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, c)


def _model(bias: str = "table") -> nn.Module:
    torch.manual_seed(0)
    model = StyledViT("windows", dim=DIM, heads=HEADS)
    model.attns = nn.ModuleList(NormedWindows(DIM, HEADS, bias) for _ in model.attns)
    return model


@pytest.mark.parametrize("bias", ["none", "table"])
def test_the_trace_reads_the_windows_where_the_projection_takes_them(bias):
    attn = _model(bias).attns[0]
    ad = trace_attention(attn, (torch.randn(2, 8, 8, DIM),), {})
    assert ad.input_module is attn.qkv and (ad.num_heads, ad.head_dim) == (HEADS, DIM // HEADS)


def test_a_bias_table_of_its_own_is_a_logit_term_that_does_not_depend_on_content_and_impulse_refuses_it():
    verdicts = ModelSurvey(_model()).attention.verdicts
    assert [(v.kind, v.code) for v in verdicts] == [("refused", POSITION_BIAS)] * 2, [v.reason for v in verdicts]
    check_rejected(_model(), lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"), ValueError,
                   r"impulse cannot set the attention of layer 'attns\.0'.*a logit term that does not depend on "
                   r"content.*nothing was written")


@pytest.mark.parametrize("beta", [0.7, 0.05])
def test_mimetic_writes_it_and_the_models_own_logits_are_the_q_k_written_plus_its_own_bias(beta):
    """β 0.05: no head's written diagonal is strong enough to measure, so the check rests on the
    term alone (it refused the layer as "not the maps of the q kᵀ written" before)."""
    model = _model()
    structinit.init_(model, "mimetic", seed=0, beta=beta)
    assert structinit.get_record(model, "init")["layers"] == ["attns.0", "attns.1"]
    with torch.no_grad():
        attn, seen = model.attns[0], {}
        handle = attn.qkv.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
        model(torch.randn(1, 3, 16, 16))
        handle.remove()
        q, k, _ = attn.qkv(seen["x"]).reshape(4, SIDE * SIDE, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        written = q @ k.transpose(-2, -1) * (DIM // HEADS) ** -0.5
        own_bias = attn.table(attn.index).permute(2, 0, 1)
        torch.testing.assert_close(attn.last_logits, written + own_bias, rtol=1e-4, atol=1e-4)
        wq, wk = attn.qkv.weight[:DIM], attn.qkv.weight[DIM:2 * DIM]
        r = DIM // HEADS
        for h in range(HEADS):  # mimetic's claim on the weights: W_q W_kᵀ of each head leans to +I
            qk = wq[h * r:(h + 1) * r].T @ wk[h * r:(h + 1) * r]
            assert float(qk.diagonal().mean()) > float(qk.abs().mean()) / 2


def test_a_term_that_the_write_changes_fails_mimetics_check_and_the_model_is_left_as_it_was():
    check_rejected(_model("weighted"), lambda m: structinit.init_(m, "mimetic", seed=0, beta=0.05), ValueError,
                   r"mimetic: after the write, layer 'attns\.0' \(NormedWindows\) adds to the q kᵀ written another "
                   r"logit term than the one it added.*the write was undone")
