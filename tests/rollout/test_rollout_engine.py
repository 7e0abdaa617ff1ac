"""The colocated engine: weights resident in a decode layout unlike the trainer's (8 fake devices), bit for bit what
the trainer's weights round to after 20 optimizer updates, each split at most over its tensor-parallel pair (the
trainer's 8 ways); rollouts equal a one-device sampler's; a float32 job on one device shares the trainer's arrays.
(What a decode step moves between devices is counted on the real compilers by `python -m logra_jax.plan`.)"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model, layer_source
from logra_jax.optim import apply_updates, logra
from logra_jax.parallel.derived_specs import full_spec
from logra_jax.parallel.sharding import MeshConfig, make_mesh, param_shardings
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout.engine import ColocatedEngine, decode_mesh, decode_tensor_sizes, default_decode_tensor
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.slots import Sampler
from logra_jax.rollout.sync import flat_params

CONFIG = preset("tiny", dtype="bfloat16")
SAMPLING = SamplingConfig(max_new_tokens=6, eos_id=1, pad_id=0, num_samples=2, slots=4, decode_steps=3)
PROMPTS = np.array([[0, 5, 6, 7], [9, 10, 11, 12], [0, 0, 40, 41], [3, 4, 5, 6]], np.int32)
MASK = PROMPTS != 0


def _bits(x):
    x = np.asarray(jax.device_get(x))
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


# every test of the module on one xdist worker, its session fixture built once (make test's --dist loadgroup; a
# module-scoped fixture is rebuilt when xdist interleaves another module's tests)
pytestmark = pytest.mark.xdist_group("rollout_engine")


@pytest.fixture(scope="session")
def trained():
    """20 LoGRA updates of a tiny bf16-compute model in the trainer's FSDP 8 layout, the engine (decode layout
    data 4 × tensor 2) published after each, one leaf per program (`PUBLISH_GROUP_BYTES` = 1 byte); returns the
    engine and the trainer's final weights."""
    mesh = make_mesh(MeshConfig(fsdp=8))
    model = init_model(CONFIG, seed=2)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, param_shardings(params, mesh))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_lib, "PUBLISH_GROUP_BYTES", 1)  # every leaf its own program: publish in groups
        engine = ColocatedEngine(CONFIG, SAMPLING, mesh, params, rest, tensor=2)
    tx = logra(rank=4, update_ratio=3e-2)
    opt_state = tx.init(params)

    @jax.jit
    def update(params, opt_state, key):
        grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape, p.dtype), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return updates, apply_updates(params, updates), opt_state

    first = jax.device_get(flat_params(engine.state))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_lib, "PUBLISH_GROUP_BYTES", 1)
        for step in range(20):
            updates, params, opt_state = update(params, opt_state, jax.random.key(step))
            report = engine.publish(updates, params)
    return {"engine": engine, "params": params, "rest": rest, "graphdef": graphdef, "mesh": mesh, "first": first,
            "report": report}


