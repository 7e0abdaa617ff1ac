"""Rank rules on the tiny MoE: experts at rank 8, attention at rank 16. The sketch-native mode's sketch of every
target equals the dense-gradient mode's (`scale_by_sketch` on the dense gradient) and both equal G·Aᵀ with the
target's own projection A [r_t, k] (numpy float64), per expert; and the tangent mode (the predicted-KL probe's
path) gives the JVP of each target's own-rank ΔW = U·A."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.job.train_step import next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import SketchProbe, attach_sketch_probes, check_probes_match, sketching
from logra_jax.optim import LowRankUpdate, SketchSpec, is_lowrank, path_str, scale_by_sketch
from logra_jax.optim.projection import target_projection

SPEC = SketchSpec(rank=16, rank_rules="mlp=8", refresh=False)
STEP = 3


def _flat(tree):
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(tree)}


def test_sketch_native_equals_dense_mode_with_expert_and_attention_ranks():
    model = init_model(preset("tiny-qwen3-moe", num_layers=1))
    targets = attach_sketch_probes(model, SPEC)
    ranks = {path: SPEC.rank_for(path) for path in targets}
    assert sorted(set(ranks.values())) == [8, 16]
    assert {p for p, r in ranks.items() if r == 8} == {f"blocks.mlp.{n}_proj.kernel" for n in ("gate", "up", "down")}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probes, others = nnx.split_state(rest, SketchProbe, ...)
    toks = jax.random.randint(jax.random.key(0), (4, 10), 0, 128)
    mask = jnp.ones_like(toks).at[0, :3].set(0)
    batch = dict(tokens=toks, attention_mask=mask, loss_mask=mask)

    def native(pr):
        with sketching(jnp.int32(STEP)):
            return next_token_loss(nnx.merge(graphdef, params, nnx.merge_state(pr, others)), batch)[0]

    got = _flat(jax.jit(jax.grad(native))(probes))
    dense_grads = jax.jit(jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    dense_grads = nnx.to_pure_dict(dense_grads)
    tx = scale_by_sketch(spec=SPEC)
    state = tx.init(dense_grads)._replace(count=jnp.int32(STEP))
    sketched = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(
        tx.update(dense_grads, state)[0], is_leaf=is_lowrank)[0]}
    dense = {path_str(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(dense_grads)[0]}
    for path, t in targets.items():
        s = got[path.replace(".kernel", ".sketch_probe")]
        assert s.shape == (*t.batch_shape, *t.rows_shape, ranks[path]), path
        a = np.asarray(target_projection(t, SPEC.base_seed, 0, ranks[path]), np.float64)  # refresh=False: step 0
        want = np.einsum("...kd,...rk->...dr", dense[path].astype(np.float64), a)
        s_dense = np.asarray(sketched[path].factor)
        for index in np.ndindex(*t.batch_shape):  # per layer, and per expert of the MoE kernels
            scale = max(np.abs(want[index]).max(), 1e-12)
            assert np.abs(s[index] - want[index]).max() <= 1e-5 * scale, (path, index)
            assert np.abs(s_dense[index] - want[index]).max() <= 1e-5 * scale, (path, index)
    check_probes_match(model, SPEC)
    with pytest.raises(ValueError, match="attach them with the optimizer's spec"):
        check_probes_match(model, SketchSpec(rank=16, refresh=False))


def test_tangent_mode_with_expert_and_attention_ranks_equals_the_dense_update_jvp():
    """The predicted-KL probe's path: the JVP along the probes with tangent U (experts r = 8, attention r = 16)
    equals the JVP along the weights with the dense ΔW = U·A of each target's own rank (`LowRankUpdate.to_dense`)."""
    model = init_model(preset("tiny-qwen3-moe", num_layers=1))
    targets = attach_sketch_probes(model, SPEC)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probes, others = nnx.split_state(rest, SketchProbe, ...)
    toks = jax.random.randint(jax.random.key(1), (2, 8), 0, 128)
    rng = np.random.default_rng(0)
    factors = {p: jnp.asarray(rng.normal(size=(*t.batch_shape, *t.rows_shape, SPEC.rank_for(p))), jnp.float32)
               for p, t in targets.items()}
    tangent_probes = nnx.from_flat_state(
        [(k, v.replace(factors[".".join(map(str, k[:-1])) + ".kernel"])) for k, v in nnx.to_flat_state(probes)])

    def of_probes(pr):
        with sketching(jnp.int32(STEP), kind="tangent"):
            return nnx.merge(graphdef, params, nnx.merge_state(pr, others))(toks)[0]

    _, dz_factored = jax.jvp(of_probes, (probes,), (tangent_probes,))
    path_of = lambda k: ".".join(map(str, k))
    dense_tangent = nnx.from_flat_state([
        (k, v.replace(LowRankUpdate(factors[path_of(k)], STEP, target=targets[path_of(k)], spec=SPEC).to_dense()
                      if path_of(k) in targets else jnp.zeros_like(v[...])))
        for k, v in nnx.to_flat_state(params)])
    _, dz_dense = jax.jvp(lambda p: nnx.merge(graphdef, p, rest)(toks)[0], (params,), (dense_tangent,))
    np.testing.assert_allclose(np.asarray(dz_factored), np.asarray(dz_dense), rtol=1e-4,
                               atol=1e-5 * np.abs(np.asarray(dz_dense)).max())
