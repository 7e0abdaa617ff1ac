"""logra as a drop-in optax optimizer: the dense route equals the low-rank route, misuse is refused with advice.

Oracles: `logra_jax.optim.apply_updates` on the low-rank updates (tested against numpy in test_optim_reference)
for the dense route; the dense ΔW = U·A of `to_dense` (numpy-checked there too) for the low-rank clip norm.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax.optim import (
    LowRankUpdate,
    apply_updates,
    check_rank_fits,
    clip_by_global_norm_lowrank,
    densify_lowrank,
    find_targets,
    is_lowrank,
    logra,
    mark_lowrank_aware,
    path_str,
    scale_by_sketch,
    scale_lowrank,
)
from logra_jax.optim.spec import SketchSpec

RANK = 4


def make_params(dtype=jnp.float32, seed=0):
    """A stacked [L, in, out] target, a 3-D einsum-style target, a plain target and a frozen norm."""
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "blocks": {"mlp": {"up_proj": {"kernel": jax.random.normal(k[0], (3, 16, 24), dtype)}}},
        "attn": {"q_proj": {"kernel": jax.random.normal(k[1], (16, 12), dtype)}},
        "o_proj": {"kernel": jax.random.normal(k[2], (12, 16), dtype)},
        "norm": jnp.ones(16, dtype),
    }


def flat(tree):
    """{canonical path: leaf}."""
    return {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def make_grads(params, seed):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(100 + seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def run_both(kwargs, params, steps=3, jit=True):
    """The low-rank route (logra + our apply_updates) and the dense route (dense_updates=True +
    optax.apply_updates) from the same start, step by step; returns both parameter trees."""
    low, dense = logra(rank=RANK, **kwargs), logra(rank=RANK, dense_updates=True, **kwargs)

    def step_low(p, s, g):
        u, s = low.update(g, s, p)
        return apply_updates(p, u), s

    def step_dense(p, s, g):
        u, s = dense.update(g, s, p)
        return optax.apply_updates(p, u), s

    if jit:
        step_low, step_dense = jax.jit(step_low), jax.jit(step_dense)
    p_low, s_low = params, low.init(params)
    p_dense, s_dense = params, dense.init(params)
    for i in range(steps):
        g = make_grads(params, i)
        p_low, s_low = step_low(p_low, s_low, g)
        p_dense, s_dense = step_dense(p_dense, s_dense, g)
    return p_low, p_dense


def max_ulps(a, b):
    """Largest distance in units of the last place of `a`'s dtype between a and b (0 = bitwise equal)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == jnp.bfloat16:
        ia, ib = a.view(np.int16).astype(np.int64), b.view(np.int16).astype(np.int64)
    else:
        ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    ia, ib = np.where(ia < 0, np.iinfo(np.int64).min - ia, ia), np.where(ib < 0, np.iinfo(np.int64).min - ib, ib)
    return int(np.abs(ia - ib).max())


ROUTES = {
    "paper": dict(update_ratio=1e-2),
    "paper_fp32_wire": dict(update_ratio=1e-2, round_bf16=False),
    "layer_scope": dict(update_ratio=1e-2, ratio_scope="layer"),
    "nemo_decay": dict(variant="nemo", lr=1e-2, weight_decay=0.1),
    "adamw_non_targets": dict(update_ratio=1e-2, non_target_tx=optax.adamw(1e-3)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ROUTES))