def test_engine_weights_bitwise_the_trainers_rounded_after_20_updates(trained):
    engine, params = trained["engine"], trained["params"]
    assert dict(engine.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    ours, theirs = flat_params(engine.state), flat_params(params)
    moved = 0
    for path, w in theirs.items():
        mine = ours[path]
        assert mine.dtype == (jnp.bfloat16 if path.endswith(("kernel", "embedding")) else jnp.float32), path
        np.testing.assert_array_equal(_bits(mine), _bits(w.astype(mine.dtype)), err_msg=path)
        # Split over the tensor pair at most (the trainer's FSDP split each weight 8 ways).
        assert np.prod(mine.sharding.shard_shape(mine.shape)) * 2 >= mine.size, (path, mine.sharding)
        if path.endswith(("kernel", "embedding")):
            assert np.prod(w.sharding.shard_shape(w.shape)) * 8 == w.size, (path, w.sharding)
        moved += not np.array_equal(_bits(mine), _bits(trained["first"][path]))
    assert moved >= len(theirs) // 2  # the updates really changed the weights the engine holds
    # Replicated float32 norm scales are the trainer's own arrays; the matrices are cast and resharded copies.
    assert trained["report"].nbytes + engine.shared_bytes == sum(x.size * x.dtype.itemsize for x in ours.values())
    assert ours["final_norm.scale"] is theirs["final_norm.scale"] and engine.shared_bytes > 0
    assert trained["report"].version == 20


def test_publish_groups_partition_the_leaves_within_the_byte_limit(trained):
    """`DecodeLayout.groups`: every leaf to copy exactly once, in order; a group over the limit is a single leaf;
    a limit of one leaf's bytes or less gives one program per leaf, the whole model's bytes one program."""
    layout = trained["engine"].layout
    _, to_copy = layout.split({**flat_params(trained["rest"]), **flat_params(trained["params"])})
    want = layout.leaves
    size = {p: int(np.prod(want[p].sharding.shard_shape(want[p].shape))) * want[p].dtype.itemsize for p in to_copy}
    assert len(to_copy) > 2
    for limit in (1, min(size.values()), max(size.values()), 2 * max(size.values()), sum(size.values())):
        groups = layout.groups(to_copy, limit)
        assert [p for g in groups for p in g] == list(to_copy), limit
        assert all(len(g) == 1 or sum(size[p] for p in g) <= limit for g in groups), limit
        # greedy: no two neighbouring groups would fit in one
        assert all(sum(size[p] for p in a) + sum(size[p] for p in b) > limit
                   for a, b in itertools.pairwise(groups)), limit
    assert len(layout.groups(to_copy, 1)) == len(to_copy) and len(layout.groups(to_copy, sum(size.values()))) == 1


def test_engine_rollouts_equal_a_one_device_sampler(trained):
    engine = trained["engine"]
    host = jax.device_get(engine.state)
    want = Sampler(nnx.merge(engine.graphdef, host), SAMPLING)(jnp.asarray(PROMPTS), jnp.asarray(MASK),
                                                               jax.random.key(5))
    got = engine.generate(PROMPTS, MASK, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=2e-2)


def test_a_per_layer_engine_holds_each_layer_of_the_trainers_stacks(trained):
    """The GPU engine's layout (`ModelConfig.decode_unroll`; `per_layer=True` picks it on these CPU devices): each
    layer of a stacked weight a leaf of its own, bit for bit that layer of the trainer's weight rounded and split as
    the stacked engine splits it, cut out by the publish (no block weight shared); the same rollouts."""
    stacked = trained["engine"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_lib, "PUBLISH_GROUP_BYTES", 1)  # one trainer leaf, L engine leaves, per program
        engine = ColocatedEngine(CONFIG, SAMPLING, trained["mesh"], trained["params"], trained["rest"], tensor=2,
                                 per_layer=True)
    assert engine.layout.config.decode_unroll and not stacked.layout.config.decode_unroll
    ours, theirs = flat_params(engine.state), flat_params(stacked.state)
    blocks = [p for p in theirs if p.startswith("blocks.")]
    assert len(ours) == len(theirs) + (CONFIG.num_layers - 1) * len(blocks) and blocks
    for path, mine in ours.items():
        source, layer = layer_source(path)
        full = theirs[source]
        np.testing.assert_array_equal(_bits(mine), _bits(full if layer is None else full[layer]), err_msg=path)
        spec = lambda x: tuple(full_spec(x.sharding.spec, x.ndim))
        assert spec(mine) == (spec(full) if layer is None else spec(full)[1:]), path
    # Shared: the replicated float32 final norm alone (the stacked engine also shares the blocks' norm stacks).
    norm = ours["final_norm.scale"]
    assert norm is flat_params(trained["params"])["final_norm.scale"] and engine.shared_bytes == norm.size * 4
    total = sum(x.size * x.dtype.itemsize for x in ours.values())
    assert engine.copied_bytes + engine.shared_bytes == total == stacked.copied_bytes + stacked.shared_bytes
    got, want = (e.generate(PROMPTS, MASK, jax.random.key(5)) for e in (engine, stacked))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=2e-2)


def test_float32_job_on_one_device_shares_the_trainers_arrays():
    config = preset("tiny")
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    _, params, rest = nnx.split(init_model(config), nnx.Param, ...)
    params = jax.device_put(params, param_shardings(params, mesh))
    engine = ColocatedEngine(config, SAMPLING, mesh, params, rest)
    assert engine.copied_bytes == 0 and engine.tensor == 1
    for path, leaf in flat_params(params).items():
        assert flat_params(engine.state)[path] is leaf, path
    updated = jax.tree.map(lambda x: x + 1, params)
    assert engine.publish(optax.EmptyState(), updated).nbytes == 0
    assert flat_params(engine.state)["final_norm.scale"] is flat_params(updated)["final_norm.scale"]
    # Released before a train step: nothing held, no rollout until the next publish.
    engine.release()
    assert engine.state is None
    prompts = (jnp.array([[5, 6, 7]]), jnp.array([[1, 1, 1]]), jax.random.key(0))
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(*prompts)
    engine.publish(optax.EmptyState(), params)
    assert engine.generate(*prompts).tokens.shape == (SAMPLING.num_samples, 3 + SAMPLING.max_new_tokens)


def test_decode_layout_choice_and_errors():
    mesh = make_mesh(MeshConfig(fsdp=8))
    with pytest.raises(ValueError, match=r"config\.rollout\.decode_tensor = 3 must divide the 8 devices"):
        decode_mesh(mesh, 3)
    assert default_decode_tensor(CONFIG, mesh) == 1  # CPU devices: the trainer's tensor size
    # t divides the devices, the heads (4) and the KV heads (2); accelerators take the largest.
    assert decode_tensor_sizes(CONFIG, 8) == [1, 2]
    wide = preset("tiny", num_heads=8, num_kv_heads=8, head_dim=8)
    assert decode_tensor_sizes(wide, 8) == [1, 2, 4, 8] and decode_tensor_sizes(wide, 6) == [1, 2]
