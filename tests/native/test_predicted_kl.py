"""Predicted-KL step control: the quadratic term, the factored JVP probe, the controller, sharding, checkpoints."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax.job.checkpoint import CheckpointManager
from logra_jax.job.train_step import next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.kl_probe import kl_quadratic, make_kl_probe, predicted_and_realised_kl
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec, logra
from logra_jax.optim.predicted_kl import kl_budget_schedule, scale_by_predicted_kl


def _np_kl(z, z2):
    """Exact KL(softmax z ‖ softmax z2) in float64 numpy."""
    lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    lq = z2 - np.log(np.exp(z2 - z2.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z2.max(-1, keepdims=True)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_quadratic_term_equals_exact_kl_for_small_steps(temperature):
    rng = np.random.default_rng(0)
    z = rng.normal(scale=3.0, size=(6, 40))
    dz = rng.normal(size=(6, 40))
    q = np.asarray(kl_quadratic(jnp.asarray(z, jnp.float32), jnp.asarray(dz, jnp.float32), temperature))
    alpha = 1e-4
    exact = _np_kl(z / temperature, (z + alpha * dz) / temperature) / alpha**2
    np.testing.assert_allclose(q, exact, rtol=2e-4)
    # Finite differences of the exact KL in α: d²KL/dα² at 0 = 2q (central difference, float64).
    h = 1e-3
    fd = (_np_kl(z / temperature, (z + h * dz) / temperature) + _np_kl(z / temperature, (z - h * dz) / temperature)) / (
        2 * h * h)
    np.testing.assert_allclose(q, fd, rtol=1e-4)
    # Adding a constant to every logit's tangent changes nothing (softmax shift invariance).
    q_shift = np.asarray(kl_quadratic(jnp.asarray(z, jnp.float32), jnp.asarray(dz + 5.0, jnp.float32), temperature))
    np.testing.assert_allclose(q_shift, q, rtol=1e-4)


def _setup(seed=1, rank=8, model_preset="tiny"):
    model = init_model(preset(model_preset), seed=seed)
    spec = SketchSpec(rank=rank)
    attach_sketch_probes(model, spec)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = jax.random.randint(jax.random.key(0), (4, 16), 0, 128)
    batch = dict(tokens=toks, attention_mask=jnp.ones_like(toks), loss_mask=jnp.ones_like(toks))
    probe = dict(tokens=toks[:2], attention_mask=jnp.ones_like(toks[:2]),
                 kl_mask=jnp.ones_like(toks[:2]).at[:, :4].set(0))
    grads = jax.jit(jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    return graphdef, params, rest, grads, probe


def _first_update(tx, grads, params):
    """tx's first update from a fresh state, as one program (op by op, the optimizer compiles ~100 small ones)."""
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)


# The Gemma 3 layout: the probe's JVP runs through q/k norms, (1 + w) and post norms, GeGLU and the
# sliding window (16 tokens, window 8).
@pytest.mark.parametrize("model_preset", ["tiny", "tiny-gemma3"])
def test_predicted_matches_realised_kl_on_tiny_model(model_preset):
    graphdef, params, rest, grads, probe = _setup(model_preset=model_preset)
    # A small step (KL ≈ 1e-5 per token: quadratic regime) yet well above the fp32 noise floor of the realised KL
    # (≈ 1e-7 per token; at ratio 1e-3, KL ≈ 1e-6, that noise alone moves the ratio by a few %).
    tx = logra(rank=8, update_ratio=3e-3, round_bf16=False)
    updates, _ = _first_update(tx, grads, params)
    q, realised = jax.jit(lambda p, u: predicted_and_realised_kl(graphdef, p, rest, jnp.int32(0), u, probe))(
        params, updates)
    assert float(q) > 1e-6
    assert abs(float(realised) / float(q) - 1) < 0.03, (float(q), float(realised))


