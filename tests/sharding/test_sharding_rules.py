"""Mesh construction, logical-axis rules and the pure sharding derivations (params, optimizer state, batch)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from logra_jax import optim
from logra_jax.models.config import preset
from logra_jax.models.decoder import abstract_model
from logra_jax.parallel import sharding as shd
from logra_jax.parallel.derived_specs import derive_spec, follow_spec


@pytest.fixture(scope="module")
def mesh_f4t2():
    return shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))


def test_mesh_from_config():
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert shd.MeshConfig().axis_sizes(8) == (1, 8, 1)
    assert shd.make_mesh(shd.MeshConfig(fsdp=4), jax.devices()[:4]).size == 4


@pytest.mark.parametrize("kwargs, n, message", [
    ({"fsdp": 0}, 8, "MeshConfig.fsdp"),
    ({"data": -1, "fsdp": -1}, 8, "at most one axis"),
    ({"data": 3}, 8, "not divisible by 3"),
    ({"data": 2, "fsdp": 2, "tensor": 1}, 8, "needs 4 devices"),
])
def test_mesh_config_errors(kwargs, n, message):
    with pytest.raises(ValueError, match=message):
        shd.MeshConfig(**kwargs).axis_sizes(n)


def test_logical_to_spec(mesh_f4t2):
    assert shd.logical_to_spec(("layers", "embed", "q_heads"), shd.DEFAULT_RULES) == P(None, "fsdp", "tensor")
    # Rule order is priority: 'vocab' claims fsdp before 'embed' (vocab-parallel embedding and head).
    assert shd.logical_to_spec(("vocab", "embed"), shd.DEFAULT_RULES) == P(("tensor", "fsdp"), None)
    assert shd.logical_to_spec(("embed", "vocab"), shd.DEFAULT_RULES) == P(None, ("tensor", "fsdp"))
    assert shd.logical_to_spec(("embed", "vocab"), [("embed", "fsdp"), ("vocab", ("tensor", "fsdp"))]) == P(
        "fsdp", "tensor")
    assert shd.logical_to_spec(("batch", "length", "act_heads"), shd.DEFAULT_RULES) == P(("data", "fsdp"), None,
                                                                                       "tensor")
    # A mesh axis shards one dimension only; unknown names and None are replicated.
    assert shd.logical_to_spec(("embed", "embed", "nope", None), shd.DEFAULT_RULES) == P("fsdp", None, None, None)
    # With shapes: axes that do not divide a dimension are dropped (9 heads on tensor=2; batch 2 on fsdp=4).
    assert shd.logical_to_spec(("act_heads", "act_embed"), shd.DEFAULT_RULES, shape=(9, 8), mesh=mesh_f4t2) == P(
        None, None)
    assert shd.logical_to_spec(("batch",), [("batch", ("tensor", "fsdp"))], shape=(2,), mesh=mesh_f4t2) == P(
        "tensor")
    with pytest.raises(ValueError, match="do not match shape"):
        shd.logical_to_spec(("embed",), shd.DEFAULT_RULES, shape=(4, 4), mesh=mesh_f4t2)


def test_constrain_applies_rules_only_when_active(mesh_f4t2):
    x = jnp.ones((8, 4, 6))
    seen = {}

    def f(x):
        y = shd.constrain(x, ("batch", "length", "act_mlp"))
        jax.debug.inspect_array_sharding(y, callback=lambda s: seen.setdefault("spec", s.spec))
        return y * 2

    with shd.use_rules(mesh_f4t2, shd.DEFAULT_RULES):
        jax.jit(f).lower(x).compile()
    assert seen["spec"] == P("fsdp", None, "tensor")
    assert shd.constrain(x, ("batch", None, None)) is x


def test_derive_spec(mesh_f4t2):
    m = mesh_f4t2
    w = P(None, "fsdp", "tensor")                     # a kernel [L, k, d]: width over fsdp, rows over tensor
    assert derive_spec((3, 16, 8), (3, 16, 8), w, m) == w
    # Row moment [L, d] and sketch [L, d, r]: rows keep tensor, the width's fsdp moves onto the rows.
    assert derive_spec((3, 8), (3, 16, 8), w, m) == P(None, ("tensor", "fsdp"))
    assert derive_spec((3, 8, 5), (3, 16, 8), w, m) == P(None, ("tensor", "fsdp"), None)
    # Rows too small for fsdp as well: it lands on the rank axis.
    assert derive_spec((3, 2, 4), (3, 16, 2), w, m) == P(None, "tensor", "fsdp")
    # Square kernel (k == d): a [L, d] leaf is matched to the rows (last axis).
    assert derive_spec((3, 8), (3, 8, 8), w, m) == P(None, ("tensor", "fsdp"))
    # Adafactor-style column factor [L, k] of a kernel [L, k, d] keeps fsdp and takes tensor too.
    assert derive_spec((3, 16), (3, 16, 8), w, m) == P(None, ("fsdp", "tensor"))
    # Nothing divisible: replicated, never an invalid spec.
    assert derive_spec((3, 3), (3, 16, 8), w, m) == P(None, None)


def test_follow_spec_checks_its_map(mesh_f4t2):
    w = P(None, "fsdp", "tensor")
    assert follow_spec((3, 8), w, 3, (0, 2), mesh_f4t2) == P(None, ("tensor", "fsdp"))
    for bad in [(0,), (2, 2), (0, 3)]:
        with pytest.raises(ValueError, match="follow_spec: match"):
            follow_spec((3, 8), w, 3, bad, mesh_f4t2)


def test_declared_target_layout_is_the_one_derivation(mesh_f4t2):
    """A target's per-row state follows its declared dims: the same specs as size matching on the usual layout,
    the right one where sizes tie (layers == width), None for layouts it does not declare."""
    m, w = mesh_f4t2, P(None, "fsdp", "tensor")
    t = optim.match_target("q_proj.kernel", ("q_proj", "kernel"), (3, 16, 8), optim.DEFAULT_TARGET_RULES)
    for shape in [(3, 16, 8), (3, 8), (3, 8, 5)]:
        assert t.state_spec(shape, w, m) == derive_spec(shape, t.shape, w, m), shape
    tie = optim.match_target("q_proj.kernel", ("q_proj", "kernel"), (16, 16, 8), optim.DEFAULT_TARGET_RULES)
    assert tie.state_spec((16, 8), w, m) == P(None, ("tensor", "fsdp"))       # layers keep None, rows split 8 ways
    assert derive_spec((16, 8), tie.shape, w, m) == P("fsdp", "tensor")       # size matching takes L for k
    assert t.state_spec((16, 5), w, m) is None
    # sharding's entry point takes the declared layout where one is given, sizes otherwise.
    assert shd.state_leaf_spec((16, 8), "q_proj.kernel", tie.shape, w, m, {"q_proj.kernel": tie}) == P(
        None, ("tensor", "fsdp"))
    assert shd.state_leaf_spec((16, 8), "q_proj.kernel", tie.shape, w, m) == P("fsdp", "tensor")


@pytest.mark.parametrize("shape, dims, spec", [
    ((16, 3, 8), optim.MatrixDims(rows=(-1,), width=(0,)), P("fsdp", None, "tensor")),      # batch axis in the middle
    ((8, 3, 16), optim.MatrixDims(rows=(0,), width=(2,)), P("tensor", None, "fsdp")),       # rows before batch
    ((16, 4, 2), optim.MatrixDims(rows=(1, 2), width=(0,)), P("fsdp", "tensor", None)),     # Tunix q einsum [D, N, H]
    ((4, 2, 16), optim.MatrixDims(rows=(2,), width=(0, 1)), P("fsdp", None, "tensor")),     # Tunix o einsum [N, H, D]
], ids=["batch-middle", "rows-first", "two-row-axes", "two-width-axes"])
def test_declared_layouts_of_einsum_kernels(mesh_f4t2, shape, dims, spec):
    """Kernels whose axes are not [batch, in, out]: per-row state keeps the row axes' mesh axes, the width's move
    onto the rows where they divide; the result is a valid sharding and equals size matching where sizes do not
    tie."""
    t = optim.match_target("w", ("w",), shape, [optim.TargetRule(r"^w$", dims)])
    lead = (*t.batch_shape, *t.rows_shape)
    for state_shape in (lead, (*lead, 4)):
        got = t.state_spec(state_shape, spec, mesh_f4t2)
        NamedSharding(mesh_f4t2, got).shard_shape(state_shape)  # divisible on every dim
        assert got == derive_spec(state_shape, shape, spec, mesh_f4t2), (state_shape, got)
        axes = lambda s: [a for e in s if e for a in ((e,) if isinstance(e, str) else e)]
        assert len(axes(got)) == len(set(axes(got))) and set(axes(got)) <= set(axes(spec)), got
        for i, a in enumerate((*t.batch_axes, *t.dims.rows)):  # batch and row axes keep their own mesh axes
            assert set(axes([spec[a]])) <= set(axes([got[i]])), (i, got)


def _expected_param_specs(config):
    """The rules table applied by hand to the decoder's parameter list (tensor=2, fsdp=4)."""
    return {
        "embed.embedding": P(("tensor", "fsdp"), None),
        "blocks.attn_norm.scale": P(None, None), "blocks.mlp_norm.scale": P(None, None),
        **{f"blocks.attn.{n}_proj.kernel": P(None, "fsdp", "tensor") for n in "qkv"},
        "blocks.attn.o_proj.kernel": P(None, "tensor", "fsdp"),
        **{f"blocks.mlp.{n}_proj.kernel": P(None, "fsdp", "tensor") for n in ("gate", "up")},
        "blocks.mlp.down_proj.kernel": P(None, "tensor", "fsdp"), "final_norm.scale": P(None),
        **({"lm_head.kernel": P(None, ("tensor", "fsdp"))} if not config.tie_embeddings else {}),
        **({f"blocks.attn.{n}_proj.bias": P(None, "tensor") for n in "qkv"} if config.qkv_bias else {}),
    }


