"""Memory cuts of issue 34 keep the numbers: the KL probe over its rows in sequential passes equals one pass (the
JVP's q, the count, its primal hidden states and the realised KL); the tangent-mode hooks' primal is the plain
forward; a one-microbatch step needs no accumulator and gives the gradient of the normalised loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.core.tree_paths import path_str
from logra_jax.job.train_step import accumulate_grads
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.kl_probe import make_kl_probe, probe_passes, realised_kl
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec
from logra_jax.optim.lowrank import LowRankUpdate, apply_updates
from logra_jax.parallel import sharding as shd
from logra_jax.rl.losses import LOSS_DENOMINATOR

ROWS, SEQ = 4, 12


def _setup():
    model = init_model(preset("tiny"), seed=4)
    spec = SketchSpec(rank=8)
    targets = attach_sketch_probes(model, spec)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = jax.random.randint(jax.random.key(1), (ROWS, SEQ), 0, 128)
    mask = jnp.ones_like(toks).at[1, :3].set(0)  # one left-padded row
    probe = dict(tokens=toks, attention_mask=mask, kl_mask=mask.at[:, :5].set(0))
    rng = np.random.default_rng(0)

    def update(keypath, _):
        t = targets.get(path_str(keypath))
        if t is None:
            return None
        factor = 0.05 * rng.normal(size=(*t.batch_shape, *t.rows_shape, spec.rank))
        return LowRankUpdate(jnp.asarray(factor, jnp.float32), jnp.int32(0), target=t, spec=spec)

    updates = jax.tree_util.tree_map_with_path(update, params)
    return graphdef, params, rest, probe, updates


def test_probe_in_passes_equals_one_pass():
    graphdef, params, rest, probe, updates = _setup()

    @jax.jit(compiler_options=dict(shd.FAST_CPU_COMPILE))
    def run(params, updates):
        new_params = apply_updates(params, updates)
        out = {}
        for passes in (1, 2):
            fn = make_kl_probe(graphdef, params, rest, jnp.int32(0), probe, chunk=5, passes=passes)
            q, count = fn(updates)
            kl, kl_count = realised_kl(graphdef, params, new_params, rest, probe, chunk=5,
                                       hidden_before=fn.hidden_before, passes=passes)
            out[passes] = (q, count, fn.hidden_before, kl, kl_count)
        plain = nnx.merge(graphdef, params, rest).features(probe["tokens"], attention_mask=probe["attention_mask"])
        return out, plain

    out, plain = run(params, updates)
    q1, count1, hidden1, kl1, kl_count1 = out[1]
    assert float(count1) == float(probe["kl_mask"].sum()) == float(kl_count1)
    assert float(q1) > 0 and float(kl1) > 0
    # The tangent-mode hooks' primal is the plain forward (the zero probes add no product): equal up to the order XLA
    # fuses the two programs in (bitwise on jax 0.10.2; jax 0.12.1 rounded 80% of the entries differently, by at
    # most 9.5e-7 at 1.5, about 8 ulp).
    np.testing.assert_allclose(np.asarray(hidden1, np.float32), np.asarray(plain, np.float32), rtol=1e-5, atol=1e-5)
    q, count, hidden, kl, kl_count = out[2]
    assert float(count) == float(count1) and float(kl_count) == float(kl_count1)
    np.testing.assert_array_equal(np.asarray(hidden, np.float32), np.asarray(hidden1, np.float32))
    np.testing.assert_allclose(float(q), float(q1), rtol=1e-5)
    np.testing.assert_allclose(float(kl), float(kl1), rtol=1e-4)


def test_probe_passes_default_follows_the_batch_shards():
    assert probe_passes(8) == 8  # no rules active: one row at a time
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=4), jax.devices()[:4])
    with shd.use_rules(mesh):
        assert shd.batch_shards() == 4
        assert probe_passes(8) == 2 and probe_passes(4) == 1 and probe_passes(8, 4) == 4
        assert probe_passes(18) == 3  # 18 rows over 4 shards: the largest divisor of 18 up to 4
    with pytest.raises(ValueError, match="divide"):
        probe_passes(8, 3)


def test_one_microbatch_gives_the_normalised_gradient():
    w = jnp.asarray([0.5, -1.0, 2.0])
    batch = {"x": jnp.asarray([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]]), "n": jnp.asarray([3.0, 0.0])}

    def value_and_grad(mb):
        def loss(w):
            num = jnp.sum(jnp.tanh(mb["x"] @ w) * mb["n"])
            den = mb["n"].sum()
            return num / jnp.maximum(den, 1.0), {LOSS_DENOMINATOR: den, "m": num}
        return jax.value_and_grad(loss, has_aux=True)(w)

    loss, grads, aux = accumulate_grads(value_and_grad, batch, 1)
    want = lambda w: jnp.sum(jnp.tanh(batch["x"] @ w) * batch["n"]) / 3.0
    np.testing.assert_allclose(float(loss), float(want(w)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(jax.grad(want)(w)), rtol=1e-6)
    assert float(aux[LOSS_DENOMINATOR]) == 3.0
    # Two microbatches: the same whole-batch loss and gradient (the loop path).
    loss2, grads2, _ = accumulate_grads(value_and_grad, batch, 2)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads2), np.asarray(grads), rtol=1e-6)