def test_dense_route_gives_the_low_rank_weights_bitwise(name, dtype):
    params = make_params(dtype)
    # The decayed merge (1 + c)·W + U·A against W + (merge(W) − W) in fp32: exact (Sterbenz) unless an entry
    # moves far from W (e.g. toward 0), where one rounding of the addition remains (1 ulp of its larger operand;
    # bf16 sums are exact in f32). Over several steps such a difference feeds back, so that case is one step.
    one_rounding = name == "nemo_decay" and dtype == jnp.float32
    p_low, p_dense = run_both(ROUTES[name], params, steps=1 if one_rounding else 3)
    low, dense, start = flat(p_low), flat(p_dense), flat(params)
    assert low.keys() == dense.keys()
    for path in low:
        assert low[path].dtype == dense[path].dtype == dtype, path
        if one_rounding:
            scale = np.maximum(np.abs(np.asarray(start[path])), np.abs(np.asarray(low[path])))
            assert (np.abs(np.asarray(dense[path]) - np.asarray(low[path])) <= np.spacing(scale)).all(), path
        else:
            assert max_ulps(low[path], dense[path]) == 0, (path, max_ulps(low[path], dense[path]))
    assert all((low[p] != start[p]).any() for p in find_targets(params))


def test_dense_updates_are_float32_arrays_and_state_matches_low_rank_route():
    params = make_params(jnp.bfloat16)
    low, dense = logra(rank=RANK, update_ratio=1e-2), logra(rank=RANK, update_ratio=1e-2, dense_updates=True)
    assert jax.tree.structure(low.init(params)) == jax.tree.structure(dense.init(params))
    updates, _ = dense.update(make_grads(params, 0), dense.init(params), params)
    for u, p in zip(jax.tree.leaves(updates, is_leaf=is_lowrank), jax.tree.leaves(params)):
        assert not is_lowrank(u) and u.shape == p.shape
    assert updates["attn"]["q_proj"]["kernel"].dtype == jnp.float32  # optax adds W + ΔW in float32, as we merge


def test_dense_route_allows_generic_transforms_after_it():
    params = make_params()
    tx = optax.chain(logra(rank=RANK, update_ratio=1e-2, dense_updates=True), optax.clip_by_global_norm(1e-3),
                     optax.scale(0.5))
    updates, _ = jax.jit(tx.update)(make_grads(params, 0), tx.init(params), params)
    norm = optax.global_norm(updates)
    np.testing.assert_allclose(norm, 0.5e-3, rtol=1e-4)


def test_multisteps_accumulates_then_steps_in_both_routes():
    params = make_params()
    for dense in (False, True):
        inner = logra(rank=RANK, update_ratio=1e-2, dense_updates=dense)
        tx = optax.MultiSteps(inner, every_k_schedule=2)
        merge = optax.apply_updates if dense else apply_updates
        state, p = tx.init(params), params
        g0, g1 = make_grads(params, 0), make_grads(params, 1)
        u, state = jax.jit(tx.update)(g0, state, p)
        p = merge(p, u)
        np.testing.assert_array_equal(p["o_proj"]["kernel"], params["o_proj"]["kernel"])  # no step yet
        u, state = jax.jit(tx.update)(g1, state, p)
        p = merge(p, u)
        # the one emitted step equals logra's step on the mean gradient
        mean = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
        want_u, _ = inner.update(mean, inner.init(params), params)
        want = merge(params, want_u)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert not np.array_equal(p["o_proj"]["kernel"], params["o_proj"]["kernel"])


# --- misuse: generic transforms after logra -------------------------------------------------------------------

def _inject_logra():
    return optax.inject_hyperparams(logra, static_args=("rank", "base_seed"))(rank=RANK, update_ratio=1e-2)


