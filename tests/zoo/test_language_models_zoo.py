"""Mimetic on the language models of transformers, built small and with no hints: GPT-2 (its
``Conv1D`` projections), Llama with grouped-query attention and rotary positions, Qwen2, BERT.
Each is probed with token ids; the claim is checked on the attention probabilities the model
returns itself (``output_attentions``, eager attention)."""

import pytest
import torch

import structinit
from structinit.schemes.checks import diagonal_strength

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=97, max_position_embeddings=32)
CONFIGS = {
    "gpt2": dict(n_embd=48, n_layer=2, n_head=3, vocab_size=97, n_positions=32),
    "llama": dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, **SMALL),
    "qwen2": dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                  intermediate_size=96, **SMALL),
    "bert": dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, **SMALL),
}


def _build(kind: str, implementation: str):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, **CONFIGS[kind])
    config._attn_implementation = implementation
    auto = transformers.AutoModel if kind == "bert" else transformers.AutoModelForCausalLM
    return auto.from_config(config).eval()


def _own_log_probs(model) -> list[torch.Tensor]:
    ids = torch.randint(97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        maps = model(ids, output_attentions=True).attentions
    return [m.float().log() for m in maps]  # masked keys: log 0 = −∞, left out of the strength


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", CONFIGS)
def test_mimetic_on_a_language_model_shows_in_the_maps_it_returns(kind, implementation):
    model = _build(kind, implementation)
    before = [diagonal_strength(m) for m in _own_log_probs(_build(kind, "eager"))]
    structinit.init_(model, "mimetic", seed=0)
    model.config._attn_implementation = "eager"  # attentions are returned by the eager path only
    for was, now in zip(before, [diagonal_strength(m) for m in _own_log_probs(model)]):
        assert (now > 1.0).all() and not (was > 1.0).all(), (was, now)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_impulse_on_a_language_model_is_refused_with_why(kind):
    with pytest.raises(ValueError, match=r"reads token ids|share 2 key/value heads"):
        structinit.init_(_build(kind, "sdpa"), "impulse", seed=0)


BART = dict(vocab_size=97, d_model=48, encoder_layers=1, decoder_layers=1, encoder_attention_heads=3,
            decoder_attention_heads=3, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=32)


@pytest.mark.parametrize("head", ["BartForConditionalGeneration", "BartForCausalLM"])
def test_mimetic_on_bart_writes_self_attention_and_leaves_cross_attention_alone(head):
    """The full encoder–decoder's cross-attention reads the encoder's output; the causal-LM
    decoder's is never called. Either way it is left alone, bit for bit, and named; the encoder's
    and decoder's self-attention show the diagonal in the maps the model returns."""
    torch.manual_seed(0)
    config = transformers.BartConfig(**BART, attn_implementation="eager")
    model = getattr(transformers, head)(config).eval()
    cross = {k: v.clone() for k, v in model.model.decoder.layers[0].encoder_attn.state_dict().items()}
    with pytest.warns(UserWarning, match=r"left alone: model\.decoder\.layers\.0\.encoder_attn \((cross-attention: "
                                         r"its keys are projected from other tokens|BartAttention: not called)"):
        structinit.init_(model, "mimetic", seed=0)
    written = structinit.get_record(model, "init")["layers"]
    assert written == [*(["model.encoder.layers.0.self_attn"] if head.endswith("Generation") else []),
                       "model.decoder.layers.0.self_attn"]
    assert all(torch.equal(v, cross[k]) for k, v in model.model.decoder.layers[0].encoder_attn.state_dict().items())
    ids = torch.randint(97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    maps = [*out.encoder_attentions, *out.decoder_attentions] if head.endswith("Generation") else out.attentions
    assert all((diagonal_strength(m.float().log()) > 1.0).all() for m in maps)
