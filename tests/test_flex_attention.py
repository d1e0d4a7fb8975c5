"""Attention computed by ``flex_attention``: found, traced to its own parameters and written by
both schemes, each write judged by the maps flex_attention itself computes; its masks and
``score_mod`` read as what they are; and torch left as it was. Grouped queries and a causal mask
are judged the same through ``scaled_dot_product_attention``."""

import pytest
import torch
from flex_models import FlexViT, causal, distance_bias, flex_attention

import structinit
from rejection import check_rejected
from structinit.adapters.traced import TracedAdapter
from structinit.functional.targets import target_index
from structinit.schemes.checks import diagonal_strength

pytestmark = [pytest.mark.skipif(flex_attention is None, reason="this torch has no flex_attention"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


def _model(seed=0, **attention):
    torch.manual_seed(seed)
    return FlexViT(**attention).eval()


def _images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_flex_attention_layers_are_found_and_read_from_their_own_parameters():
    model = _model()
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["attns.0", "attns.1"]
    for (_, ad), attn in zip(layers, model.attns):
        assert (ad.num_heads, ad.head_dim, ad.dim) == (3, 16, 48)
        owned = {p.untyped_storage().data_ptr() for p in attn.parameters()}
        assert all(w.untyped_storage().data_ptr() in owned for w, _ in ad.linear_views().values())


def test_a_flex_layer_no_adapter_names_is_traced():
    model = _model()
    for attn in model.attns:  # names no adapter knows: only what the forward computes is left
        attn.a, attn.b, attn.c = attn.q, attn.kv, attn.proj
        del attn.q, attn.kv, attn.proj
        attn.forward = _renamed_forward(attn)
    layers = structinit.find_attention_layers(model)
    assert all(isinstance(ad, TracedAdapter) for _, ad in layers) and len(layers) == 2


def _renamed_forward(attn):
    def forward(x):
        b, t, d = x.shape
        q = attn.a(x).reshape(b, t, attn.heads, attn.r).transpose(1, 2)
        k, v = attn.b(x).reshape(b, t, 2, attn.kv_heads, attn.r).permute(2, 0, 3, 1, 4)
        attn.seen = (q.detach(), k.detach(), None)
        return attn.c(attn._attend(q, k, v, None).transpose(1, 2).reshape(b, t, d))
    return forward


def test_impulse_through_flex_attention_hits_its_targets_in_flexs_own_maps():
    model = _model()
    structinit.init_(model, "impulse", seed=0)
    with torch.no_grad():
        for norm, attn in zip(model.norms, model.attns):
            attn(norm(model.pos_embed))  # the position-only input: the class token's row, then the grid's
            probs = attn.own_maps()[0, :, 1:]  # (heads, 64 grid queries, 65 keys), as flex computes them
            for h, offset in enumerate(attn.structinit_impulse["offsets"]):
                target = target_index((8, 8), offset)
                rows = torch.nonzero(target >= 0).squeeze(1)
                hit = (probs[h, rows].argmax(-1) == target[rows] + 1).float().mean()  # key 0 is the class token
                assert hit == 1.0, (h, offset, float(hit))


def _own_logits(attn, attention):
    """Flex's own log-probabilities (−∞ where its mask closes a pair), less the bias its score_mod
    adds: q kᵀ·scale up to a constant per row."""
    logits = attn.own_maps().log()
    if "score_mod" in attention:
        t = logits.shape[-1]
        idx = torch.arange(t)
        heads = torch.arange(logits.shape[1])[:, None, None]
        logits = logits - attention["score_mod"](torch.zeros(()), 0, heads, idx[:, None], idx[None])
    return logits


@pytest.mark.parametrize("attention", [
    {}, {"heads": 4, "kv_heads": 2}, {"mask_mod": causal}, {"score_mod": distance_bias},
    {"heads": 4, "kv_heads": 2, "kernel": "sdpa"}, {"mask_mod": causal, "kernel": "sdpa"}, {"lse": True},
], ids=["plain", "grouped", "causal", "bias", "sdpa-grouped", "sdpa-causal", "with-lse"])
def test_mimetic_through_flex_attention_shows_in_flexs_own_logits(attention):
    model = _model(**attention)
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_images())
    for attn in model.attns:  # q kᵀ ≈ αZ + βI: each token's own logit stands out
        assert (diagonal_strength(_own_logits(attn, attention)) > 0.25).all()
    before = _model(**attention)
    with torch.no_grad():
        before(_images())
    assert not (diagonal_strength(_own_logits(before.attns[0], attention)) > 0.25).all()


@pytest.mark.parametrize(("attention", "words"), [
    ({"mask_mod": causal}, "the layer is causal"),
    ({"score_mod": distance_bias}, "a logit term that does not depend on content"),
    ({"heads": 4, "kv_heads": 2}, "grouped-query attention"),
    ({"mask_mod": causal, "kernel": "sdpa"}, "the layer is causal"),  # a mask it builds: read off its maps
    ({"heads": 4, "kv_heads": 2, "kernel": "sdpa"}, "grouped-query attention"),  # q and kv: not q, k, v
], ids=["causal", "bias", "grouped", "sdpa-causal", "sdpa-grouped"])
def test_what_impulse_cannot_shape_through_flex_is_named_and_the_model_left_as_it_was(attention, words):
    check_rejected(_model(**attention), lambda m: structinit.init_(m, "impulse", seed=0), ValueError, words)


def test_torchs_own_cpu_check_on_flex_attention_is_back_after_an_init():
    structinit.init_(_model(), "mimetic", seed=0)  # the trace lifts it for the calls it records
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q.detach(), q.detach())