MISUSES = {
    "clip": (lambda: optax.chain(logra(rank=RANK), optax.clip_by_global_norm(1.0)), "clip_by_global_norm"),
    "scale": (lambda: optax.chain(logra(rank=RANK), optax.scale(0.5)), "scale"),
    "decayed_weights": (lambda: optax.chain(logra(rank=RANK), optax.add_decayed_weights(1e-2)),
                        "add_decayed_weights"),
    "nested_chain": (lambda: optax.chain(optax.chain(optax.clip_by_global_norm(1.0), logra(rank=RANK)),
                                         optax.clip_by_global_norm(1.0)), "clip_by_global_norm"),
    "named_chain": (lambda: optax.named_chain(("logra", logra(rank=RANK)), ("sgd", optax.sgd(0.1))), "chain"),
    "inject_hyperparams_logra": (lambda: optax.chain(_inject_logra(), optax.clip_by_global_norm(1.0)),
                                 "clip_by_global_norm"),
    "inside_partition": (lambda: optax.chain(optax.partition({"a": logra(rank=RANK)}, "a"), optax.scale(2.0)),
                         "scale"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(MISUSES))
def test_generic_transform_after_logra_raises_advice(name, jit):
    build, culprit = MISUSES[name]
    tx = build()
    params = make_params()
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match="Put generic transforms before logra") as err:
        update(make_grads(params, 0), state, params)
    msg = str(err.value)
    assert culprit in msg and "update" in msg  # names the successor's update function
    for remedy in ("scale_lowrank", "add_decayed_weights_lowrank", "clip_by_global_norm_lowrank",
                   "dense_updates=True"):
        assert remedy in msg


def test_the_clip_successor_is_named_by_its_qualname():
    tx = optax.chain(logra(rank=RANK), optax.clip_by_global_norm(1.0))
    params = make_params()
    with pytest.raises(ValueError, match=r"clip_by_global_norm\.<locals>\.update_fn"):
        tx.update(make_grads(params, 0), tx.init(params), params)


LEGAL = {
    "scale_lowrank": lambda: optax.chain(logra(rank=RANK, update_ratio=1e-2), scale_lowrank(0.5)),
    "clip_lowrank": lambda: optax.chain(logra(rank=RANK, update_ratio=1e-2), clip_by_global_norm_lowrank(1.0)),
    "generic_before": lambda: optax.chain(optax.clip_by_global_norm(1.0), logra(rank=RANK, update_ratio=1e-2)),
    "last_of_inner_chain": lambda: optax.chain(optax.chain(optax.scale(2.0), logra(rank=RANK, update_ratio=1e-2)),
                                               scale_lowrank(1.0)),
    "nested_lowrank_chain": lambda: optax.chain(logra(rank=RANK, update_ratio=1e-2),
                                                optax.chain(scale_lowrank(1.0), clip_by_global_norm_lowrank(1.0))),
    "injected_lowrank": lambda: optax.chain(logra(rank=RANK, update_ratio=1e-2),
                                            optax.inject_hyperparams(scale_lowrank)(step_size=1.0)),
    "marked": lambda: optax.chain(logra(rank=RANK, update_ratio=1e-2), mark_lowrank_aware(optax.identity())),
    "densify_then_generic": lambda: optax.chain(logra(rank=RANK, update_ratio=1e-2), densify_lowrank(),
                                                optax.clip_by_global_norm(1.0)),
    "multisteps": lambda: optax.MultiSteps(logra(rank=RANK, update_ratio=1e-2), 2).gradient_transformation(),
}


@pytest.mark.parametrize("name", list(LEGAL))
def test_low_rank_aware_successors_are_accepted(name):
    tx = LEGAL[name]()
    params = make_params()
    updates, _ = jax.jit(tx.update)(make_grads(params, 0), tx.init(params), params)
    merged = (optax.apply_updates if name == "densify_then_generic" else apply_updates)(params, updates)
    assert jax.tree.structure(merged) == jax.tree.structure(params)


def test_consumers_refuse_a_broken_update_with_the_same_advice():
    params = make_params()
    u, _ = scale_by_sketch(RANK).update(params, scale_by_sketch(RANK).init(params))
    q = u["attn"]["q_proj"]["kernel"]
    float_step = q.replace(step=q.step.astype(jnp.float32))  # what optax.scale(0.5) does to it
    bad_factor = q.replace(factor=q.factor[..., :2])
    for bad in (float_step, bad_factor):
        for consume in (lambda x: x.to_dense(), lambda x: x.merge(params["attn"]["q_proj"]["kernel"]),
                        lambda x: x.dense_norm_sq()):
            with pytest.raises(TypeError, match="Put generic transforms before logra"):
                consume(bad)
    with pytest.raises(TypeError, match="dense_updates=True"):
        optax.apply_updates(params, u)  # W + LowRankUpdate


