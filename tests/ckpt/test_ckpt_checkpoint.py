"""logra_jax.job.checkpoint: round trips of our train-state trees, keep-N, interrupted saves, corruption, mismatches.

The fingerprint itself (logra_jax.core.fingerprint) is tested in test_ckpt_fingerprint.py."""

import json
import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from logra_jax.job.checkpoint import CheckpointError, CheckpointManager
from logra_jax.models.config import preset
from logra_jax.models.decoder import abstract_model
from logra_jax.optim import logra


def bits(x) -> tuple:
    a = np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return a.shape, str(x.dtype), a.tobytes()


def assert_bitwise_equal(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        assert bits(g) == bits(w), jax.tree_util.keystr(path)


def fsdp_mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))


def fsdp_sharding(shape, mesh):
    """Shard the first axis that 8 divides over fsdp, replicate otherwise."""
    spec = [None] * len(shape)
    for i, n in enumerate(shape):
        if n % 8 == 0:
            spec[i] = "fsdp"
            break
    return NamedSharding(mesh, PartitionSpec(*spec))


@pytest.fixture(scope="module")
def train_tree():
    """A tree shaped like the training loop's: nnx params of the tiny model, a LoGRA optax state, step, keys.

    Every array leaf is filled with random values (initialising the real model eagerly costs seconds).
    """
    rng = np.random.default_rng(0)

    def fill(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(rng.normal(size=x.shape), x.dtype)
        return jnp.asarray(rng.integers(0, 1000, size=x.shape), x.dtype)

    params = jax.tree.map(fill, nnx.state(abstract_model(preset("tiny")), nnx.Param))
    opt_state = jax.tree.map(fill, logra(rank=4).init(params))
    return {"params": params, "opt": opt_state, "step": jnp.int32(5), "key": jax.random.key(3),
            "key_data": jax.random.key_data(jax.random.key(4, impl="rbg")),
            "half": jnp.linspace(-3, 3, 16, dtype=jnp.bfloat16), "mask": jnp.array([True, False, True])}


def test_round_trip_bitwise_with_requested_shardings(tmp_path, train_tree):
    data_state = {"next_index": 17, "shuffle": {"seed": 3, "epoch": 1}}
    extra = {"config": {"rank": 4}, "seeds": [42, 7], "accuracy_before": 0.125}
    with CheckpointManager(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(5, train_tree, data_state=data_state, extra=extra)
    mesh = fsdp_mesh()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fsdp_sharding(x.shape, mesh)),
                            train_tree)
    with CheckpointManager(tmp_path / "ckpt", create=False) as ckpt:
        assert ckpt.latest_step() == 5
        restored, got_data, got_extra = ckpt.restore(abstract=abstract)
    assert_bitwise_equal(restored, train_tree)
    assert isinstance(restored["params"], nnx.State)
    assert type(restored["opt"]) is type(train_tree["opt"])
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
        assert got.sharding == want.sharding
    embedding = restored["params"]["embed"]["embedding"]
    assert embedding[...].sharding.spec == PartitionSpec("fsdp", None)
    assert embedding.get_metadata()["axes"] == ("vocab", "embed")
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(train_tree["key"])
    np.testing.assert_array_equal(jax.random.normal(restored["key"], (4,)), jax.random.normal(train_tree["key"], (4,)))
    assert got_data == data_state and got_extra == extra


def test_restore_into_concrete_arrays_and_typed_keys_of_other_impls(tmp_path):
    tree = {"k": jax.random.split(jax.random.key(0, impl="rbg"), 8), "w": jnp.ones((8, 2)), "c": jnp.arange(3)}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, tree)
        targets = jax.tree.map(lambda x: jax.device_put(x, fsdp_sharding(x.shape, fsdp_mesh())), tree)
        targets["c"] = jax.device_put(tree["c"], jax.devices()[3])  # a second device assignment in one tree
        restored, data_state, extra = ckpt.restore(1, abstract=targets)
    assert_bitwise_equal(restored, tree)
    assert restored["k"].sharding == targets["k"].sharding
    assert restored["c"].devices() == {jax.devices()[3]}
    assert data_state == {} and extra == {}


def test_grain_iterator_resumes_from_restored_state(tmp_path):
    dataset = grain.MapDataset.range(40).shuffle(seed=3).batch(4).to_iter_dataset()
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(3, {"step": jnp.int32(3)}, data_state=iterator.get_state())
        _, data_state, _ = ckpt.restore(abstract={"step": jax.ShapeDtypeStruct((), jnp.int32)})
    expected = [next(iterator).tolist() for _ in range(4)]
    resumed = iter(dataset)
    resumed.set_state(data_state)
    assert [next(resumed).tolist() for _ in range(4)] == expected


