"""Softmax maps with no q kᵀ to shape. A softmax the forward computes and never uses is not
attention: Hugging Face's SAM 2 softmaxes each token's heads against each other and drops the
result, beside the map it applies; left in, it made a layer with pooled queries look like
attention no adapter understands (and, where a stage has as many tokens as heads, stood in for
the layer's real map). A map whose logits project one token alone (VOLO's outlook attention) has
no queries and keys: it is named so, and told from heads mixed after q kᵀ."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.observe import observe
from structinit.adapters.provenance import TraceError, trace_attention


class PooledQueries(nn.Module):
    """SAM 2's stage change: q, k and v from one Linear over an 8×8 grid of channels-last tokens,
    then q max-pooled 2×2 (16 queries over 64 keys); and, first, each token's heads softmaxed
    against each other, the result dropped (``dead``)."""

    def __init__(self, dim=48, heads=3, dead=True):
        super().__init__()
        self.h, self.dead = heads, dead
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, hh, ww, d = x.shape
        q, k, v = self.qkv(x).reshape(b, hh * ww, 3, self.h, -1).unbind(2)
        if self.dead:
            _ = ((q * 0.25) @ k.transpose(-2, -1)).softmax(-1).to(q.dtype)  # (B, T, heads, heads), never used
        q = F.max_pool2d(q.reshape(b, hh, ww, -1).permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)
        q = q.reshape(b, -1, self.h, d // self.h).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(out.transpose(1, 2).reshape(b, hh // 2, ww // 2, d))


class TwoStages(nn.Module):
    """An 8×8 grid with a learned PE, a plain layer, then a layer with pooled queries."""

    def __init__(self, dim=48, dead=True):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.pos_embed = nn.Parameter(torch.randn(1, 8, 8, dim) * 0.02)
        self.norm0, self.norm1 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn0 = nn.MultiheadAttention(dim, 3, batch_first=True)
        self.attn1 = PooledQueries(dim, dead=dead)
        self.head = nn.Linear(dim, 10)

    def forward(self, images):
        x = self.patch(images).permute(0, 2, 3, 1) + self.pos_embed
        b, h, w, d = x.shape
        t = self.norm0(x).reshape(b, h * w, d)
        x = x + self.attn0(t, t, t, need_weights=False)[0].reshape(b, h, w, d)
        return self.head(self.attn1(self.norm1(x)).mean((1, 2)))


def test_a_map_the_forward_drops_is_not_filed_as_attention():
    model = TwoStages().eval()
    _, by_module = observe(model, torch.randn(2, 3, 16, 16))
    assert [tuple(m.probs.shape) for m in by_module[model.attn1]] == [(2, 3, 16, 64)]  # the map it applies


def test_a_layer_with_pooled_queries_and_a_dropped_map_is_left_alone_as_pooling():
    for dead in (False, True):
        torch.manual_seed(0)
        model = TwoStages(dead=dead)
        pooled, plain = model.attn1.qkv.weight.detach().clone(), model.attn0.in_proj_weight.detach().clone()
        with pytest.warns(UserWarning, match="attn1"):
            structinit.init_(model, "mimetic", seed=0)
        assert torch.equal(model.attn1.qkv.weight, pooled)  # left alone, and said so
        assert not torch.equal(model.attn0.in_proj_weight, plain)  # the plain layer written


class Outlook(nn.Module):
    """VOLO's outlook attention on a (B, T, D) sequence, in small: each token's weights over a
    window of 3 neighbours (itself and the next two, cyclically) are a Linear of the token alone."""

    def __init__(self, dim=48, heads=3, talking=False):
        super().__init__()
        self.h, self.talking = heads, talking
        self.attn, self.v, self.proj = nn.Linear(dim, heads * 9), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mix = nn.Conv2d(heads, heads, 1)  # talking heads: mixes the heads of a q kᵀ, not the projection

    def forward(self, x):
        b, t, d = x.shape
        v = torch.stack([self.v(x).roll(-i, 1) for i in range(3)], 2).reshape(b, t, 3, self.h, -1).transpose(2, 3)
        if self.talking:  # q kᵀ over the same window, heads mixed by a 1×1 convolution before the softmax
            logits = self.mix((v[..., :1, :] @ v.transpose(-2, -1)).reshape(b, t, self.h, 3).transpose(1, 2))
            logits = logits.transpose(1, 2).reshape(b, t, self.h, 1, 3).expand(-1, -1, -1, 3, -1)
        else:
            logits = self.attn(x).reshape(b, t, self.h, 3, 3)
        probs = logits.softmax(-1)  # (B, T, heads, 3, 3): square, over a token's window
        return self.proj((probs @ v)[..., 0, :].reshape(b, t, d))


def test_logits_that_project_one_token_are_named_as_no_q_k_map():
    with pytest.raises(TraceError, match=r"projection of each token alone .* no softmax\(q kᵀ\) map"):
        trace_attention(Outlook(), (torch.randn(2, 9, 48),), {})
    with pytest.raises(TraceError, match="cannot follow its softmax map back to a product of q and k"):
        trace_attention(Outlook(talking=True), (torch.randn(2, 9, 48),), {})


def test_a_model_with_outlook_attention_is_refused_naming_it_and_left_unchanged():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.outlook = nn.Linear(12, 48), Outlook()

        def forward(self, x):
            return self.outlook(self.embed(x))

    check_rejected(Net(), lambda m: structinit.init_(m, "mimetic", seed=0, example_inputs=torch.randn(2, 9, 12)),
                   ValueError, r"outlook.*no softmax\(q kᵀ\) map")
