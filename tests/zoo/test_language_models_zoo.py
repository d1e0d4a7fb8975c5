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