@pytest.mark.parametrize("async_save", [True, False])
def test_keep_n_and_save_every(tmp_path, async_save):
    tree = {"w": jnp.zeros(3)}
    with CheckpointManager(tmp_path, keep=2, save_every=2, async_save=async_save) as ckpt:
        saved = [ckpt.save(s, {"w": jnp.full(3, float(s))}) for s in range(1, 9)]
        assert ckpt.save(9, tree, force=True)
        assert saved == [s % 2 == 0 for s in range(1, 9)]
        assert ckpt.all_steps() == [8, 9]
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["8", "9"]
        restored, _, _ = ckpt.restore(8, abstract=tree)
        np.testing.assert_array_equal(restored["w"], np.full(3, 8.0))
        with pytest.raises(ValueError, match="exists already"):
            ckpt.save(9, tree, force=True)


def test_interrupted_save_is_ignored(tmp_path):
    tree = {"w": jnp.arange(64.0), "step": jnp.int32(2)}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, {"w": jnp.zeros(64), "step": jnp.int32(1)})
        ckpt.save(2, tree)
    # What a save killed before its final rename leaves behind: orbax's temporary directory, half written.
    partial = tmp_path / "3.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(tmp_path / "2", partial)
    for f in (partial / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with CheckpointManager(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        restored, _, _ = ckpt.restore(abstract=tree)
        assert_bitwise_equal(restored, tree)
        ckpt.save(3, {"w": jnp.ones(64), "step": jnp.int32(3)})
        assert ckpt.latest_step() == 3
        np.testing.assert_array_equal(ckpt.restore(abstract=tree)[0]["w"], np.ones(64))
    assert not partial.exists()


def _saved_pair(path):
    """Steps 1 and 2 of an incompressible tree; returns (abstract, step-2 directory)."""
    rng = np.random.default_rng(0)
    with CheckpointManager(path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"a": jnp.asarray(rng.normal(size=(512,)), jnp.float32), "b": jnp.arange(9)},
                      data_state={"next_index": step}, extra={"step": step})
    return {"a": jax.ShapeDtypeStruct((512,), jnp.float32), "b": jax.ShapeDtypeStruct((9,), jnp.int32)}, path / "2"


def _array_files(step_dir):
    return [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]


def _delete_array_files(step_dir):
    for f in _array_files(step_dir):
        f.unlink()


def _truncate_array_files(step_dir):
    for f in _array_files(step_dir):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_a_byte(step_dir):
    f = max(_array_files(step_dir), key=lambda f: f.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _garble(name):
    def garble(step_dir):
        (step_dir / name).write_text('{"tree_metadata": ')
    garble.__name__ = f"garble_{name.replace('/', '_')}"
    return garble


def _other_steps_state(step_dir):
    """Step 1's (valid) state item under step 2: only the fingerprints can tell."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "1" / "state", step_dir / "state")


# A failed TensorStore read leaves an orbax asyncio callback behind that reports "Event loop is closed" when
# collected; the error we check is the one restore raises.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corrupt", [_delete_array_files, _truncate_array_files, _flip_a_byte,
                                     _garble("state/_METADATA"), _garble("layout/metadata"), _garble("data/metadata"),
                                     _other_steps_state], ids=lambda f: f.__name__)
def test_corrupted_checkpoint_raises_naming_the_step(tmp_path, corrupt):
    abstract, step_dir = _saved_pair(tmp_path)
    corrupt(step_dir)
    with CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=str(step_dir)) as info:
            ckpt.restore(abstract=abstract)
        assert "other steps on disk: [1]" in str(info.value)
        assert len(str(info.value)) < 1000
        restored, data_state, extra = ckpt.restore(1, abstract=abstract)
    np.testing.assert_array_equal(restored["b"], np.arange(9))
    assert data_state == {"next_index": 1} and extra == {"step": 1}


def test_same_data_from_another_step_is_caught_by_the_fingerprint(tmp_path):
    abstract, step_dir = _saved_pair(tmp_path)
    _other_steps_state(step_dir)
    with CheckpointManager(tmp_path) as ckpt, pytest.raises(CheckpointError, match=r"leaf \['a'\] does not match"):
        ckpt.restore(2, abstract=abstract)


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: {**t, "c": t["a"]}, r"leaf \['c'\] is not in the checkpoint"),
    (lambda t: {"a": t["a"]}, r"checkpoint leaf \['b'\] is not in the target"),
    (lambda t: {**t, "b": jax.ShapeDtypeStruct((8,), jnp.int32)}, r"leaf \['b'\] has shape \[9\] in the checkpoint"),
    (lambda t: {**t, "a": jax.ShapeDtypeStruct((512,), jnp.bfloat16)}, r"leaf \['a'\] has dtype float32"),
    (lambda t: {**t, "b": jax.ShapeDtypeStruct((9,), jax.random.key(0).dtype)},
     r"leaf \['b'\] has dtype int32 in the checkpoint, key<fry> in the target"),
    (lambda t: (t["a"], t["b"]), r"leaf \[0\] is not in the checkpoint"),
])
def test_structure_mismatch_names_the_first_leaf(tmp_path, change, message):
    abstract, step_dir = _saved_pair(tmp_path)
    with CheckpointManager(tmp_path) as ckpt, pytest.raises(CheckpointError, match=message) as info:
        ckpt.restore(abstract=change(abstract))
    assert str(step_dir) in str(info.value)


def test_missing_checkpoints_raise_file_not_found(tmp_path):
    abstract = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointManager(tmp_path / "nowhere", create=False)
    with CheckpointManager(tmp_path / "empty") as ckpt, pytest.raises(FileNotFoundError, match="available steps: none"):
        ckpt.restore(abstract=abstract)
    with CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.save(4, {"w": jnp.ones(2)})
        ckpt.save(6, {"w": jnp.ones(2)})
        with pytest.raises(FileNotFoundError, match=r"run/5 not found \(available steps: \[4, 6\]\)"):
            ckpt.restore(5, abstract=abstract)
        shutil.rmtree(tmp_path / "run" / "6")
        assert ckpt.latest_step() == 4
        with pytest.raises(FileNotFoundError, match=r"run/6 not found"):
            ckpt.restore(6, abstract=abstract)


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)
    with pytest.raises(ValueError, match="save_every"):
        CheckpointManager(tmp_path, save_every=0)
    with CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(TypeError, match="data_state is not JSON-serialisable"):
            ckpt.save(1, {"w": jnp.ones(2)}, data_state={"x": object()})
        with pytest.raises(TypeError, match="extra must be a dict"):
            ckpt.save(1, {"w": jnp.ones(2)}, extra=[1, 2])
        with pytest.raises(ValueError, match="non-negative"):
            ckpt.save(-1, {"w": jnp.ones(2)})
        with pytest.raises(TypeError, match=r"abstract leaf \['w'\]"):
            ckpt.restore(abstract={"w": "float32"})
        with pytest.raises(TypeError, match=r"unsupported dtype complex64 of leaf \['c'\]"):
            ckpt.save(1, {"c": jnp.ones(2, jnp.complex64), "w": jnp.ones(2)})
        assert ckpt.all_steps() == []


def test_layout_record_is_plain_json(tmp_path):
    """The layout item is readable without orbax: one record per leaf with its path, shape, dtype, fingerprint."""
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "opt": optax.ScaleByAdamState(jnp.int32(1), {"m": jnp.ones(2)},
                                                                              {"m": jnp.zeros(2)})}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, tree)
    layout = json.loads((tmp_path / "1" / "layout" / "metadata").read_text())
    by_path = {e["path"]: e for e in layout["leaves"]}
    assert by_path["['w']"] == {"path": "['w']", "shape": [2, 3], "dtype": "float32", "key_impl": None,
                                "fingerprint": 1780482048}  # Σ c_i w_i (numpy reference: test_ckpt_fingerprint)
    assert set(by_path) == {"['w']", "['opt'].count", "['opt'].mu['m']", "['opt'].nu['m']"}


def test_numpy_and_python_leaves_are_stored_as_jax_arrays(tmp_path):
    tree = {"n": 3, "x": 0.5, "a": np.arange(4, dtype=np.int16)}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, tree)
        for abstract in (jax.eval_shape(lambda: tree), tree):
            restored, _, _ = ckpt.restore(abstract=abstract)
            assert {k: (v.dtype, v.tolist()) for k, v in restored.items()} == {
                "n": (jnp.int32, 3), "x": (jnp.float32, 0.5), "a": (jnp.int16, [0, 1, 2, 3])}


def test_data_states_of_a_multi_process_run_go_to_their_process(monkeypatch):
    """A multi-process checkpoint holds one data-iterator state per process; each process restores its own,
    and a run with another number of processes is told how many wrote it."""
    from logra_jax.job import checkpoint

    saved = {checkpoint.PER_PROCESS: [{"next_index": 4}, {"next_index": 9}]}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert checkpoint._own_data_state(saved, "checkpoint X") == {"next_index": 9}
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint X holds the data-iterator state of 1 process"):
        checkpoint._own_data_state({"next_index": 4}, "checkpoint X")
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert checkpoint._gather_data_states({"next_index": 4}) == {"next_index": 4}  # single process: unchanged
    with pytest.raises(checkpoint.CheckpointError, match="holds the data-iterator state of 2 process"):
        checkpoint._own_data_state(saved, "checkpoint X")
