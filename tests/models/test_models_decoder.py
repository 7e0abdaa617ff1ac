"""Decoder numerics the checkpoints rely on: KV-cache decoding equals full recomputation, chunked attention
equals dense, remat changes nothing, bf16 stays close to fp32, and ModelConfig rejects bad fields by name."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import ModelConfig, preset
from logra_jax.parallel import sharding as shd

PROMPT_LENGTHS = (5, 9, 12)
STEPS = 16


@functools.partial(jax.jit, static_argnums=4)
def _forward_cached(state, tokens, cache, mask, graphdef):
    return nnx.merge(graphdef, state).forward_cached(tokens, cache, attention_mask=mask)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_kv_cache_decoding_equals_full_recomputation(padding, random_model, forward):
    config = preset("tiny")  # 4 query heads over 2 key/value heads
    model = random_model(config, seed=0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n) for n in PROMPT_LENGTHS]
    generated = rng.integers(0, config.vocab_size, (len(prompts), STEPS))
    width = max(PROMPT_LENGTHS)
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for b, prompt in enumerate(prompts):
        where = slice(width - len(prompt), width) if padding == "left" else slice(0, len(prompt))
        tokens[b, where], mask[b, where] = prompt, True

    graphdef, state = nnx.split(model)
    cache = model.init_cache(len(prompts), width + STEPS)
    prefill, cache = _forward_cached(state, jnp.asarray(tokens), cache, jnp.asarray(mask), graphdef)
    steps = []
    for t in range(STEPS):
        logits, cache = _forward_cached(state, jnp.asarray(generated[:, t:t + 1], jnp.int32), cache,
                                        jnp.ones((len(prompts), 1), bool), graphdef)
        steps.append(np.asarray(logits[:, 0]))

    # Oracle: each sequence unpadded from position 0 (trailing filler cannot reach earlier causal positions).
    full = np.zeros((len(prompts), width + STEPS), np.int32)
    for b, prompt in enumerate(prompts):
        full[b, :len(prompt) + STEPS] = np.concatenate([prompt, generated[b]])
    oracle = forward(model, full)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        np.testing.assert_allclose(np.asarray(prefill)[b][mask[b]], oracle[b, :n], atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.stack([s[b] for s in steps]), oracle[b, n:n + STEPS], atol=1e-5, rtol=0)


def test_chunked_attention_equals_dense_at_real_positions(random_model, forward, padded_batch):
    config = preset("tiny")
    dense = random_model(config)
    chunked = nnx.merge(nnx.graphdef(random_model(config.replace(attention_impl="chunked", attention_chunk=8))),
                        nnx.state(dense))
    tokens, mask = padded_batch  # 20 keys: two full chunks of 8 and a padded one
    np.testing.assert_allclose(forward(chunked, tokens, mask)[mask], forward(dense, tokens, mask)[mask],
                               atol=1e-5, rtol=0)


# XLA:CPU's default code generation (tests/conftest.py turns on the cheap one for the session): remat's equality is
# a property of the pipeline users run; under the classic loop emitters the two differ in the last bit.
DEFAULT_CPU_CODEGEN = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                       **({"xla_cpu_use_fusion_emitters": True} if shd.CPU_LOOP_EMITTERS else {})}


@functools.partial(jax.jit, static_argnums=2, compiler_options=DEFAULT_CPU_CODEGEN)
def _loss_and_grad(state, tokens, graphdef):
    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1).mean()

    return jax.value_and_grad(loss)(state)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_gives_identical_loss_and_gradient(remat, random_model, padded_batch):
    tokens = jnp.asarray(padded_batch[0])
    plain = random_model(preset("tiny"))
    rematted = nnx.merge(nnx.graphdef(random_model(preset("tiny", remat=remat))), nnx.state(plain))
    loss, grad = _loss_and_grad(nnx.state(plain), tokens, nnx.graphdef(plain))
    loss_r, grad_r = _loss_and_grad(nnx.state(rematted), tokens, nnx.graphdef(rematted))
    assert float(loss_r) == float(loss)
    for g, g_r in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_r), strict=True):
        np.testing.assert_array_equal(np.asarray(g_r), np.asarray(g))


def test_bfloat16_compute_stays_close_to_float32(random_model, forward, padded_batch, max_rel_err):
    f32 = random_model(preset("tiny"))
    bf16 = nnx.merge(nnx.graphdef(random_model(preset("tiny", dtype="bfloat16"))), nnx.state(f32))
    tokens, mask = padded_batch
    ours = forward(bf16, tokens, mask)
    assert ours.dtype == np.float32  # logits come back in fp32 whatever the compute dtype
    assert max_rel_err(ours, forward(f32, tokens, mask), where=mask) < 3e-2


@pytest.mark.parametrize("field,value", [
    ("vocab_size", 0), ("hidden_size", -4), ("num_layers", 2.5), ("num_kv_heads", True), ("head_dim", 15),
    ("num_kv_heads", 3), ("rope_theta", 0.0), ("rms_norm_eps", 1.5), ("architecture", "gpt2"),
    ("rope_scaling", "yarn"), ("dtype", "float16"), ("remat", "some"), ("attention_impl", "flash"),
])
def test_model_config_names_the_bad_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"{re.escape(field)}.*{re.escape(repr(value))}"):
        ModelConfig(**{field: value})
    with pytest.raises(ValueError, match="no field"):
        preset("tiny", hidden=3)
