"""Chunked token log-probs: equal to the dense computation (values, entropies, gradients), bounded memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.rl.logprobs import sequence_logprobs, token_logprobs


def _dense(hidden, head, targets, temperature=1.0):
    z = jnp.einsum("btd,dv->btv", hidden, head) / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _inputs(B=3, T=7, D=16, V=50, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (B, T, D)), jax.random.normal(k2, (D, V)) * 0.5,
            jax.random.randint(k3, (B, T), 0, V))


@pytest.mark.parametrize("chunk, temperature", [(1, 1.0), (5, 0.7), (21, 1.0), (1000, 0.7)])
def test_values_match_dense(chunk, temperature):
    h, w, y = _inputs()
    np.testing.assert_allclose(token_logprobs(h, w, y, temperature=temperature, chunk=chunk),
                               _dense(h, w, y, temperature), rtol=1e-5, atol=1e-5)


def test_entropy_matches_numpy():
    h, w, y = _inputs(seed=1)
    logp, entropy = token_logprobs(h, w, y, temperature=0.8, chunk=4, with_entropy=True)
    z = np.einsum("btd,dv->btv", np.asarray(h, np.float64), np.asarray(w, np.float64)) / 0.8
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(entropy, -(p * np.log(p)).sum(-1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logp, np.log(np.take_along_axis(p, np.asarray(y)[..., None], -1)[..., 0]),
                               rtol=1e-4, atol=1e-5)


def test_gradients_match_dense():
    h, w, y = _inputs(seed=2)
    weights = jax.random.normal(jax.random.key(9), y.shape)
    chunked = jax.grad(lambda h, w: (weights * token_logprobs(h, w, y, temperature=0.9, chunk=5)).sum(),
                       argnums=(0, 1))(h, w)
    dense = jax.grad(lambda h, w: (weights * _dense(h, w, y, 0.9)).sum(), argnums=(0, 1))(h, w)
    for a, b in zip(chunked, dense):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bf16_hidden_accumulates_in_float32():
    h, w, y = _inputs(seed=3)
    got = token_logprobs(h.astype(jnp.bfloat16), w, y, chunk=4)
    assert got.dtype == jnp.float32
    ref = _dense(h.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), y)
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)


def _temp_bytes(fn, B, T, D, V):
    args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32))
    step = jax.jit(jax.value_and_grad(lambda h, w, y: fn(h, w, y).sum(), argnums=(0, 1)))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_compiled_temp_bytes_stay_bounded_as_vocab_and_tokens_grow():
    chunked = lambda h, w, y: token_logprobs(h, w, y, chunk=64)
    B, T, D, V = 4, 256, 32, 512
    dense_small, dense_big = _temp_bytes(_dense, B, T, D, V), _temp_bytes(_dense, B, T, D, 4 * V)
    small, big = _temp_bytes(chunked, B, T, D, V), _temp_bytes(chunked, B, T, D, 4 * V)
    # The dense path holds [B, T, V] logits (and their cotangent): its growth is ≥ B·T·3V float32.
    assert dense_big - dense_small >= B * T * 3 * V * 4
    assert big - small < 0.1 * (dense_big - dense_small)
    assert big < B * T * 4 * V * 4 / 4
    # More tokens at a fixed vocabulary: the chunked temp does not scale with B·T·V.
    longer = _temp_bytes(chunked, B, 4 * T, D, V)
    assert longer - small < 0.1 * (B * 3 * T * V * 4)


def test_sequence_logprobs_match_the_model_forward():
    graphdef, state = nnx.split(init_model(preset("tiny")))
    tokens = jnp.array([[0, 0, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42]])
    mask = tokens > 0

    @jax.jit
    def both(state):
        model = nnx.merge(graphdef, state)
        return (sequence_logprobs(model, tokens, mask, temperature=0.5, chunk=3, with_entropy=True),
                model(tokens, attention_mask=mask))

    (logp, entropy), logits = both(state)
    logits = logits[:, :-1] / 0.5
    expected = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(logp, expected, rtol=1e-5, atol=1e-5)
    assert logp.shape == entropy.shape == (2, 5)


def test_validation():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(h, w, y[:, :-1])
    with pytest.raises(ValueError, match="head"):
        token_logprobs(h, w.T, y)
    with pytest.raises(ValueError, match="chunk"):
        token_logprobs(h, w, y, chunk=0)
