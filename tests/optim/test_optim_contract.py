"""The optax contract, one shared suite that every transformation of logra_jax.optim passes.

Each case is (factory, keyword arguments, static args for inject_hyperparams, whether the transform consumes
sketches). A transform that consumes sketches runs after `scale_by_sketch`; generic optax transforms (here
clip_by_global_norm) go before the sketch, on the dense gradient: that is the documented design, and placing
one after the sketch must fail loudly rather than corrupt the integer step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from logra_jax.optim import (
    add_decayed_weights_lowrank,
    apply_updates,
    is_lowrank,
    logra,
    scale_by_row_adam,
    scale_by_sketch,
    scale_by_update_ratio,
    scale_lowrank,
)
from logra_jax.optim.momentum import scale_by_subspace_momentum
from logra_jax.optim.predicted_kl import scale_by_predicted_kl

RANK = 4


@dataclasses.dataclass(frozen=True)
class Case:
    factory: object
    kwargs: dict
    static_args: tuple = ()
    after_sketch: bool = True
    extra: dict = dataclasses.field(default_factory=dict)  # extra args the transform needs at every update


CASES = {
    "sketch": Case(scale_by_sketch, dict(rank=RANK, base_seed=3), ("rank", "base_seed"), after_sketch=False),
    "row_adam_paper": Case(scale_by_row_adam, dict(variant="paper", b2=0.9, eps=1e-8)),
    "row_adam_nemo": Case(scale_by_row_adam, dict(variant="nemo", b2=0.9, eps=1e-3)),
    "row_adam_sgd": Case(scale_by_row_adam, dict(variant="sgd")),
    "update_ratio": Case(scale_by_update_ratio, dict(ratio=1e-2)),
    # two updates with a fresh projection each: the second one transfers the first moment
    "subspace_momentum": Case(scale_by_subspace_momentum, dict(b1=0.9, rank=RANK), ("rank",)),
    "scale_lowrank": Case(scale_lowrank, dict(step_size=-0.5)),
    "decayed_weights": Case(add_decayed_weights_lowrank, dict(weight_decay=0.1)),
    "logra_paper": Case(logra, dict(rank=RANK, update_ratio=1e-2), ("rank", "base_seed"), after_sketch=False),
    "logra_nemo": Case(logra, dict(rank=RANK, variant="nemo", lr=0.1, weight_decay=0.01), ("rank", "base_seed"),
                       after_sketch=False),
    # The budgets, alpha_max and the mismatch weights can be injected as arrays; the schedule length is static.
    "predicted_kl": Case(scale_by_predicted_kl, dict(kl_budget=1e-4, kl_budget_final=1e-5, schedule_steps=10),
                         ("schedule_steps", "subtract_mismatch"),
                         extra=dict(kl_prediction=(jnp.float32(4e-4), jnp.float32(1.0)))),
    "logra_kl": Case(logra, dict(rank=RANK, update_ratio=1e-2, kl_control=dict(kl_budget=1e-4)),
                     ("rank", "base_seed", "kl_control"), after_sketch=False,
                     extra=dict(kl_prediction=(jnp.float32(4e-4), jnp.float32(1.0)))),
}


def make_params():
    rng = np.random.default_rng(0)
    tree = {"blocks": {"attn": {"q_proj": {"kernel": rng.normal(size=(2, 8, 6))}},
                       "norm": {"scale": rng.normal(size=(2, 8))}}}
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def make_grads(seed, scale=10.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(scale * rng.normal(size=p.shape), jnp.float32), make_params())


def pipeline(case, *head, **overrides):
    tx = case.factory(**{**case.kwargs, **overrides})
    pre = [scale_by_sketch(RANK, 3)] if case.after_sketch else []
    return optax.chain(*head, *pre, tx)


def avals(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)


def assert_trees_close(a, b, rtol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_contract(name):
    case = CASES[name]
    params = make_params()
    g1, g2 = make_grads(1), make_grads(2)
    extra = dict(unknown_extra_arg=jnp.ones(3), **case.extra)

    # Inside optax.chain after clip_by_global_norm, with an unknown extra argument; the state keeps its dtypes,
    # shapes and shardings (eager here; the library's inner jits make eager use cheap).
    max_norm = 1.0
    clipped = optax.chain(optax.clip_by_global_norm(max_norm), pipeline(case))
    state0 = clipped.init(params)
    u1, s1 = clipped.update(g1, state0, params, **extra)
    u2, s2 = clipped.update(g2, s1, params, **extra)
    assert avals(s1) == avals(state0) == avals(s2)

    # ... and equals the bare pipeline on gradients clipped by hand (no extra args).
    plain = pipeline(case)
    by_hand = lambda g: jax.tree.map(lambda x: x * max_norm / optax.tree.norm(g), g)
    v1, st = plain.update(by_hand(g1), plain.init(params), params, **case.extra)
    v2, st = plain.update(by_hand(g2), st, params, **case.extra)
    assert_trees_close((v1, v2, st), (u1, u2, s2[-1]))

    # Jitted, the transform alone: no recompilation on the second call, state avals and shardings unchanged.
    tx = case.factory(**case.kwargs)
    if case.after_sketch:
        sketch = scale_by_sketch(RANK, 3)
        x1, sk = sketch.update(by_hand(g1), sketch.init(params))
        x2, _ = sketch.update(by_hand(g2), sk)
    else:
        x1, x2 = by_hand(g1), by_hand(g2)
    step = jax.jit(lambda s, x: tx.update(x, s, params, **extra))
    t0 = tx.init(params)
    y1, t1 = step(t0, x1)
    y2, t2 = step(t1, x2)
    assert step._cache_size() == 1
    assert avals(t1) == avals(t0) == avals(t2)
    assert_trees_close((y1, y2, t2), (u1, u2, s2[-1][-1]))

    # Under optax.inject_hyperparams (hyperparameters held as arrays in the state): the same numbers.
    injected = optax.chain(optax.clip_by_global_norm(max_norm),
                           *([scale_by_sketch(RANK, 3)] if case.after_sketch else []),
                           optax.inject_hyperparams(case.factory, static_args=case.static_args)(**case.kwargs))
    w1, st = injected.update(g1, injected.init(params), params, **case.extra)
    w2, st = injected.update(g2, st, params, **case.extra)
    assert_trees_close((w1, w2), (u1, u2))
    # Every update leaf was compared: the target's low-rank factor (and step), and the norm.
    assert len(jax.tree.leaves(u1)) >= 3 and sum(map(is_lowrank, jax.tree.leaves(u1, is_leaf=is_lowrank))) == 1


def test_inject_hyperparams_schedules_update_ratio():
    params, grads = make_params(), make_grads(1)
    tx = optax.inject_hyperparams(logra, static_args=("rank", "base_seed"))(rank=RANK, update_ratio=1e-2)
    state = tx.init(params)
    u_small, _ = tx.update(grads, state, params)
    state.hyperparams["update_ratio"] = jnp.asarray(3e-2, jnp.float32)
    u_big, _ = tx.update(grads, state, params)
    small, big = (jax.tree.leaves(u, is_leaf=is_lowrank) for u in (u_small, u_big))
    factors = [(a.factor, b.factor) for a, b in zip(small, big) if is_lowrank(a)]
    assert len(factors) == 1 and len(small) == 2  # the one target of make_params, and the frozen norm
    for a, b in factors:
        np.testing.assert_allclose(b, 3 * a, rtol=1e-5, atol=1e-9)
        assert float(jnp.abs(a).max()) > 0
    frozen = [(a, b) for a, b in zip(small, big) if not is_lowrank(a)]
    assert len(frozen) == 1 and all(not np.asarray(a).any() and not np.asarray(b).any() for a, b in frozen)


def test_generic_transform_after_sketch_fails_loudly():
    params, grads = make_params(), make_grads(1)
    tx = optax.chain(scale_by_sketch(RANK), optax.scale(-1.0))
    updates, _ = tx.update(grads, tx.init(params), params)
    with pytest.raises(TypeError, match="before"):
        apply_updates(params, updates)
    with pytest.raises(TypeError):
        clip_after = optax.chain(scale_by_sketch(RANK), optax.clip_by_global_norm(1.0))
        clip_after.update(grads, clip_after.init(params), params)


def test_logra_state_orbax_round_trip(tmp_path):
    params, grads = make_params(), make_grads(1)
    tx = logra(rank=RANK, update_ratio=1e-2)
    _, state = jax.jit(lambda p, s, g: tx.update(g, s, p))(params, tx.init(params), grads)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype


def test_bad_hyperparameters_raise_naming_the_argument():
    with pytest.raises(ValueError, match="variant"):
        scale_by_row_adam("adamw")
    with pytest.raises(ValueError, match="b2"):
        scale_by_row_adam(b2=1.0)
    with pytest.raises(ValueError, match="ratio"):
        scale_by_update_ratio(-1.0)
    with pytest.raises(TypeError, match="rank"):
        scale_by_sketch(rank=2.5)
    with pytest.raises(ValueError, match="distribution"):
        scale_by_sketch(rank=2, distribution="uniform")
    with pytest.raises(ValueError, match="lr"):
        logra(variant="nemo")
    with pytest.raises(ValueError, match="lr"):
        logra(lr=0.1)
    with pytest.raises(ValueError, match="weight_decay"):
        logra(weight_decay=0.1)
    with pytest.raises(TypeError, match=r"kl_control must be None or a mapping.*got 0\.001"):
        logra(kl_control=1e-3)
    with pytest.raises(TypeError, match=r"non_target_tx must be None or an optax\.GradientTransformation"):
        logra(non_target_tx="adamw")
    with pytest.raises(ValueError, match="update_ratio needs params"):
        tx = optax.chain(scale_by_sketch(RANK), scale_by_update_ratio())
        tx.update(make_grads(1), tx.init(make_params()))


def test_optax_masked_leaves_masked_out_targets_dense():
    """optax.masked around the LoGRA target chain: masked-out targets keep their dense gradient."""
    params = {"q_proj": {"kernel": jnp.ones((8, 4))}, "k_proj": {"kernel": jnp.ones((8, 4))}}
    grads = make_grads(1)["blocks"]["attn"]["q_proj"]["kernel"][0, :, :4]
    grads = {"q_proj": {"kernel": grads}, "k_proj": {"kernel": 2 * grads}}
    inner = optax.chain(scale_by_sketch(RANK), scale_by_row_adam(), scale_by_update_ratio(1e-2), scale_lowrank(-1.0))
    tx = optax.masked(inner, {"q_proj": {"kernel": True}, "k_proj": {"kernel": False}})
    updates, _ = tx.update(grads, tx.init(params), params)
    new = apply_updates(params, updates)
    np.testing.assert_array_equal(new["k_proj"]["kernel"], params["k_proj"]["kernel"] + grads["k_proj"]["kernel"])
    delta = new["q_proj"]["kernel"] - params["q_proj"]["kernel"]
    np.testing.assert_allclose(jnp.linalg.norm(delta), 1e-2 * jnp.linalg.norm(params["q_proj"]["kernel"]), rtol=1e-4)


def test_multisteps_around_logra_accumulates_then_steps_on_the_mean():
    """optax.MultiSteps(logra): mini-steps emit zero updates; every k-th emits logra's update of the mean gradient."""
    params, grads = make_params(), [make_grads(seed) for seed in range(4)]
    tx = optax.MultiSteps(logra(rank=RANK, update_ratio=1e-2), every_k_schedule=2)
    inner = logra(rank=RANK, update_ratio=1e-2)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    state, inner_state = tx.init(params), inner.init(params)
    emitted = 0
    for i, g in enumerate(grads):
        updates, new_state = step(params, state, g)
        assert avals(new_state) == avals(state)
        state = new_state
        new = apply_updates(params, updates)
        if i % 2 == 0:
            assert_trees_close(new, params, rtol=0)  # a mini-step: nothing moves
            continue
        mean = jax.tree.map(lambda a, b: (a + b) / 2, grads[i - 1], g)
        expected, inner_state = inner.update(mean, inner_state, params)
        assert_trees_close(new, apply_updates(params, expected))
        kernel = lambda tree: tree["blocks"]["attn"]["q_proj"]["kernel"]
        assert float(jnp.abs(kernel(new) - kernel(params)).max()) > 1e-4
        params, emitted = new, emitted + 1
    assert emitted == 2 and step._cache_size() == 1


