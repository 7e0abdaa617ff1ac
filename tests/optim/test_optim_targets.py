"""Targets as data: canonical paths, rules and matrix dims, errors; the tiny NNX model and Tunix 3-D kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from logra_jax.models.config import preset
from logra_jax.models.decoder import abstract_model
from logra_jax.optim import (
    DEFAULT_TARGET_RULES,
    MatrixDims,
    TargetRule,
    apply_updates,
    find_targets,
    logra,
    path_str,
    projection,
    target_labels,
)
from logra_jax.optim.projection import layer_seed


def get(tree, path):
    for key in path.split("."):
        tree = tree[key]
    return tree


def tiny_state(seed=None):
    """The tiny decoder's nnx.State of Params: ShapeDtypeStructs, or normal(0.02) values when seeded."""
    state = nnx.state(abstract_model(preset("tiny")), nnx.Param)
    if seed is None:
        return state
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(0.02 * rng.normal(size=s.shape), jnp.float32), state)


PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_path_str_for_nnx_state_pure_dict_and_sequences():
    state = tiny_state()
    for tree in (state, nnx.to_pure_dict(state)):
        paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        assert "blocks.attn.q_proj.kernel" in paths and "embed.embedding" in paths
    tree = {"layers": [{"w": 1.0}, (2.0, {"b": 3.0})]}
    assert [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]] == [
        "layers.0.w", "layers.1.0", "layers.1.1.b"]


def test_default_rules_on_tiny_model():
    config = preset("tiny")
    state = tiny_state()
    targets = find_targets(state)
    assert sorted(targets) == sorted(f"blocks.{'attn' if p[0] in 'qkvo' else 'mlp'}.{p}.kernel" for p in PROJS)
    assert targets == find_targets(nnx.to_pure_dict(state))
    q = targets["blocks.attn.q_proj.kernel"]
    L, D = config.num_layers, config.hidden_size
    assert (q.batch_shape, q.d, q.k) == ((L,), config.q_size, D)
    assert q.slice_paths == tuple(f"blocks.attn.q_proj.kernel.{i}" for i in range(L))
    down = targets["blocks.mlp.down_proj.kernel"]
    assert (down.d, down.k) == (D, config.intermediate_size)
    # Row state/sketch shardings follow the kernel's: [layers, in, out] → rows = out, and the width's axes move
    # onto the rows; the layers axis and the rank stay whole.
    mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), devices=jax.devices()[:1])
    w = P(None, "fsdp", "tensor")
    assert q.state_spec((L, q.d), w, mesh) == P(None, ("tensor", "fsdp"))
    assert q.state_spec((L, q.d, 4), w, mesh) == P(None, ("tensor", "fsdp"), None)
    assert q.state_spec(q.shape, w, mesh) == w
    assert q.state_spec((L, q.d + 1), w, mesh) is None
    labels = target_labels(nnx.to_pure_dict(state))
    assert labels["blocks"]["attn"]["q_proj"]["kernel"] == "logra"
    assert labels["embed"]["embedding"] == "non_target"


def test_tunix_3d_kernels():
    rules = (TargetRule(r"q_einsum\.w$", MatrixDims(rows=(1, 2), width=(0,))),
             TargetRule(r"attn_vec_einsum\.w$", MatrixDims(rows=(2,), width=(0, 1))))
    params = {"attn": {"q_einsum": {"w": jnp.zeros((16, 4, 8))}, "attn_vec_einsum": {"w": jnp.zeros((4, 8, 16))}}}
    t = find_targets(params, rules)
    q, o = t["attn.q_einsum.w"], t["attn.attn_vec_einsum.w"]
    assert (q.batch_shape, q.rows_shape, q.width_shape, q.d, q.k) == ((), (4, 8), (16,), 32, 16)
    assert (o.batch_shape, o.rows_shape, o.width_shape, o.d, o.k) == ((), (16,), (4, 8), 16, 32)
    assert q.dims == MatrixDims(rows=(1, 2), width=(0,)) and o.dims == MatrixDims(rows=(2,), width=(0, 1))


def test_errors_name_rules_and_path():
    params = {"norm": {"scale": jnp.zeros(4)}}
    with pytest.raises(ValueError, match=r"no parameter matches the target rules .*q\|k\|v"):
        find_targets(params)
    bias = {"attn": {"q_proj": {"kernel": jnp.zeros(4)}}}
    with pytest.raises(ValueError, match=r"'attn.q_proj.kernel'.*cannot be viewed as a matrix"):
        find_targets(bias)
    overlap = (TargetRule("w$", MatrixDims(rows=(0,), width=(-2,))),)
    with pytest.raises(ValueError, match=r"'w'.*repeated"):
        find_targets({"w": jnp.zeros((3, 4))}, overlap)
    with pytest.raises(TypeError, match="rows"):
        MatrixDims(rows=())
    with pytest.raises(ValueError, match="regex"):
        TargetRule("(")
    with pytest.raises(TypeError, match="TargetRule"):
        find_targets(params, DEFAULT_TARGET_RULES[0])
    with pytest.raises(ValueError, match="no parameter matches"):
        logra(rank=2).init(params)


def test_logra_on_tiny_model_state_matches_dense_oracle():
    """One LoGRA step on the NNX model state (stacked [L, in, out] kernels) against a per-layer numpy oracle."""
    config = preset("tiny")
    state = tiny_state(seed=1)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), state)
    rank, ratio = 8, 1e-3
    # Two of the seven projections keep the compile small; the default rules are checked above.
    rules = (TargetRule(r"(q|down)_proj\.kernel$"),)
    tx = logra(rank=rank, variant="sgd", update_ratio=ratio, round_bf16=False, rules=rules)

    @jax.jit
    def step(state, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, state)
        return apply_updates(state, updates)

    new = step(state, tx.init(state), grads)
    assert type(new) is type(state)

    pure, g_pure, new_pure = (nnx.to_pure_dict(x) for x in (state, grads, new))
    targets = find_targets(pure, rules)
    deltas, w_sq, da_sq = {}, 0.0, 0.0
    for path, t in targets.items():
        w, g = np.asarray(get(pure, path), np.float64), np.asarray(get(g_pure, path), np.float64)
        w_sq += np.sum(w ** 2)
        for layer in range(config.num_layers):
            a = np.asarray(projection(layer_seed(42, 0, f"{path}.{layer}"), rank, t.k), np.float64)
            da = (g[layer].T @ a.T) @ a  # SGD direction D = S = G Aᵀ with G = kernelᵀ gradient, then D·A
            deltas[path, layer] = da
            da_sq += np.sum(da ** 2)
    coef = ratio * np.sqrt(w_sq / da_sq)
    for (path, layer), da in deltas.items():
        expected = np.asarray(get(pure, path), np.float64)[layer] - coef * da.T
        np.testing.assert_allclose(np.asarray(get(new_pure, path))[layer], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new_pure["embed"]["embedding"], pure["embed"]["embedding"])  # frozen