def test_finite_differences_of_logits_match_the_factored_jvp():
    """δz from the probe equals (z(W + εΔW) − z(W − εΔW)) / 2ε with ΔW applied densely."""
    graphdef, params, rest, grads, probe = _setup(seed=2)
    tx = logra(rank=8, update_ratio=1e-2, round_bf16=False)
    updates, _ = _first_update(tx, grads, params)
    from logra_jax.optim.lowrank import apply_updates
    eps = 0.5
    scale = lambda s: jax.tree.map(lambda x: x * s if x.dtype == jnp.float32 else x, updates)
    z = lambda p: nnx.merge(graphdef, p, rest)(probe["tokens"])
    fd = (z(apply_updates(params, scale(eps))) - z(apply_updates(params, scale(-eps)))) / (2 * eps)
    # The probe's prediction of Σq from the same tangent: compare q(δz_fd) with the probe's q.
    q_fd = kl_quadratic(z(params), fd)
    mask = probe["kl_mask"].astype(jnp.float32)
    q_fd = float(jnp.sum(q_fd * mask) / mask.sum())
    q_sum, count = make_kl_probe(graphdef, params, rest, jnp.int32(0), probe)(updates)
    assert abs(float(q_sum / count) / q_fd - 1) < 1e-2


def test_controller_alpha_budget_skip_and_mismatch():
    tx = scale_by_predicted_kl(kl_budget=2e-4, kl_budget_final=2e-5, schedule_steps=300, alpha_max=3.0,
                               subtract_mismatch=True, mismatch_weight=0.3, mismatch_floor=0.5)
    updates = {"w": jnp.ones(3)}
    state = tx.init(updates)
    out, state = tx.update(updates, state, kl_prediction=(jnp.float32(8e-4), jnp.float32(1.0)))
    assert math.isclose(float(state.kl_alpha), 0.5, rel_tol=1e-6)
    np.testing.assert_allclose(np.asarray(out["w"]), 0.5, rtol=1e-6)
    out, state = tx.update(updates, state, kl_prediction=(jnp.float32(1e-9), jnp.float32(1.0)))
    assert float(state.kl_alpha) == 3.0  # the step can grow, capped at alpha_max
    out, state = tx.update(updates, state, kl_prediction=(jnp.float32(0.0), jnp.float32(5.0)))
    assert float(state.kl_alpha) == 1.0
    # Refused: a non-finite or negative q, and a prediction over no probed position (not a silent full step).
    for bad_sum, bad_count in ((jnp.nan, 1.0), (jnp.inf, 1.0), (-1.0, 1.0), (0.0, 0.0)):
        out, state = tx.update(updates, state, kl_prediction=(jnp.float32(bad_sum), jnp.float32(bad_count)))
        assert float(state.kl_alpha) == 0.0 and float(jnp.abs(out["w"]).max()) == 0.0
    assert int(state.kl_skipped) == 4
    # Mismatch: EMA (weight 0.3) of the clipped gap, from m = 0 as in the authors' code, subtracted from the
    # budget but never below half of it.
    budget_now = float(kl_budget_schedule(state.kl_count, 2e-4, 2e-5, 300))
    _, state = tx.update(updates, state, kl_prediction=(jnp.float32(1e-4), jnp.float32(1.0)),
                         rollout_mismatch=jnp.float32(3e-5))
    assert math.isclose(float(state.kl_mismatch), 0.3 * 3e-5, rel_tol=1e-5)
    assert math.isclose(float(state.kl_budget), budget_now - 0.3 * 3e-5, rel_tol=1e-4)
    _, state = tx.update(updates, state, kl_prediction=(jnp.float32(1e-4), jnp.float32(1.0)),
                         rollout_mismatch=jnp.float32(1.0))
    assert math.isclose(float(state.kl_mismatch), 0.3 * 1.0 + 0.7 * 0.3 * 3e-5, rel_tol=1e-5)
    assert math.isclose(float(state.kl_budget), 0.5 * float(kl_budget_schedule(state.kl_count - 1, 2e-4, 2e-5, 300)),
                        rel_tol=1e-5)
    with pytest.raises(ValueError, match="kl_prediction"):
        tx.update(updates, state)
    with pytest.raises(ValueError, match="alpha_max"):
        scale_by_predicted_kl(alpha_max=0.0)


def test_budget_schedule_is_cosine_then_flat():
    sched = lambda n: float(kl_budget_schedule(jnp.int32(n), 2e-4, 2e-5, 300))
    assert math.isclose(sched(0), 2e-4, rel_tol=1e-6)
    assert math.isclose(sched(299), 2e-5, rel_tol=1e-5)
    assert math.isclose(sched(1000), 2e-5, rel_tol=1e-5)
    mid = 2e-5 + (2e-4 - 2e-5) * 0.5 * (1 + math.cos(math.pi * 100 / 299))
    assert math.isclose(sched(100), mid, rel_tol=1e-5)


