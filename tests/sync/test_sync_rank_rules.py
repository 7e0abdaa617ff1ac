"""Policy sync with per-target ranks (rank rules): each target's payload carries its own rank (the spec as that
target sees it, `SketchSpec.for_target`), and the rollout side's weights equal the trainer's local merge bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.optim import apply_updates, find_targets, logra
from logra_jax.optim.spec import SketchSpec
from logra_jax.rollout.sync import PolicySync, SyncPayload, delta_payload, flat_params
from logra_jax.rollout.worker import RolloutWeights

RULES = "up_proj=2, q_proj=3"
RANKS = {"blocks.attn.q_proj.kernel": 3, "blocks.mlp.up_proj.kernel": 2, "blocks.mlp.down_proj.kernel": 4}


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {"blocks": {"attn": {"q_proj": {"kernel": jax.random.normal(k[0], (2, 16, 24))}},
                       "mlp": {"up_proj": {"kernel": jax.random.normal(k[1], (2, 16, 40))},
                               "down_proj": {"kernel": jax.random.normal(k[2], (2, 40, 16))}}},
            "embed": jax.random.normal(k[3], (32, 16))}


def test_rollout_weights_bitwise_with_mixed_ranks():
    params = _params()
    assert set(find_targets(params)) == set(RANKS)
    tx = logra(rank=4, rank_rules=RULES, update_ratio=1e-2, momentum=0.9)  # paper variant: bf16 factors
    spec = SketchSpec(rank=4, rank_rules=RULES, round_bf16=True)
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (apply_updates(p, u), u, s))(*tx.update(g, s, p)))
    rollout = RolloutWeights(jax.eval_shape(lambda: params))
    sync = PolicySync(rollout.receive, params)
    for t in range(3):
        grads = jax.tree.map(lambda p, t=t: jnp.cos(p * (t + 1)), params)
        params, updates, state = step(params, state, grads)
        payload = SyncPayload.from_bytes(delta_payload(updates, params, t + 1).to_bytes())
        for path, r in RANKS.items():
            f = payload.factors[path]
            assert f.factor.shape[-1] == r and f.spec == spec.for_target(path) and f.spec.rank == r
            assert payload.parts()[0]["targets"][path]["rank"] == r
        assert sync.push(updates, params).reply.status == "applied"
        mine = flat_params(rollout.params)
        for path, w in flat_params(params).items():
            np.testing.assert_array_equal(np.asarray(mine[path]).view(np.uint32), np.asarray(w).view(np.uint32),
                                          err_msg=path)
    assert rollout.counts["applied"] == 3 and sync.resyncs == 0
