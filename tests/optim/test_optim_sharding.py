"""8 fake devices: row- and column-sharded weights give the unsharded numbers; row moments follow the rows."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from logra_jax.optim import DeclaredTargets, MatrixDims, TargetRule, apply_updates, logra, state_targets
from logra_jax.optim.dense_row_adam import scale_by_dense_row_adam
from logra_jax.parallel.sharding import opt_state_shardings

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


def test_dense_row_adam_declares_its_targets_and_follows_rows():
    """The ablation's [*batch, *rows] moments are placed like LoGRA's: eagerly and by the jitted shardings from
    the targets it declares, also where size matching would take the layers axis for the width (L == k)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(1)
    params = {"q_proj": {"kernel": jnp.asarray(rng.normal(size=(8, 8, 32)), jnp.float32)}}
    grad = {"q_proj": {"kernel": jnp.asarray(rng.normal(size=(8, 8, 32)), jnp.float32)}}
    tx = scale_by_dense_row_adam(update_ratio=1e-2)
    want_updates, want_state = tx.update(grad, tx.init(params), params)

    shard = lambda tree: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "x", None))), tree)
    sharded = shard(params)
    state = tx.init(sharded)
    assert list(state_targets(state, sharded)) == ["q_proj.kernel"]
    derived = opt_state_shardings(state, jax.tree.map(lambda x: x.sharding, sharded), sharded,
                                  targets=state_targets(state, sharded))
    v = state.row_moment["q_proj.kernel"]
    assert v.shape == (8, 32) and v.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x")), 2), v.sharding
    assert derived.row_moment["q_proj.kernel"].spec == P(None, "x")
    updates, state = jax.jit(tx.update)(shard(grad), state, sharded)
    np.testing.assert_allclose(updates["q_proj"]["kernel"], want_updates["q_proj"]["kernel"], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(state.row_moment["q_proj.kernel"], want_state.row_moment["q_proj.kernel"], rtol=1e-5)


def test_state_targets_refuses_two_views_of_one_parameter():
    params = {"q_proj": {"kernel": jnp.zeros((8, 4))}}
    other = DeclaredTargets((TargetRule(r"q_proj\.kernel$", MatrixDims(rows=(0,), width=(1,))),))
    with pytest.raises(ValueError, match=r"'q_proj\.kernel' is declared as two different targets"):
        state_targets((logra(rank=2).init(params), other), params)
    assert state_targets(optax.adam(1e-3).init(params), params) == {}