def _specs_by_path(tree):
    return {".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path[:-1]): s.spec
            for path, s in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-7b"])
def test_param_shardings_follow_rules(mesh_f4t2, name):
    config = preset(name)
    params = nnx.state(abstract_model(config), nnx.Param)
    shardings = shd.param_shardings(params, mesh_f4t2)
    assert _specs_by_path(shardings) == _expected_param_specs(config)
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh_f4t2 for s in jax.tree.leaves(shardings))


def test_sketch_probe_takes_its_kernels_rows(mesh_f4t2):
    class Probe(nnx.Variable):
        pass

    class Layer(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.zeros((3, 16, 8)), axes=("layers", "embed", "mlp"))
            self.sketch_probe = Probe(jnp.zeros((3, 8, 4)), axes=("layers", "mlp", None))

    state = nnx.state(Layer())
    specs = _specs_by_path(shd.param_shardings(state, mesh_f4t2))
    assert specs == {"kernel": P(None, "fsdp", "tensor"), "sketch_probe": P(None, ("tensor", "fsdp"), None)}
    own = _specs_by_path(shd.param_shardings(state, mesh_f4t2, derived={}))
    assert own["sketch_probe"] == P(None, "tensor", None)


def _shard_count(sharding, shape):
    return math.prod(shape) // math.prod(sharding.shard_shape(shape))


