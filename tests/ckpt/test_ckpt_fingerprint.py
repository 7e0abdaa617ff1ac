"""logra_jax.core.fingerprint: the persisted definition (numpy reference, golden values), its fast evaluation
against the
plain flat formula on ragged shapes, sharded arrays without gathering, single changes, swaps, tree paths."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import logra_jax.core.fingerprint as fingerprint_module
from logra_jax.core.fingerprint import _fingerprints, _leading_shards, fingerprint, leaf_fingerprints, tree_fingerprint
from logra_jax.rollout.sync import flat_params

GOLDEN, OFFSET = 0x9E3779B1, 0x7F4A7C15


def numpy_fingerprint(x: np.ndarray) -> int:
    """Reference: uint32 words of the row-major bytes, weights (i·G + O) | 1, sum mod 2³² in Python integers."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        words = x.astype(np.uint32).ravel()
    elif x.dtype.itemsize < 4:
        words = x.view(np.dtype(f"uint{8 * x.dtype.itemsize}")).ravel().astype(np.uint32)
    else:
        words = x.view(np.uint32).ravel()
    total = 0
    for i, w in enumerate(words.tolist()):
        total += (((i * GOLDEN + OFFSET) % 2**32) | 1) * w
    return total % 2**32


def flat_fingerprint(x: jax.Array) -> jax.Array:
    """The flat formula as the checkpoint first computed it: one weight per word from its row-major index."""
    w = jnp.asarray(x)
    if w.dtype == jnp.bool_:
        w = w.astype(jnp.uint32)
    elif w.dtype.itemsize < 4:
        w = lax.bitcast_convert_type(w, jnp.dtype(f"uint{8 * w.dtype.itemsize}")).astype(jnp.uint32)
    else:
        w = lax.bitcast_convert_type(w, jnp.uint32)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(w.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= w.shape[dim]
    return jnp.sum(w * ((index * jnp.uint32(GOLDEN) + jnp.uint32(OFFSET)) | jnp.uint32(1)), dtype=jnp.uint32)


def random_array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return jnp.asarray(rng.random(shape) > 0.5)
    if jnp.issubdtype(dtype, jnp.integer):
        info = np.iinfo(dtype)
        return jnp.asarray(rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True))
    return jnp.asarray(rng.normal(size=shape) * 100).astype(dtype)


def mesh_1d():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))


@pytest.mark.parametrize(("dtype", "shape"), [("float32", ()), ("float32", (7,)), *[
    (dtype, (3, 4, 2)) for dtype in ("float32", "bfloat16", "float16", "int8", "uint32", "int32", "bool")]])
def test_fingerprint_matches_numpy_reference(dtype, shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape) * 100).astype(dtype)
    assert int(fingerprint(x)) == numpy_fingerprint(np.asarray(x))


def test_golden_values_of_the_persisted_definition():
    """Values written into checkpoints' layout records before the implementation was shared: they must not change
    (old checkpoints are verified against them)."""
    cases = [
        (jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3), 1780482048),
        ((jnp.arange(16, dtype=jnp.bfloat16) - 8) / 4, 1717632),
        ((jnp.arange(30, dtype=jnp.float16) / 8 - 1).reshape(2, 3, 5), 3736780992),
        (jnp.arange(-5, 7, dtype=jnp.int8).reshape(3, 4), 1628432180),
        (jnp.array([True, False, True]), 990112652),
        (jnp.array([1, 0], jnp.uint32), 2135587861),
        (jnp.float32(2.5), 3265265664),
        (jnp.arange(105, dtype=jnp.int32).reshape(35, 3), 2771569552),
        (jnp.zeros((4, 0)), 0),
    ]
    assert [numpy_fingerprint(np.asarray(x)) for x, _ in cases] == [want for _, want in cases]
    assert leaf_fingerprints([x for x, _ in cases]) == [want for _, want in cases]
    assert [int(fingerprint(x)) for x, _ in cases] == [want for _, want in cases]
    assert [int(jax.jit(fingerprint)(x)) for x, _ in cases] == [want for _, want in cases]
    with jax.enable_x64(True):
        wide = [jnp.arange(-3.0, 3.0, 0.75, dtype=jnp.float64).reshape(2, 4), jnp.int64(-(2**40) - 7)]
        assert [numpy_fingerprint(np.asarray(x)) for x in wide] == [666107904, 3850296998]
        assert leaf_fingerprints(wide) == [666107904, 3850296998]
        assert [int(fingerprint(x)) for x in wide] == [666107904, 3850296998]