def test_sharded_prediction_equals_unsharded():
    graphdef, params, rest, grads, probe = _setup(seed=3)
    probe = {k: jnp.concatenate([v, v[::-1]]) for k, v in probe.items()}  # 4 rows for 4 data shards
    tx = logra(rank=8, update_ratio=1e-3, round_bf16=False)
    updates, _ = _first_update(tx, grads, params)
    predict = jax.jit(lambda p, u, pr: make_kl_probe(graphdef, p, rest, jnp.int32(0), pr)(u))
    want = predict(params, updates, probe)
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # Kernels [L, in, out] sharded on their input axis over fsdp; the probe batch over data.
    fsdp = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "fsdp") if x.ndim == 3 else
                                                     PartitionSpec()))
    data = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    got = predict(jax.tree.map(fsdp, params), updates, jax.tree.map(data, probe))
    assert float(got[1]) == float(want[1])  # the global count, reduced across shards before dividing
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)


def test_controller_state_survives_checkpoint_round_trip(tmp_path):
    tx = logra(rank=4, update_ratio=1e-3, kl_control={"kl_budget": 1e-3})
    params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
    state = tx.init(params)
    grads = {"q_proj": {"kernel": jnp.full((8, 4), 0.1)}}
    _, state = tx.update(grads, state, params, kl_prediction=(jnp.float32(4e-3), jnp.float32(2.0)))
    with CheckpointManager(tmp_path, keep=1) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        restored, _, _ = ckpt.restore(1, abstract=state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(optax.tree_utils.tree_get(restored, "kl_alpha")) == float(optax.tree_utils.tree_get(state, "kl_alpha"))


@pytest.mark.slow
def test_predicted_matches_realised_kl_on_smollm2_controlled_step():
    """SmolLM2-135M-Instruct: a LoGRA proposal at update_ratio 1e-3 is far outside the quadratic regime
    (realised/predicted ≈ 0.3, see experiments/kl), so the controller scales it to the 2e-4 budget; the
    realised KL of the step it applies matches the prediction within 3%."""
    from logra_jax.models import load
    from logra_jax.models.smollm2 import smollm2_gguf_path

    model, tokenizer, _ = load(smollm2_gguf_path())
    attach_sketch_probes(model, SketchSpec(rank=32))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = tokenizer.encode("Reinforcement learning improves language models by rewarding correct answers. "
                           "Paris is the capital of France.")[:24]
    toks = jnp.asarray(np.stack([ids, ids[::-1]]))
    batch = dict(tokens=toks, attention_mask=jnp.ones_like(toks), loss_mask=jnp.ones_like(toks))
    probe = dict(tokens=toks, attention_mask=jnp.ones_like(toks), kl_mask=jnp.ones_like(toks).at[:, :6].set(0))
    # The weights enter every program as arguments, not as constants closed over (XLA:CPU spends longer compiling
    # 135M parameters of constants than running the step: 28 s → 16 s).
    grads = jax.jit(jax.grad(lambda p, r: next_token_loss(nnx.merge(graphdef, p, r), batch)[0]))(params, rest)
    tx = logra(rank=32, update_ratio=1e-3, round_bf16=False, kl_control={"kl_budget": 2e-4, "alpha_max": 3.0})
    updates, state = jax.jit(lambda g, s, p, r, rows: tx.update(
        g, s, p, kl_probe=make_kl_probe(graphdef, p, r, jnp.int32(0), rows)))(grads, tx.init(params), params, rest,
                                                                             probe)
    alpha = float(optax.tree_utils.tree_get(state, "kl_alpha"))
    assert 0 < alpha < 0.1  # the proposal was shrunk
    q, realised = jax.jit(lambda p, u: predicted_and_realised_kl(graphdef, p, rest, jnp.int32(0), u, probe))(
        params, updates)
    np.testing.assert_allclose(float(q), 2e-4, rtol=1e-3)
    assert abs(float(realised) / float(q) - 1) < 0.03, (float(q), float(realised))