@pytest.mark.parametrize("tx", [optax.adamw(1e-3), optax.adafactor(1e-3, min_dim_size_to_factor=8),
                                optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3))],
                         ids=["adamw", "adafactor", "clip+lion"])
def test_opt_state_shardings_derive_from_params(mesh_f4t2, tx):
    params = nnx.state(abstract_model(preset("tiny")), nnx.Param)
    p_sh = shd.param_shardings(params, mesh_f4t2)
    opt = jax.eval_shape(tx.init, params)
    o_sh = shd.opt_state_shardings(opt, p_sh, params)
    assert jax.tree.structure(o_sh) == jax.tree.structure(opt)
    by_param = {path: (leaf.shape, s) for (path, s), leaf in zip(_specs_by_path_items(p_sh), jax.tree.leaves(params))}
    checked = 0
    for (path, s), leaf in zip(jax.tree_util.tree_flatten_with_path(o_sh)[0], jax.tree.leaves(opt)):
        s.shard_shape(leaf.shape)  # a valid (divisible) sharding for every leaf
        name = _name(path)
        owner = next((p for p in by_param if name.endswith(p)), None)
        if leaf.ndim == 0 or owner is None:
            assert s.spec == P() or all(e is None for e in s.spec), (name, s.spec)
            continue
        shape, p_s = by_param[owner]
        if leaf.shape == shape:
            assert s.spec == p_s.spec, name
        # Derived leaves are split as finely as their parameter whenever their shape allows it.
        if any(d % 8 == 0 for d in leaf.shape) or leaf.shape == shape:
            assert _shard_count(s, leaf.shape) == _shard_count(p_s, shape), (name, leaf.shape, s.spec)
        checked += 1
    assert checked >= len(by_param)