RAGGED = [(), (0,), (3, 0), (0, 5), (1,), (2,), (7,), (31,), (32,), (33,), (37,), (64,), (96,), (1000,), (5, 3),
          (5, 4), (6, 3), (37, 3), (37, 2), (64, 9), (64, 10), (41, 1), (1, 37), (31, 7, 3), (30, 6, 5), (30, 6, 4),
          (2, 3, 4, 5), (3, 5, 7, 1), (48, 2, 3), (1, 1, 1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint16", "bool"])
def test_fast_formula_equals_flat_formula_on_ragged_shapes(dtype):
    """Rows with and without divisors ≤ 32 (prime 37, 41), odd and even words per row, empty and 0-d arrays."""
    xs = [random_array(shape, dtype, seed=i) for i, shape in enumerate(RAGGED)]
    flat = [int(v) for v in jax.jit(lambda leaves: [flat_fingerprint(x) for x in leaves])(xs)]
    assert leaf_fingerprints(xs) == flat
    small = [(x, f) for x, f in zip(xs, flat) if x.size <= 400]
    assert [numpy_fingerprint(np.asarray(x)) for x, _ in small] == [f for _, f in small]


def test_64_bit_dtypes_split_into_two_words():
    with jax.enable_x64(True):
        xs = [random_array(shape, dtype, seed=3) for dtype in ("float64", "int64", "uint64")
              for shape in ((), (5,), (37, 3), (4, 6))]
        want = [numpy_fingerprint(np.asarray(x)) for x in xs]
        assert leaf_fingerprints(xs) == want
        assert [int(flat_fingerprint(x)) for x in xs] == want


def test_fingerprint_sharded_equals_unsharded_and_sees_every_bit():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 6)), jnp.float32)
    sharded = jax.device_put(x, NamedSharding(mesh_1d(), PartitionSpec("fsdp")))
    reference = numpy_fingerprint(np.asarray(x))
    assert int(jax.jit(fingerprint)(sharded)) == reference
    assert int(fingerprint(sharded)) == reference and leaf_fingerprints([sharded]) == [reference]
    words = np.asarray(x).view(np.uint32).copy()
    for index in [(0, 0), (7, 3), (15, 5)]:
        for bit in (0, 17, 31):
            flipped = words.copy()
            flipped[index] ^= np.uint32(1 << bit)
            assert int(fingerprint(jnp.asarray(flipped.view(np.float32)))) != reference


SHARDED = [("1d", (16, 6), ("fsdp",)), ("1d", (576, 8), ("fsdp",)), ("1d", (8, 3, 5), ("fsdp",)),
           ("1d", (24,), ("fsdp",)), ("1d", (40, 24), (None, "fsdp")), ("1d", (30, 16, 8), (None, "fsdp")),
           ("1d", (30, 4, 16), (None, None, "fsdp")), ("1d", (72, 5), ("fsdp",)), ("2d", (12, 8), ("a", "b")),
           ("2d", (48, 5), (("a", "b"),)), ("2d", (10, 16), (None, ("b", "a"))), ("2d", (36, 8), ("b", None))]


def test_sharded_leaves_are_fingerprinted_where_they_lie():
    """Equal to the unsharded value, with no gathering or resharding: the only collective is an all-reduce.

    (576, 8) in 8 shards of 72 rows: splitting its rows as [18, 32] would cut the shards; the split follows them."""
    meshes = {"1d": mesh_1d(), "2d": jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)}
    leaves, want = [], []
    for i, (mesh, shape, spec) in enumerate(SHARDED):
        x = random_array(shape, "float32", seed=i)
        leaves.append(jax.device_put(x, NamedSharding(meshes[mesh], PartitionSpec(*spec))))
        want.append(int(flat_fingerprint(x)))
    assert leaf_fingerprints(leaves) == want
    for x in leaves:
        hlo = _fingerprints.lower([x], (_leading_shards(x),)).compile().as_text()
        moved = [op for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter") if op in hlo]
        assert not moved, (x.shape, x.sharding.spec, moved)


def test_leaves_on_different_devices_keep_their_order():
    devices = jax.devices()
    xs = [random_array((9, 4), "float32", seed=s) for s in range(4)]
    leaves = [jax.device_put(xs[0], devices[1]), np.asarray(xs[1]), jax.device_put(xs[2], devices[0]),
              jax.device_put(xs[3], NamedSharding(mesh_1d(), PartitionSpec(None, None)))]
    assert leaf_fingerprints(leaves) == [numpy_fingerprint(np.asarray(x)) for x in xs]


def test_tree_fingerprint_equals_numpy_reference_and_sees_single_changes():
    rng = np.random.default_rng(0)
    tree = {"f": rng.normal(size=(3, 5, 7)).astype(np.float32), "h": rng.normal(size=(9,)).astype(jnp.bfloat16),
            "i": rng.integers(-9, 9, size=(4, 4)).astype(np.int32), "b": rng.random(11) > 0.5,
            "s": np.float32(2.5)}
    got = tree_fingerprint(jax.tree.map(jnp.asarray, tree))
    assert got == {name: numpy_fingerprint(x) for name, x in tree.items()}
    f = tree["f"]
    flipped = f.copy()
    flipped.reshape(-1)[17] = np.nextafter(flipped.reshape(-1)[17], np.inf)  # one ulp
    swapped = f.copy()
    swapped.reshape(-1)[[3, 40]] = swapped.reshape(-1)[[40, 3]]
    one, two = tree_fingerprint({"f": flipped})["f"], tree_fingerprint({"f": swapped})["f"]
    assert one != got["f"]
    # a plain sum of the words cannot see the swap; the position weights do
    assert int(swapped.view(np.uint32).sum(dtype=np.uint64)) == int(f.view(np.uint32).sum(dtype=np.uint64))
    assert two != got["f"]


def test_tree_fingerprint_paths_are_the_canonical_parameter_paths():
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    tree = {"blocks": [{"lin": nnx.state(model, nnx.Param)}], "embed": jnp.zeros((2, 3))}
    got = tree_fingerprint(tree)
    assert list(got) == list(flat_params(tree)) == ["blocks.0.lin.bias", "blocks.0.lin.kernel", "embed"]
    assert list(got.values()) == [numpy_fingerprint(np.asarray(x)) for x in flat_params(tree).values()]


def test_unsupported_dtypes_are_named():
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        fingerprint(jnp.zeros(2, jnp.complex64))
    with pytest.raises(TypeError, match=r"unsupported dtype int4 of leaf a\.q"):
        tree_fingerprint({"a": {"q": jnp.zeros(2, jnp.int4)}, "b": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"unsupported dtype key<fry> of leaf k"):
        tree_fingerprint({"k": jax.random.key(0)})


def test_docstring_examples():
    result = doctest.testmod(fingerprint_module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 3, result
