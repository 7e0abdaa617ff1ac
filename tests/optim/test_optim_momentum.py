"""The sketch-space momentum (scale_by_subspace_momentum) and the refresh period against float64 numpy loops; its
transfer against the orthogonal projector; its state layout; its config fields."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from logra_jax.job.run_config import OptimizerSection
from logra_jax.optim import apply_updates, logra, scale_by_sketch, sketch_spec, state_targets
from logra_jax.optim.momentum import RIDGE, SubspaceMomentumState, scale_by_subspace_momentum, transfer_matrix
from logra_jax.optim.projection import layer_seed, projection
from logra_jax.optim.spec import SketchSpec
from logra_jax.parallel.sharding import opt_state_shardings

RANK, BASE = 4, 7
# Flax-layout kernels [*batch, in = k, out = d]: a stacked one (two layers) and a plain one.
SHAPES = {"blocks.attn.q_proj.kernel": (2, 12, 10), "mlp.up_proj.kernel": (12, 6)}


def get(tree, path):
    for key in path.split("."):
        tree = tree[key]
    return tree


def as_tree(flat):
    tree = {"norm": jnp.ones(3, jnp.float32)}
    for path, x in flat.items():
        node = tree
        *head, last = path.split(".")
        for key in head:
            node = node.setdefault(key, {})
        node[last] = jnp.asarray(x, jnp.float32)
    return tree


def mats(x):
    """[*batch, k, d] → [slices, d, k] (W = kernelᵀ per layer)."""
    return np.swapaxes(np.asarray(x, np.float64).reshape(-1, *x.shape[-2:]), 1, 2)


def ref_projections(path, step):
    """A [r, k] per slice from the host seed (hashlib-based layer_seed)."""
    shape = SHAPES[path]
    names = [f"{path}.{i}" for i in range(shape[0])] if len(shape) == 3 else [path]
    return [np.asarray(projection(layer_seed(BASE, step, n), RANK, shape[-2]), np.float64) for n in names]


def ref_row_adam(s, v, t, b2=0.95, eps=1e-8):
    """docs/method.md §4, paper variant, one layer: s [d, r], v [d] → (D, v)."""
    v = b2 * v + (1 - b2) * np.mean(s ** 2, axis=1)
    rho = np.sqrt(v / (1 - b2 ** t))
    scale = 1.0 / (rho + eps * rho.mean())
    d_tilde = scale[:, None] * s
    return d_tilde * np.linalg.norm(s) / np.linalg.norm(d_tilde), v


def ref_transfer(m, a_old, a_new):
    """M A_old A_newᵀ (A_new A_newᵀ + λI)⁻¹ by a float64 dense solve (the library uses a float32 Cholesky)."""
    gram = a_new @ a_new.T
    ridge = RIDGE * np.trace(gram) / gram.shape[0]
    return np.linalg.solve(gram + ridge * np.eye(gram.shape[0]), (m @ a_old @ a_new.T).T).T


@pytest.mark.parametrize("every", [2, None])
def test_logra_with_momentum_matches_numpy_over_five_steps(every):
    """sketch → RowAdam → momentum (transfer at every draw change) → per-layer ratio → merge, five steps of
    a stacked and a plain target; κ = 2 redraws at steps 2 and 4; κ = ∞ (refresh off) never does."""
    b1, ratio, steps = 0.9, 1e-2, 5
    rng = np.random.default_rng(3)
    params = as_tree({p: rng.normal(size=s) for p, s in SHAPES.items()})
    refresh = {"refresh_every": every} if every else {"refresh": False}
    tx = logra(RANK, base_seed=BASE, update_ratio=ratio, ratio_scope="layer", round_bf16=False, momentum=b1,
               **refresh)
    state = tx.init(params)
    step_fn = jax.jit(lambda p, s, g: (lambda u, s: (apply_updates(p, u), s))(*tx.update(g, s, p)))
    w = {p: mats(get(params, p)) for p in SHAPES}
    v, m, basis, transfers = {}, {}, 0, 0
    for t in range(steps):
        # rows of very different scales, so RowAdam has something to redistribute
        g = {p: rng.normal(size=s) * np.exp(rng.normal(size=s[-1])) for p, s in SHAPES.items()}
        params, state = step_fn(params, state, as_tree(g))
        draw = t - t % every if every else 0
        for p in SHAPES:
            a = ref_projections(p, draw)
            sketches = [gl @ al.T for gl, al in zip(mats(g[p]), a)]
            v.setdefault(p, [np.zeros(s.shape[0]) for s in sketches])
            m.setdefault(p, [np.zeros_like(s) for s in sketches])
            res = [ref_row_adam(s, vl, t + 1) for s, vl in zip(sketches, v[p])]
            v[p] = [r[1] for r in res]
            if draw != basis:
                m[p] = [ref_transfer(ml, ao, an) for ml, ao, an in zip(m[p], ref_projections(p, basis), a)]
            m[p] = [b1 * ml + (1 - b1) * r[0] for ml, r in zip(m[p], res)]
            new = []
            for wl, ml, al in zip(w[p], m[p], a):
                delta = (ml / (1 - b1 ** (t + 1))) @ al
                new.append(wl - ratio * np.linalg.norm(wl) / np.linalg.norm(delta) * delta)
            w[p] = np.stack(new)
            got_m = np.asarray(get(optax.tree_utils.tree_get(state, "first_moment"), p), np.float64)
            np.testing.assert_allclose(got_m.reshape(len(m[p]), -1, RANK), np.stack(m[p]), rtol=1e-4,
                                       atol=1e-5 * np.abs(got_m).max())
            np.testing.assert_allclose(mats(get(params, p)), w[p], rtol=1e-5, atol=1e-6)
        transfers += draw != basis
        basis = draw
    assert transfers == (2 if every else 0)
    mom = optax.tree_utils.tree_get(state, "momentum")
    assert int(mom.count) == steps and int(mom.basis) == (4 if every else 0)
    np.testing.assert_array_equal(params["norm"], np.ones(3, np.float32))  # non-targets frozen


def test_predicted_kl_sizes_the_step_that_includes_the_momentum():
    """The controller probes the momentum's direction (after a transfer) and scales that same step: with a probe
    whose q is ‖factor‖², the merged factor is −α times a factor along M with ‖·‖² = q."""
    params = {"q_proj": {"kernel": jnp.asarray(np.random.default_rng(5).normal(size=(16, 6)), jnp.float32)}}
    tx = logra(rank=RANK, update_ratio=1e-2, ratio_scope="layer", momentum=0.9, kl_control={"kl_budget": 1e-4},
               round_bf16=False)
    probe = lambda updates: (jnp.sum(jnp.square(updates["q_proj"]["kernel"].factor)), jnp.float32(1.0))
    step = jax.jit(lambda g, s: tx.update(g, s, params, kl_probe=probe))
    state = tx.init(params)
    for t in range(2):  # κ = 1: step 1 transfers the first moment into the new projection
        updates, state = step(jax.tree.map(lambda p, t=t: jnp.sin(p * (t + 2)), params), state)
    u = updates["q_proj"]["kernel"].factor
    m = optax.tree_utils.tree_get(state, "first_moment")["q_proj"]["kernel"]
    alpha, q = (optax.tree_utils.tree_get(state, name) for name in ("kl_alpha", "kl_q"))
    cos = jnp.sum(u * m) / (jnp.linalg.norm(u) * jnp.linalg.norm(m))
    assert float(cos) < -1 + 1e-5  # the merged step points along −M, not along this step's RowAdam direction
    np.testing.assert_allclose(jnp.linalg.norm(u), alpha * jnp.sqrt(q), rtol=1e-5)
    assert 0 < float(alpha) < 3


def test_transfer_is_the_orthogonal_projection_onto_the_new_subspace():
    """(M T) A_new = M A_old Π_new with Π_new = pinv(A_new) A_new, the projector onto A_new's row space: the
    part of the old direction the new subspace holds is kept, nothing is added (r/k of it for a fresh draw)."""
    r, k, d = 8, 48, 5
    a_old, a_new = (np.asarray(projection(seed, r, k), np.float64) for seed in (11, 12))
    m = np.random.default_rng(0).normal(size=(d, r))
    got = m @ np.asarray(transfer_matrix(jnp.asarray(a_old, jnp.float32), jnp.asarray(a_new, jnp.float32)))
    dense_old = m @ a_old
    want = dense_old @ np.linalg.pinv(a_new) @ a_new
    np.testing.assert_allclose(got @ a_new, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    kept = np.linalg.norm(got @ a_new) ** 2 / np.linalg.norm(dense_old) ** 2
    assert 0.5 * r / k < kept < 2 * r / k  # a fresh draw keeps about r/k of the direction's energy


def test_momentum_state_is_laid_out_per_row_and_sharded_step_equals_one_device():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(4)
    params = {"blocks": {"mlp": {"up_proj": {"kernel": jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)}}}}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(2)]
    tx = logra(rank=RANK, update_ratio=1e-2, round_bf16=False, momentum=0.9)  # κ = 1: a transfer at step 1

    def run(params, grads):
        state = tx.init(params)
        init = state
        step = jax.jit(lambda p, s, g: (lambda u, s: (apply_updates(p, u), s))(*tx.update(g, s, p)))
        for g in grads:
            params, state = step(params, state, g)
        return params, init, state

    want, _, want_state = run(params, grads)
    shard = lambda tree: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "x", None))), tree)
    got, init, state = run(shard(params), [shard(g) for g in grads])
    mom = lambda s: optax.tree_utils.tree_get(s, "first_moment")["blocks"]["mlp"]["up_proj"]["kernel"]
    assert mom(init).shape == (2, 32, RANK) and mom(init).dtype == jnp.float32
    # the width split (k on "x") moves onto the rows, like RowAdam's row moment; r stays whole
    assert mom(init).sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x", None)), 3), mom(init).sharding
    derived = opt_state_shardings(init, jax.tree.map(lambda x: x.sharding, shard(params)), shard(params),
                                  targets=state_targets(init, shard(params)))
    for leaf, spec in zip(jax.tree.leaves(init), jax.tree.leaves(derived)):
        assert leaf.sharding.is_equivalent_to(spec, leaf.ndim), (leaf.shape, leaf.sharding, spec)
    np.testing.assert_allclose(mom(state), mom(want_state), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["blocks"]["mlp"]["up_proj"]["kernel"],
                               want["blocks"]["mlp"]["up_proj"]["kernel"], rtol=1e-5, atol=1e-6)


def test_refresh_period_is_one_spec_field_and_arguments_are_checked():
    spec = SketchSpec(rank=2, refresh_every=3)
    assert [int(spec.draw_step(t)) for t in (0, 2, 3, 7)] == [0, 0, 3, 6]
    assert int(SketchSpec(refresh=False).draw_step(7)) == 0  # κ = ∞: the momentum is never transferred
    assert not spec.draws_like(dataclasses.replace(spec, refresh_every=1))
    assert SketchSpec.from_wire(spec.wire_fields()).refresh_every == 3  # the sync receiver draws alike
    params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
    assert sketch_spec(logra(rank=2, refresh_every=3).init(params)).refresh_every == 3
    assert not any(isinstance(s, SubspaceMomentumState) for s in
                   jax.tree.leaves(logra(rank=2).init(params), is_leaf=lambda x: isinstance(x, tuple)))
    with pytest.raises(ValueError, match="refresh_every must be >= 1"):
        SketchSpec(refresh_every=0)
    with pytest.raises(TypeError, match="refresh_every"):
        SketchSpec(refresh_every=2.0)
    with pytest.raises(ValueError, match="momentum must be in"):
        logra(rank=2, momentum=1.0)
    with pytest.raises(ValueError, match="b1 must be in"):
        scale_by_subspace_momentum(-0.1)
    tx = optax.chain(scale_by_subspace_momentum(0.9, rank=3))
    with pytest.raises(ValueError, match="rank 2, this stage was built with rank=3"):
        tx.update(scale_by_sketch(rank=2).update(params, scale_by_sketch(rank=2).init(params))[0], tx.init(params))


@pytest.mark.parametrize("fields, message", [
    ({"momentum": 1.0}, "config.optimizer.momentum = 1.0: must be < 1.0"),
    ({"momentum": 0.9, "name": "adamw"}, "config.optimizer.momentum = 0.9: the sketch-space momentum needs"),
    ({"refresh_every": 0}, "config.optimizer.refresh_every = 0: must be >= 1"),
    ({"refresh_every": 2.5}, "config.optimizer.refresh_every = 2.5: must be an int"),
    ({"refresh_every": 4, "refresh": False}, "config.optimizer.refresh_every = 4: has no effect"),
])
def test_config_fields_are_validated_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        OptimizerSection(**fields).validate()
    OptimizerSection(momentum=0.9, refresh_every=10).validate()


def test_b1_zero_passes_the_direction_through_and_the_state_holds_it():
    params = {"q_proj": {"kernel": jnp.asarray(np.random.default_rng(2).normal(size=(8, 6)), jnp.float32)}}
    sketch, momentum = scale_by_sketch(rank=RANK), scale_by_subspace_momentum(0.0, rank=RANK)
    direction = sketch.update(jax.tree.map(jnp.cos, params), sketch.init(params))[0]
    out, state = momentum.update(direction, momentum.init(params))
    d = direction["q_proj"]["kernel"].factor
    np.testing.assert_array_equal(out["q_proj"]["kernel"].factor, d)
    np.testing.assert_array_equal(state.first_moment["q_proj"]["kernel"], d)  # D, not zeros


def test_one_basis_refuses_updates_that_schedule_their_projections_differently():
    """The state's one basis (the draw step M is in) would be wrong for a target drawn on another schedule."""
    from logra_jax.optim.lowrank import LowRankUpdate
    from logra_jax.optim.targets import find_targets

    params = as_tree({path: np.ones(shape) for path, shape in SHAPES.items()})
    targets = find_targets(params)
    every = {"blocks.attn.q_proj.kernel": 1, "mlp.up_proj.kernel": 4}
    updates = jax.tree.map(lambda x: x, params)
    for path, t in targets.items():
        spec = SketchSpec(rank=RANK, base_seed=BASE, refresh_every=every[path])
        node = get(updates, path.rsplit(".", 1)[0])
        node["kernel"] = LowRankUpdate(jnp.ones((*t.batch_shape, *t.rows_shape, RANK)), 5, target=t, spec=spec)
    tx = scale_by_subspace_momentum(0.9, rank=RANK)
    with pytest.raises(ValueError, match=r"one basis serves every target, but 'blocks.attn.q_proj.kernel' has "
                                         r"\(refresh, refresh_every\) = \(True, 1\) and 'mlp.up_proj.kernel' "
                                         r"\(True, 4\)"):
        tx.update(updates, tx.init(params))
    node["kernel"] = LowRankUpdate(node["kernel"].factor, 5, target=targets["mlp.up_proj.kernel"],
                                   spec=SketchSpec(rank=RANK, base_seed=BASE + 1, refresh_every=1))
    tx.update(updates, tx.init(params))  # another seed, the same schedule: one basis fits both
