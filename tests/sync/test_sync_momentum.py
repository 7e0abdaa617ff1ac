"""Policy sync stays bitwise with the sketch-space momentum on and projections held for κ > 1 steps: the update is
still U·A_t, so the payload (U, step) and the spec's wire fields (refresh_every included) are all a receiver needs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.optim import apply_updates, logra
from logra_jax.rollout.sync import PolicySync, flat_params
from logra_jax.rollout.worker import RolloutWeights


def test_rollout_weights_bitwise_with_momentum_and_held_projections():
    k = jax.random.split(jax.random.key(0), 2)
    params = {"blocks": {"attn": {"q_proj": {"kernel": jax.random.normal(k[0], (2, 16, 24))}}},
              "embed": jax.random.normal(k[1], (32, 16))}
    tx = logra(rank=4, update_ratio=1e-2, ratio_scope="layer", momentum=0.9, refresh_every=2)  # bf16 factors
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (apply_updates(p, u), u, s))(*tx.update(g, s, p)))
    rollout = RolloutWeights(jax.eval_shape(lambda: params))
    sync = PolicySync(rollout.receive, params)
    for t in range(3):  # the projections change at step 2: the momentum is transferred there
        grads = jax.tree.map(lambda p, t=t: jnp.cos(p * (t + 1)), params)
        params, updates, state = step(params, state, grads)
        assert sync.push(updates, params).reply.status == "applied"
        mine = flat_params(rollout.params)
        for path, w in flat_params(params).items():
            np.testing.assert_array_equal(np.asarray(mine[path]).view(np.uint32), np.asarray(w).view(np.uint32),
                                          err_msg=path)
    assert int(optax.tree_utils.tree_get(state, "momentum").basis) == 2
    assert rollout.counts["applied"] == 3 and sync.resyncs == 0
