"""Mimetic on language models whose attention no adapter names: nanoGPT's fused ``c_attn`` (a
causal mask as a buffer, or scaled_dot_product_attention's ``is_causal``) and Llama-style
grouped-query attention with rotary positions. The probe is a sequence of token ids; every
claim is checked on the module's own forward (the logits it records itself)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from language_models import (
    AlibiAttention,
    GroupedRotaryAttention,
    SinkAttention,
    TinyEncoder,
    TinyGPT,
    TinySeq2Seq,
    TwoNormAttention,
)

import structinit
from rejection import check_rejected
from structinit.adapters.observe import AttentionMap
from structinit.adapters.traced import TracedAdapter
from structinit.functional.attention import kept_keys
from structinit.functional.mimetic import mimetic_qk, mimetic_qk_grouped
from structinit.schemes.checks import diagonal_strength


def _ids(n=4, t=16):
    return torch.randint(97, (n, t), generator=torch.Generator().manual_seed(1))


def _gqa_gpt(sdpa=False):
    torch.manual_seed(0)
    return TinyGPT(dim=48, attn=lambda: GroupedRotaryAttention(48, 4, 2, sdpa=sdpa))


MODELS = {"nanogpt-masked": lambda: TinyGPT(flash=False), "nanogpt-flash": lambda: TinyGPT(flash=True),
          "gqa-rope": _gqa_gpt, "gqa-rope-sdpa": lambda: _gqa_gpt(sdpa=True)}


def _vo_product(attn, dim=48):
    """W_v W_o as the module's own forward applies it: its output on identical tokens (every
    head's map averages equal values), less its output at 0."""
    def run(u):
        return attn(u.reshape(1, 1, dim).expand(1, 8, dim))[0, -1]
    with torch.no_grad():
        zero = run(torch.zeros(dim))
        return torch.stack([run(e) - zero for e in torch.eye(dim)])


@pytest.mark.parametrize("name", MODELS)
def test_mimetic_on_a_language_model_shows_in_its_own_causal_logits_and_values(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    layers = structinit.find_attention_layers(model)
    assert all(isinstance(ad, TracedAdapter) and ad.causal for _, ad in layers)
    grouped = name.startswith("gqa")
    assert all((ad.kv_heads, ad.kv_of) == ((2, (0, 0, 1, 1)) if grouped else (3, (0, 1, 2))) for _, ad in layers)
    with torch.no_grad():
        model(_ids())
    assert not (diagonal_strength(model.h[0].attn.last_logits) > 1.0).all()  # the default init has no diagonal
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_ids())
    for block in model.h:
        logits = block.attn.last_logits  # the module's own, its causal mask in place
        assert torch.isneginf(logits[0, 0, 0, 1:]).all()
        assert (diagonal_strength(logits) > 1.0).all()
        assert float(_vo_product(block.attn).diagonal().mean()) == pytest.approx(-0.4, abs=0.1)


@pytest.mark.parametrize("first", [False, True])
def test_mimetic_writes_attention_with_sinks_and_its_own_logits_show_the_diagonal(first):
    """A sink's column, dropped after the softmax, is no key of a token: the layer is causal
    self-attention over its tokens (not cross-attention over one key more), its map the q kᵀ's
    with each row scaled by what the sink leaves (it was left alone as such)."""
    torch.manual_seed(0)
    model = TinyGPT(dim=48, attn=lambda: SinkAttention(48, 4, 2, first=first))
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["h.0.attn", "h.1.attn"] and all(ad.causal for _, ad in layers)
    structinit.init_(model, "mimetic", seed=0)
    assert structinit.get_record(model, "init")["layers"] == ["h.0.attn", "h.1.attn"]
    with torch.no_grad():
        model(_ids())
    for block in model.h:
        assert (diagonal_strength(block.attn.last_logits) > 1.0).all()  # the module's own q kᵀ, before its sink
        assert float(block.attn.last_probs.sum(-1).max()) < 1.0  # the sink still takes its share of each row


@pytest.mark.parametrize("first", [False, True])
def test_a_sink_switched_off_leaves_the_kept_logits_finite_and_as_they_were(first):
    """A sink at −∞ in some heads (switched off) takes no share of their rows: their kept logits
    stay as the softmax saw them, where a shift by its log-sum-exp would make them +∞."""
    logits = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    sink = torch.tensor([float("-inf"), 0.5, float("-inf")]).reshape(1, 3, 1, 1).expand(2, 3, 5, 1)
    joined = torch.cat([sink, logits] if first else [logits, sink], -1)
    amap = AttentionMap(joined.softmax(-1), joined, "softmax")
    amap.drop_keys(slice(1, 6) if first else slice(0, 5))
    assert amap.sinks == 1 and amap.probs.shape == logits.shape and torch.isfinite(amap.logits).all()
    assert torch.equal(amap.logits[:, [0, 2]], logits[:, [0, 2]])
    assert torch.allclose(amap.logits[:, 1], logits[:, 1] - 0.5)  # read against the sink's logit


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(2, 9), st.integers(1, 3), st.booleans())
def test_the_key_columns_a_map_keeps_are_found_only_where_its_first_or_last_are_cut_off(heads, t, sinks, first):
    probs = torch.rand(2, heads, t, t + sinks, generator=torch.Generator().manual_seed(t)).softmax(-1)
    cols = slice(sinks, t + sinks) if first else slice(0, t)
    assert kept_keys(probs, probs[..., cols]) == cols
    assert kept_keys(probs, probs[..., cols] * 1.5) is None  # not the map's own columns
    assert kept_keys(probs, probs[..., 1:-1]) is None  # columns cut from both ends: no sinks at one end
    assert kept_keys(probs, probs[..., :t - 1, :t]) is None  # queries cut too