# --- clip_by_global_norm_lowrank ------------------------------------------------------------------------------

@pytest.mark.parametrize("decay", [None, 0.05])
@pytest.mark.parametrize("round_bf16", [False, True])
def test_clip_lowrank_uses_the_exact_dense_norm(round_bf16, decay):
    params = make_params()
    sketch = scale_by_sketch(RANK, round_bf16=round_bf16)
    u, _ = sketch.update(make_grads(params, 0), sketch.init(params))
    u = jax.tree.map(lambda x: x.replace(decay=None if decay is None else jnp.float32(decay)) if is_lowrank(x)
                     else x, u, is_leaf=is_lowrank)

    def dense_norm(updates):  # the oracle: the global norm of the dense tree
        dense, _ = densify_lowrank().update(updates, optax.EmptyState(), params)
        return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(dense))))

    g = dense_norm(u)
    # With round_bf16 the clipped factor s·U is rounded to bf16 again at the wire: the merged ΔW is
    # bf16(s·U)·A, not s·bf16(U)·A, so its norm matches to bf16 rounding (averaged over the elements).
    rtol = 1e-3 if round_bf16 else 1e-5
    for max_norm, want in ((2 * g, g), (g / 3, g / 3)):
        clipped, _ = clip_by_global_norm_lowrank(max_norm).update(u, optax.EmptyState(), params)
        np.testing.assert_allclose(dense_norm(clipped), want, rtol=rtol)
    same, _ = clip_by_global_norm_lowrank(2 * g).update(u, optax.EmptyState(), params)
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(u)):
        np.testing.assert_array_equal(a, b)  # below the threshold: untouched


def test_clip_lowrank_matches_optax_clip_on_the_dense_updates():
    params = make_params()
    low = optax.chain(logra(rank=RANK, update_ratio=1e-1, round_bf16=False), clip_by_global_norm_lowrank(1e-2))
    dense = optax.chain(logra(rank=RANK, update_ratio=1e-1, round_bf16=False, dense_updates=True),
                        optax.clip_by_global_norm(1e-2))
    u_low, _ = low.update(make_grads(params, 0), low.init(params), params)
    u_dense, _ = dense.update(make_grads(params, 0), dense.init(params), params)
    for a, b in zip(jax.tree.leaves(apply_updates(params, u_low)), jax.tree.leaves(optax.apply_updates(params,
                                                                                                        u_dense))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_clip_lowrank_validates():
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_global_norm_lowrank(0.0)
    params = make_params()
    u, _ = scale_by_sketch(RANK).update(params, scale_by_sketch(RANK).init(params))
    u = jax.tree.map(lambda x: x.replace(decay=jnp.float32(0.1)) if is_lowrank(x) else x, u, is_leaf=is_lowrank)
    with pytest.raises(ValueError, match="need params"):
        clip_by_global_norm_lowrank(1.0).update(u, optax.EmptyState())
    with pytest.raises(ValueError, match="need params"):
        densify_lowrank().update(u, optax.EmptyState())


# --- rank validation ------------------------------------------------------------------------------------------

def test_check_rank_fits_names_the_narrowest_target():
    params = make_params()
    targets = find_targets(params)
    check_rank_fits(targets, 12)  # widths: up_proj 16, q_proj 16, o_proj 12
    with pytest.raises(ValueError, match=r"rank 13 exceeds the width k = 12 of target 'o_proj.kernel'"):
        check_rank_fits(targets, 13)
    with pytest.raises(ValueError, match=r"width k = 12 of target 'o_proj.kernel'.*3 target\(s\).*rank <= 12"):
        check_rank_fits(list(targets.values()), 17)


def test_logra_and_scale_by_sketch_init_refuse_a_rank_wider_than_a_target():
    params = make_params()
    for tx in (logra(rank=13), logra(rank=13, dense_updates=True), scale_by_sketch(13)):
        with pytest.raises(ValueError, match=r"o_proj\.kernel"):
            tx.init(params)


# --- inject_hyperparams ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dense", [False, True], ids=["lowrank", "dense"])
def test_inject_hyperparams_update_ratio_under_jit(dense):
    params = make_params()
    tx = optax.inject_hyperparams(logra, static_args=("rank", "base_seed"))(
        rank=RANK, update_ratio=1e-2, round_bf16=False, dense_updates=dense)
    merge = optax.apply_updates if dense else apply_updates
    state = tx.init(params)
    assert set(state.hyperparams) >= {"update_ratio", "b2", "eps"}
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    g = make_grads(params, 0)
    small, _ = step(params, state, g)
    state.hyperparams["update_ratio"] = jnp.asarray(3e-2, jnp.float32)
    big, _ = step(params, state, g)
    assert step._cache_size() == 1  # a new ratio is data, not a recompile

    def deltas(u):
        new, old = flat(merge(params, u)), flat(params)
        return {p: np.asarray(new[p], np.float64) - np.asarray(old[p], np.float64) for p in find_targets(params)}

    d_small, d_big = deltas(small), deltas(big)
    for p in d_small:
        np.testing.assert_allclose(d_big[p], 3 * d_small[p], rtol=1e-4, atol=1e-6)
    # the global ratio: ‖ΔW‖ over all targets = update_ratio · ‖W‖ over all targets
    norm = lambda tree: np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree))
    w = norm(flat(params)[p] for p in find_targets(params))
    np.testing.assert_allclose(norm(d_small.values()) / w, 1e-2, rtol=1e-3)


