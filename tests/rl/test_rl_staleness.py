"""What a stale batch reports: the realised KL between the policy that sampled it and the one trained
(`behaviour_kl`), by the k3 estimator, against a loop over the model's own logits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.rl.losses import LossConfig
from logra_jax.rl.objective import make_policy_loss_fn

P, G, N = 3, 5, 4


def _batch(model, shift):
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(1, model.config.vocab_size, (N, P + G)), jnp.int32)
    lengths = np.array([5, 2, 0, 4])
    response = np.arange(G)[None, :] < lengths[:, None]
    attention = np.concatenate([np.ones((N, P), bool), response], axis=1)
    logits = np.asarray(model(tokens, attention_mask=jnp.asarray(attention)), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    logp = np.take_along_axis(logits[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0] - logz[:, :-1]
    logp = logp[:, P - 1:]  # the response tokens' log-probs under the model
    behaviour = np.where(response, logp + shift * rng.normal(size=(N, G)), 0.0)
    batch = {"tokens": tokens, "attention_mask": jnp.asarray(attention), "response_mask": jnp.asarray(response),
             "advantages": jnp.asarray(rng.normal(size=N), jnp.float32),
             "rollout_logprobs": jnp.asarray(behaviour, jnp.float32), "finished": jnp.asarray(lengths < G)}
    return batch, logp, behaviour, response


@pytest.mark.parametrize("shift", [0.0, 0.3])
def test_behaviour_kl_is_k3_of_the_trained_over_the_sampling_policy(shift):
    model = init_model(preset("tiny"))
    batch, logp, behaviour, response = _batch(model, shift)
    _, metrics = make_policy_loss_fn(LossConfig(tis_cap=2.0), P)(model, batch)
    terms = [math.exp(logp[b, t] - behaviour[b, t]) - 1 - (logp[b, t] - behaviour[b, t])
             for b in range(N) for t in range(G) if response[b, t]]
    assert float(metrics["behaviour_kl"]) == pytest.approx(np.mean(terms), rel=1e-3, abs=2e-6)
    assert (float(metrics["behaviour_kl"]) > 1e-3) == (shift > 0)  # zero when the batch is the policy's own


def test_a_batch_row_cap_reaches_the_loss():
    """batch['tis_cap'] lowers the cap of its rows' importance weights inside the objective."""
    model = init_model(preset("tiny"))
    batch, *_ = _batch(model, 0.8)
    loss_fn = jax.jit(lambda m, b: make_policy_loss_fn(LossConfig(tis_cap=2.0), P)(m, b)[1])
    graphdef, state = nnx.split(model)
    run = lambda b: loss_fn(nnx.merge(graphdef, state), b)
    plain, clipped = run(batch), run({**batch, "tis_cap": jnp.full((N,), 0.5, jnp.float32)})
    assert float(clipped["tis_weight"]) <= 0.5 + 1e-6 < float(plain["tis_weight"])
    assert float(clipped["tis_capped"]) > float(plain["tis_capped"])