def test_mimetic_reads_q_k_past_a_bias_baddbmm_adds_and_heads_regrouped_around_the_softmax():
    """Bloom's layout (:class:`AlibiAttention`): the trace lost the logits at the view around the
    softmax and did not take q and k given to ``baddbmm`` by keyword; then it took the ALiBi bias
    the product adds for part of q kᵀ. Mimetic writes it, and the model's own logits less that
    bias show the diagonal under the causal mask."""
    torch.manual_seed(0)
    model = TinyGPT(dim=48, attn=lambda: AlibiAttention(48, 3))
    layers = structinit.find_attention_layers(model)
    assert [n for n, _ in layers] == ["h.0.attn", "h.1.attn"]
    assert all(isinstance(ad, TracedAdapter) and ad.causal and ad.num_heads == 3 for _, ad in layers)
    structinit.init_(model, "mimetic", seed=0)
    with torch.no_grad():
        model(_ids())
    for block in model.h:
        logits = block.attn.last_logits - block.attn.last_bias  # the q kᵀ part of its own logits
        assert torch.isneginf(logits[0, 0, 0, 1:]).all()
        assert (diagonal_strength(logits) > 1.0).all()
        assert float(_vo_product(block.attn).diagonal().mean()) == pytest.approx(-0.4, abs=0.1)


def test_mimetic_on_an_encoder_decoder_leaves_its_cross_attention_alone_and_says_so():
    """The decoder's cross-attention projects its keys from the encoder's output, as many tokens
    as its own: no self-attention to shape. It is left alone, bit for bit, and named; the encoder's
    and the decoder's self-attention are written, and their own logits show the diagonal."""
    torch.manual_seed(0)
    model = TinySeq2Seq()
    cross = {k: v.clone() for k, v in model.encoder_attn.state_dict().items()}
    with pytest.warns(UserWarning, match=r"left alone: encoder_attn \(cross-attention: its keys are projected "
                                         r"from other tokens than its queries"):
        structinit.init_(model, "mimetic", seed=0)
    assert structinit.get_record(model, "init")["layers"] == ["encoder_attn_self", "self_attn"]
    assert all(torch.equal(v, cross[k]) for k, v in model.encoder_attn.state_dict().items())
    with torch.no_grad():
        model(_ids())
    for attn in (model.encoder_attn_self, model.self_attn):
        assert (diagonal_strength(attn.last_logits) > 1.0).all()
    assert torch.isneginf(model.self_attn.last_logits[0, 0, 0, 1:]).all()  # the decoder's causal mask kept


def test_keys_read_through_another_norm_are_still_self_attention_not_cross_attention():
    """Only a layer that neither its adapter nor the trace reads is called cross-attention for
    keys projected from other tensors than its queries: q and k behind norms of their own read
    the same tokens, and such a layer is refused for what the adapter misreads, not left alone."""
    torch.manual_seed(0)
    message = check_rejected(TinyEncoder(TwoNormAttention(48, 3)), lambda m: structinit.init_(m, "mimetic", seed=0),
                             ValueError, r"layer 'attn' .*its q kᵀ is not that of the projections")
    assert "cross-attention" not in message


@pytest.mark.parametrize(("name", "options", "words"), [
    ("nanogpt-masked", {}, "reads token ids, a 1-D sequence"),
    ("gqa-rope", {}, "reads token ids, a 1-D sequence"),
    ("gqa-rope", {"grid": (4, 4)}, "share 2 key/value heads"),  # ids said to be a 4×4 image: the groups refuse
])
def test_impulse_on_a_language_model_is_refused_with_why_and_writes_nothing(name, options, words):
    check_rejected(MODELS[name](), lambda m: structinit.init_(m, "impulse", seed=0, **options), ValueError, words)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([4, 8]), st.sampled_from(["uniform", "circular"]))
def test_grouped_mimetic_products_are_the_best_for_their_shared_keys(groups, size, r, noise):
    """Wq[h] Wk[g]ᵀ is M_h projected on Wk[g]'s span (the least-squares best for that key), that
    span the group's best common one; a group of one gives the ungrouped truncation."""
    dim, kv_of = 24, tuple(g for g in range(groups) for _ in range(size))
    wq, wk = mimetic_qk_grouped(dim, kv_of, r, noise=noise, generator=torch.Generator().manual_seed(3))
    _, _, m = mimetic_qk(dim, len(kv_of), r, noise=noise, generator=torch.Generator().manual_seed(3))
    for h, g in enumerate(kv_of):
        basis = torch.linalg.qr(wk[g]).Q
        torch.testing.assert_close(wq[h] @ wk[g].T, m[h] @ basis @ basis.T)
        if size == 1:  # the rank-r truncation of M_h itself
            u, s, vh = torch.linalg.svd(m[h])
            torch.testing.assert_close(wq[h] @ wk[g].T, u[:, :r] * s[:r] @ vh[:r])
    members = [h for h in range(len(kv_of)) if kv_of[h] == 0]
    captured = sum(float((m[h] @ torch.linalg.qr(wk[0]).Q).norm() ** 2) for h in members)
    other = torch.linalg.qr(torch.randn(dim, r, generator=torch.Generator().manual_seed(5), dtype=torch.float64)).Q
    assert captured >= sum(float((m[h] @ other).norm() ** 2) for h in members)