def _name(path):
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return ".".join(keys[:-1] if keys and keys[-1] == "value" else keys)


def _specs_by_path_items(tree):
    return [(_name(path), s) for path, s in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_batch_shardings_and_abstract_inputs(mesh_f4t2):
    batch = {"tokens": jax.ShapeDtypeStruct((8, 5), jnp.int32), "adv": jax.ShapeDtypeStruct((8,), jnp.float32)}
    sh = shd.batch_shardings(batch, mesh_f4t2)
    assert sh["tokens"].spec == P(("data", "fsdp"), None) and sh["adv"].spec == P(("data", "fsdp"))
    abstract = shd.abstract_sharded(batch, sh)
    assert abstract["tokens"].sharding == sh["tokens"] and abstract["tokens"].shape == (8, 5)


def test_init_sharded_creates_state_in_its_shardings(mesh_f4t2):
    def init():
        w = jnp.arange(2 * 16 * 8, dtype=jnp.float32).reshape(2, 16, 8)
        return {"w": nnx.Param(w, axes=("layers", "embed", "mlp")), "b": nnx.Param(jnp.ones(8), axes=("mlp",))}

    state, shardings = shd.init_sharded(init, lambda s: shd.param_shardings(s, mesh_f4t2))
    assert state["w"][...].sharding == NamedSharding(mesh_f4t2, P(None, "fsdp", "tensor")) == shardings["w"].get_value()
    assert state["b"][...].sharding.spec == P("tensor")
    np.testing.assert_array_equal(np.asarray(state["w"][...]), np.arange(256, dtype=np.float32).reshape(2, 16, 8))


def test_process_rows_of_a_single_process_are_all_rows_and_round_trip():
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=4), jax.devices()[:8])
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    sharding = shd.batch_shardings(jax.ShapeDtypeStruct(x.shape, x.dtype), mesh)
    assert shd.process_rows(sharding, x.shape) == (0, 16)
    g = shd.global_rows(x, sharding, x.shape)
    assert g.sharding == sharding
    np.testing.assert_array_equal(shd.local_rows(g), x)
    placed = shd.to_global({"a": x, "b": x[0]}, {"a": sharding, "b": shd.replicated(mesh)})
    np.testing.assert_array_equal(placed["a"], x)


def test_process_rows_rejects_interleaved_rows():
    class Interleaved:  # what a mesh ordered across processes would give one process: rows 0-3 and 8-11
        def addressable_devices_indices_map(self, shape):
            return {0: (slice(0, 4), slice(None)), 1: (slice(8, 12), slice(None))}

    with pytest.raises(ValueError, match="one contiguous block per process"):
        shd.process_rows(Interleaved(), (16, 3))
