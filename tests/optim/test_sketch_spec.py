"""One SketchSpec owns the sketch settings: built by logra / scale_by_sketch (or given), carried by every
LowRankUpdate and (static) by the optimizer state, where the train step and callers read it back."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax.optim import (
    SketchSpec,
    apply_updates,
    find_targets,
    logra,
    scale_by_sketch,
    scale_lowrank,
    sketch_spec,
)
from logra_jax.optim.lowrank_scale import scale_updates
from logra_jax.optim.targets import MatrixDims, TargetRule

PARAMS = {"blocks": {"mlp": {"up_proj": {"kernel": jnp.linspace(-1.0, 1.0, 2 * 8 * 16).reshape(2, 8, 16)}}},
          "norm": jnp.ones(8)}


def _grads(seed=0):
    key = jax.random.key(seed)
    return jax.tree.map(lambda p: jax.random.normal(key, p.shape, p.dtype), PARAMS)


def test_spec_validates_and_normalises():
    spec = SketchSpec(rank=np.int64(4), base_seed=np.int32(3), rules=list(SketchSpec().rules))
    assert type(spec.rank) is int and type(spec.base_seed) is int and isinstance(spec.rules, tuple)
    assert hash(spec) == hash(SketchSpec(rank=4, base_seed=3))  # static: usable as a jit / graphdef key
    assert SketchSpec().rank == 256  # the paper's rank
    with pytest.raises(TypeError, match=r"SketchSpec\.rank"):
        SketchSpec(rank=0)
    with pytest.raises(ValueError, match=r"SketchSpec\.distribution"):
        SketchSpec(rank=4, distribution="uniform")
    with pytest.raises(ValueError, match=r"SketchSpec\.base_seed"):
        SketchSpec(rank=4, base_seed=-1)
    with pytest.raises(TypeError, match="rules"):
        SketchSpec(rank=4, rules=("q_proj",))
    assert SketchSpec(rank=4).wire_fields() == {"base_seed": 42, "rank": 4, "distribution": "rademacher",
                                                "refresh": True, "refresh_every": 1, "round_bf16": False,
                                                "implementation": "xla",
                                                "interpret": False, "stochastic_round": False}
    custom = SketchSpec(rank=4, base_seed=9, round_bf16=True, rules=(TargetRule(r"x$"),))
    assert SketchSpec.from_wire(custom.wire_fields()) == dataclasses.replace(custom, rules=SketchSpec().rules)
    with pytest.raises(KeyError, match="interpret"):
        SketchSpec.from_wire({k: v for k, v in custom.wire_fields().items() if k != "interpret"})
    # the same projections whatever the rounding, kernel or rules; another seed or refresh draws other ones
    assert custom.draws_like(SketchSpec(rank=4, base_seed=9, implementation="pallas", interpret=True))
    assert not custom.draws_like(dataclasses.replace(custom, base_seed=10))
    assert not custom.draws_like(dataclasses.replace(custom, refresh=False))


def test_settings_are_given_once():
    spec = SketchSpec(rank=4, base_seed=7)
    with pytest.raises(ValueError, match=r"either in spec= or as arguments.*\['base_seed'\]"):
        logra(spec=spec, base_seed=8)
    with pytest.raises(ValueError, match=r"either in spec= or as arguments.*\['rank'\]"):
        scale_by_sketch(4, spec=spec)
    with pytest.raises(TypeError, match="spec must be a SketchSpec"):
        logra(spec={"rank": 4})
    with pytest.raises(TypeError, match=r"scale_by_sketch: SketchSpec\.rank"):
        logra(rank=-2)


def test_logra_with_a_spec_equals_logra_with_arguments_bit_for_bit():
    rules = (TargetRule(r"up_proj\.kernel$", MatrixDims(rows=(-1,), width=(-2,))),)
    by_args = logra(rank=4, base_seed=7, distribution="gaussian", rules=rules, update_ratio=1e-2)
    spec = SketchSpec(rank=4, base_seed=7, distribution="gaussian", rules=rules, round_bf16=True)
    by_spec = logra(spec=spec, update_ratio=1e-2)
    states = [tx.init(PARAMS) for tx in (by_args, by_spec)]
    assert sketch_spec(states[0]) == sketch_spec(states[1]) == spec  # paper variant: bf16 rounding resolved
    params = [PARAMS, PARAMS]
    for step in range(3):
        for i, tx in enumerate((by_args, by_spec)):
            updates, states[i] = tx.update(_grads(step), states[i], params[i])
            u = updates["blocks"]["mlp"]["up_proj"]["kernel"]
            assert u.spec == spec and u.target.path == "blocks.mlp.up_proj.kernel"
            params[i] = apply_updates(params[i], updates)
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_spec_is_found_through_optax_wrappers_and_is_no_leaf():
    spec = SketchSpec(rank=4, base_seed=5)
    # inject_hyperparams turns numeric defaults into arrays: the static ones are named (as logra's docstring says)
    injected = optax.inject_hyperparams(logra, static_args=("spec", "base_seed"))(spec=spec, update_ratio=1e-3)
    wrapped = optax.MultiSteps(injected, 2)
    state = wrapped.init(PARAMS)
    assert sketch_spec(state) == spec
    assert sketch_spec(jax.eval_shape(wrapped.init, PARAMS)) == spec  # abstract states carry it too
    assert sketch_spec(optax.adam(1e-3).init(PARAMS)) is None
    assert not any(isinstance(x, SketchSpec) for x in jax.tree.leaves(state))  # checkpoints see no extra leaf
    jitted = jax.jit(lambda s: s)(state)  # static: survives jit as aux data
    assert sketch_spec(jitted) == spec
    two = (scale_by_sketch(spec=spec).init(PARAMS), scale_by_sketch(spec=dataclasses.replace(spec, rank=2)).init(
        PARAMS))
    with pytest.raises(ValueError, match=r"2 different SketchSpecs"):
        sketch_spec(two)


def test_incoming_sketch_with_other_projection_settings_is_refused():
    spec = SketchSpec(rank=4)
    target = find_targets(PARAMS)["blocks.mlp.up_proj.kernel"]
    tx = scale_by_sketch(spec=spec)
    from logra_jax.optim import LowRankUpdate
    other = LowRankUpdate(jnp.zeros((2, 16, 4)), 0, target=target, spec=dataclasses.replace(spec, base_seed=1))
    grads = {**_grads(), "blocks": {"mlp": {"up_proj": {"kernel": other}}}}
    with pytest.raises(ValueError, match=r"incoming LowRankUpdate for blocks\.mlp\.up_proj\.kernel"):
        tx.update(grads, tx.init(PARAMS))
    # the same projections merged another way are taken, and leave merged as this transform says
    same = LowRankUpdate(jnp.zeros((2, 16, 4)), 0, target=target, spec=spec.with_merge("pallas", True))
    out, _ = tx.update({**grads, "blocks": {"mlp": {"up_proj": {"kernel": same}}}}, tx.init(PARAMS))
    assert out["blocks"]["mlp"]["up_proj"]["kernel"].spec == spec


def test_named_stages_and_unique_state_names():
    tx = logra(rank=4, update_ratio=1e-3, kl_control={})
    state = tx.init(PARAMS)
    get = optax.tree_utils.tree_get
    assert get(state, "sketch").spec.rank == 4
    assert get(state, "row_adam").row_moment["blocks"]["mlp"]["up_proj"]["kernel"].shape == (2, 16)
    assert float(get(state, "kl_alpha")) == 1.0 and int(get(state, "kl_skipped")) == 0
    for name in ("update_ratio", "predicted_kl", "negation"):
        assert get(state, name) is not None, name
    nemo = logra(rank=4, variant="nemo", lr=1e-3, weight_decay=0.1).init(PARAMS)
    assert get(nemo, "weight_decay") is not None and get(nemo, "learning_rate") is not None


def test_one_scaling_of_update_trees():
    spec = SketchSpec(rank=4)
    target = find_targets(PARAMS)["blocks.mlp.up_proj.kernel"]
    from logra_jax.optim import LowRankUpdate
    u = LowRankUpdate(jnp.full((2, 16, 4), jnp.nan), jnp.int32(3), target=target, spec=spec, decay=jnp.float32(2))
    tree = {"u": u, "b": jnp.asarray([1.0, 3.0], jnp.bfloat16), "i": jnp.arange(3), "none": None}
    half = scale_updates(tree, jnp.float32(0.5))
    assert int(half["u"].step) == 3 and float(half["u"].decay) == 1.0 and half["i"] is tree["i"]
    assert half["b"].dtype == jnp.bfloat16 and half["b"].tolist() == [0.5, 1.5] and half["none"] is None
    zero = scale_updates(tree, jnp.float32(0.0), exact_zero=True)  # a refused step: zeros even from NaN
    assert float(jnp.abs(zero["u"].factor).max()) == 0.0 and float(zero["u"].decay) == 0.0
    assert bool(jnp.isnan(scale_updates(tree, 0.0)["u"].factor).all())  # plain scaling keeps NaN · 0 = NaN
    # scale_lowrank is this scaling
    out, _ = scale_lowrank(-2.0).update(tree, optax.EmptyState())
    np.testing.assert_array_equal(np.asarray(out["b"], np.float32), [-2.0, -6.0])