def test_inject_hyperparams_matches_plain_logra_in_the_dense_route():
    params = make_params()
    injected = optax.inject_hyperparams(logra, static_args=("rank", "base_seed"))(
        rank=RANK, update_ratio=1e-2, dense_updates=True)
    plain = logra(rank=RANK, update_ratio=1e-2, dense_updates=True)
    g = make_grads(params, 0)
    a, _ = jax.jit(injected.update)(g, injected.init(params), params)
    b, _ = jax.jit(plain.update)(g, plain.init(params), params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9)


def test_dense_updates_must_be_a_bool():
    with pytest.raises(TypeError, match="dense_updates"):
        logra(dense_updates="yes")


def test_lowrank_update_to_dense_adds_to_the_merged_weight_exactly():
    """The contract densify relies on: W + to_dense(W) == merge(W) in W's dtype, with and without decay."""
    params = make_params()
    t = find_targets(params)["blocks.mlp.up_proj.kernel"]
    w = params["blocks"]["mlp"]["up_proj"]["kernel"]
    f = 1e-2 * jax.random.normal(jax.random.key(7), (*t.batch_shape, *t.rows_shape, RANK))
    for dtype in (jnp.float32, jnp.bfloat16):
        for decay in (None, jnp.float32(-1e-3)):
            u = LowRankUpdate(f, 3, target=t, spec=SketchSpec(rank=RANK, base_seed=1, round_bf16=True), decay=decay)
            wd = w.astype(dtype)
            got, want = optax.apply_updates(wd, u.to_dense(wd)), u.merge(wd)
            if decay is None or dtype == jnp.bfloat16:
                assert max_ulps(got, want) == 0, (dtype, decay)
            else:  # at most one rounding of the addition W + ΔW: one ulp of its larger operand
                scale = np.maximum(np.abs(np.asarray(wd)), np.abs(np.asarray(want)))
                assert (np.abs(np.asarray(got) - np.asarray(want)) <= np.spacing(scale)).all()