@pytest.mark.parametrize("variant", ["paper", "nemo"])
def test_bf16_params_through_the_whole_chain(variant):
    """bf16 params and gradients: the state keeps its dtypes, params stay bf16, and the step equals the float32
    chain's on the same (exactly representable) values to bf16 precision."""
    kwargs = dict(variant="nemo", lr=0.1, weight_decay=0.01) if variant == "nemo" else dict(update_ratio=1e-2)
    tx = logra(rank=RANK, **kwargs)
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p16)
    step = jax.jit(lambda p, s, g: (lambda u, s2: (apply_updates(p, u), s2))(*tx.update(g, s, p)))
    s16, s32 = tx.init(p16), tx.init(p32)
    for seed in (1, 2):
        g16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_grads(seed))
        n16, t16 = step(p16, s16, g16)
        n32, s32 = step(p32, s32, jax.tree.map(lambda x: x.astype(jnp.float32), g16))
        assert avals(t16) == avals(s16)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(n16))
        k16, k0 = n16["blocks"]["attn"]["q_proj"]["kernel"], p16["blocks"]["attn"]["q_proj"]["kernel"]
        assert float(jnp.abs(k16.astype(jnp.float32) - k0.astype(jnp.float32)).max()) > 0  # it moved in bf16
        for a, b in zip(jax.tree.leaves(n16), jax.tree.leaves(n32)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=2**-7, atol=2**-7)
        p16, s16, p32 = n16, t16, jax.tree.map(lambda x: x.astype(jnp.float32), n16)
