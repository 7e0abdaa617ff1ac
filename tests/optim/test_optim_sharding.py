"""8 fake devices: row- and column-sharded weights give the unsharded numbers; row moments follow the rows."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from logra_jax.optim import apply_updates, logra, state_targets
from logra_jax.sharding import opt_state_shardings

L, K, D, RANK = 2, 16, 32, 4  # stacked Flax kernel [L, in=k, out=d]


def run(params, grads, jit=True):
    tx = logra(rank=RANK, update_ratio=1e-2, round_bf16=False)
    state = tx.init(params)
    init_state = state

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return apply_updates(params, updates), state

    step = jax.jit(step) if jit else step
    for g in grads:
        params, state = step(params, state, g)
    return params, init_state, state


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    params = {"blocks": {"attn": {"q_proj": {"kernel": jnp.asarray(rng.normal(size=(L, K, D)), jnp.float32)}},
                         "norm": {"scale": jnp.ones((L, D), jnp.float32)}}}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(2)]
    expected, _, expected_state = run(params, grads, jit=False)  # one device
    return params, grads, expected, expected_state


def row_moment(state):
    return optax.tree_utils.tree_get(state, "row_adam").row_moment["blocks"]["attn"]["q_proj"]["kernel"]


# Row-sharded kernels give row-sharded moments; a column (width) split moves onto the rows, which it divides, so
# the moment is split as finely as its kernel (Target.state_spec).
@pytest.mark.parametrize("spec, row_spec", [(P(None, None, "x"), P(None, "x")), (P(None, "x", None), P(None, "x"))],
                         ids=["rows", "columns"])
def test_sharded_equals_unsharded_and_row_moments_follow_rows(problem, spec, row_spec):
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    params, grads, expected, expected_state = problem

    shard = lambda tree: jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, spec if x.ndim == 3 else P())), tree)
    got, init_state, state = run(shard(params), [shard(g) for g in grads])

    kernel = got["blocks"]["attn"]["q_proj"]["kernel"]
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3)
    np.testing.assert_allclose(kernel, expected["blocks"]["attn"]["q_proj"]["kernel"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(row_moment(state), row_moment(expected_state), rtol=1e-5)
    for v in (row_moment(init_state), row_moment(state)):
        assert v.shape == (L, D) and v.dtype == jnp.float32
        assert v.sharding.is_equivalent_to(NamedSharding(mesh, row_spec), 2), v.sharding
    # One derivation: the eager init's placement is what a jitted step's out_shardings derive from the targets.
    sharded = shard(params)
    derived = opt_state_shardings(init_state, jax.tree.map(lambda x: x.sharding, sharded), sharded,
                                  targets=state_targets(init_state, sharded))
    for leaf, want in zip(jax.tree.leaves(init_state), jax.tree.leaves(derived)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.shape, leaf.sharding, want)
    # Every state leaf keeps its sharding through the jitted updates (the count lives replicated on the mesh).
    for a, b in zip(jax.tree.leaves(init_state), jax.tree.leaves(state)):
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim), (a.sharding, b.sharding)
