"""One loss normalisation whatever the microbatching: the same RL batch split into 1, 2 or 4 microbatches gives
the same loss and the same dense gradients / sketches, for every aggregation mode (the batch's rows hold very
different numbers of response tokens, as RL rollouts always do)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec, scale_by_sketch
from logra_jax.optim.lowrank import LowRankUpdate
from logra_jax.optim.targets import DEFAULT_TARGET_RULES, find_targets
from logra_jax.rl.losses import AGGREGATIONS, LossConfig
from logra_jax.rl.objective import make_policy_loss_fn

P, G, N = 4, 6, 8  # prompt length, response length, responses


def _rl_batch(seed=0, vocab=128):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (N, P + G))
    attention = np.ones((N, P + G), bool)
    attention[1, :2] = False  # left-padded prompts
    attention[5, :1] = False
    # Response lengths 1..6 spread unevenly over the rows (microbatch m holds rows m, m + M, ...), one empty.
    lengths = np.array([6, 1, 2, 6, 0, 5, 1, 3])
    response = np.arange(G)[None, :] < lengths[:, None]
    attention[:, P:] &= response
    return {"tokens": jnp.asarray(tokens, jnp.int32), "attention_mask": jnp.asarray(attention),
            "response_mask": jnp.asarray(response), "advantages": jnp.asarray(rng.normal(size=N), jnp.float32),
            "rollout_logprobs": jnp.asarray(-rng.uniform(0.5, 3.0, (N, G)), jnp.float32),
            "finished": jnp.asarray(lengths < G)}


def _step_outputs(mode, aggregation, microbatches):
    model = init_model(preset("tiny"))
    targets = None
    spec = SketchSpec(rank=4)
    if mode == "sketch_native":
        targets = attach_sketch_probes(model, spec)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = make_policy_loss_fn(LossConfig(policy="ppo", tis_cap=2.0, aggregation=aggregation), P)
    # sketch-native mode: scale_by_sketch passes the step's sketches through unchanged (and holds the spec)
    tx = scale_by_sketch(spec=spec) if targets else optax.identity()
    step = make_train_step(graphdef, loss_fn, tx, mode=mode, microbatches=microbatches, return_updates=True)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    _, metrics, updates = jax.jit(step)(state, rest, _rl_batch())
    leaves = jax.tree.leaves(updates, is_leaf=lambda x: isinstance(x, LowRankUpdate))
    grads = [np.asarray(u.factor if isinstance(u, LowRankUpdate) else u) for u in leaves]
    return float(metrics["loss"]), grads, float(metrics["loss_denominator"])


@pytest.mark.parametrize("mode", ["dense", "sketch_native"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_rl_step_independent_of_microbatches(mode, aggregation):
    loss_1, grads_1, den_1 = _step_outputs(mode, aggregation, 1)
    # The whole batch's normaliser, computed here from the masks (rows 0..7 with lengths above).
    lengths = np.array([6, 1, 2, 6, 0, 5, 1, 3])
    expected_den = {"token_mean": lengths.sum(), "seq_mean": (lengths > 0).sum(),
                    "seq_mean_token_sum_norm": N * G}[aggregation]
    assert den_1 == expected_den
    assert abs(loss_1) > 1e-3 and len(grads_1) > 0
    if mode == "sketch_native":
        assert len(grads_1) == len(find_targets(nnx.state(init_model(preset("tiny")), nnx.Param),
                                                DEFAULT_TARGET_RULES))
    for microbatches in (2, 4):
        loss_m, grads_m, den_m = _step_outputs(mode, aggregation, microbatches)
        assert den_m == den_1
        assert abs(loss_m - loss_1) <= 1e-5 * abs(loss_1), (microbatches, loss_m, loss_1)
        for g1, gm in zip(grads_1, grads_m, strict=True):
            norm = np.linalg.norm(g1)
            assert norm > 0
            assert np.linalg.norm(gm - g1) <= 1e-5 * norm, (microbatches, np.linalg.norm(gm - g1) / norm)


def test_next_token_loss_is_a_global_token_mean():
    """SFT's loss: a token mean over the whole batch, however it is split (rows with 1..7 target tokens)."""
    model = init_model(preset("tiny"))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(1, 128, (4, 8)), jnp.int32)
    loss_mask = jnp.asarray(np.arange(8)[None, :] >= np.array([1, 6, 7, 3])[:, None])
    batch = {"tokens": tokens, "attention_mask": jnp.ones_like(tokens, bool), "loss_mask": loss_mask}
    state = TrainState(params, optax.identity().init(params), jnp.zeros((), jnp.int32))
    outs = [jax.jit(make_train_step(graphdef, next_token_loss, optax.identity(), microbatches=m,
                                    return_updates=True))(state, rest, batch) for m in (1, 2, 4)]
    # The reference: the whole batch's token mean, from per-token NLL of the plain model.
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    mask = np.asarray(loss_mask)[:, 1:]
    reference = (nll * mask).sum() / mask.sum()
    for _, metrics, updates in outs:
        assert abs(float(metrics["loss"]) - reference) <= 1e-5 * reference
        for a, b in zip(jax.tree.leaves(outs[0][2]), jax.tree.leaves(updates), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
