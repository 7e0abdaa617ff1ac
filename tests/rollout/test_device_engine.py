"""The engine on devices of its own (8 fake devices: trainer 4 + engine 4, trainer 6 + engine 2): fed by device
payloads from a real LoGRA train step, its float32 masters stay bitwise the trainer's and its decode weights bit for
bit what the trainer's weights round to, all of it on the engine's devices and no payload array through the host;
its rollouts equal the colocated engine's on the same weights; misplaced devices are refused."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.optim import apply_updates, logra
from logra_jax.parallel.sharding import MeshConfig, make_mesh, param_shardings
from logra_jax.rollout.engine import ColocatedEngine, DeviceEngine, WorkerEngine, rollout_engine
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.sync import flat_params
from logra_jax.rollout.vllm.settings import VLLMSettings
from logra_jax.rollout.worker import RolloutWeights, place

CONFIG = preset("tiny", dtype="bfloat16")
SAMPLING = SamplingConfig(max_new_tokens=6, eos_id=1, pad_id=0, num_samples=2, length_buckets=1)
PROMPTS = np.array([[0, 5, 6, 7], [9, 10, 11, 12], [0, 0, 40, 41], [3, 4, 5, 6]], np.int32)
MASK = PROMPTS != 0
TOKENS = np.random.default_rng(0).integers(2, CONFIG.vocab_size, (8, 12)).astype(np.int32)
UPDATES = 3
# (trainer devices, trainer mesh, engine decode_tensor): the engine takes the remaining devices
SPLITS = {"4+4": (4, MeshConfig(fsdp=2, tensor=2), 2), "6+2": (6, MeshConfig(data=3, fsdp=2), 0)}

# jax.Array's implementation: every read of a device array to the host (np.asarray, device_get, jax.device_put's
# fallback) goes through its `_value`
ArrayImpl = type(jnp.zeros(()))

pytestmark = pytest.mark.xdist_group("device_engine")


def _bits(x):
    """The bit patterns of a float array (bf16 has no numpy dtype of its own to compare), other arrays as they are."""
    x = np.asarray(jax.device_get(x))
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _devices(tree):
    return set().union(*(x.sharding.device_set for x in jax.tree.leaves(tree)))


def _train_step(graphdef, tx):
    """One LoGRA step on the next-token loss of TOKENS (jitted): (params, opt_state) -> (updates, params,
    opt_state)."""

    @jax.jit
    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        updates, opt_state = tx.update(jax.grad(loss_fn)(params), opt_state, params)
        return updates, apply_updates(params, updates), opt_state

    return step


@contextlib.contextmanager
def _watch(received, to_host):
    """Record every payload the engine's receiver gets and the shape of every device array read to the host."""
    receive, value = RolloutWeights.receive, ArrayImpl._value
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RolloutWeights, "receive",
                      lambda self, payload: received.append(payload) or receive(self, payload))
        patch.setattr(ArrayImpl, "_value", property(lambda x: to_host.append(x.shape) or value.fget(x)))
        yield


@pytest.fixture(scope="module", params=list(SPLITS))
def trained(request):
    """The trainer on its devices, the engine on the rest (`rollout_engine(..., engine_devices=...)`), published
    after each of UPDATES train steps; each payload the engine received is recorded."""
    n, mesh_config, tensor = SPLITS[request.param]
    mesh = make_mesh(mesh_config, jax.devices()[:n])
    graphdef, params, rest = nnx.split(init_model(CONFIG, seed=2), nnx.Param, ...)
    params = jax.device_put(params, param_shardings(params, mesh))
    received, to_host = [], []
    with _watch(received, to_host):
        engine = rollout_engine(0, CONFIG, SAMPLING, mesh, params, rest, decode_tensor=tensor,
                                engine_devices=jax.devices()[n:])
    tx = logra(rank=4, update_ratio=3e-2)
    step, opt_state = _train_step(graphdef, tx), tx.init(params)
    tokens = jax.device_put(TOKENS, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    reports, steps = [], []
    for _ in range(UPDATES):
        updates, params, opt_state = step(params, opt_state, tokens)
        held = engine.state  # as a rollout in flight holds them
        with _watch(received, to_host):
            reports.append(engine.publish(updates, params))
        assert not any(x.is_deleted() for x in jax.tree.leaves(held))  # the update donated none of them
        steps.append((jax.device_get(flat_params(params)), jax.device_get(flat_params(engine.state)),
                      engine.fetch()))
    yield {"split": request.param, "engine": engine, "mesh": mesh, "params": params, "rest": rest,
           "reports": reports, "steps": steps, "received": received, "to_host": to_host}
    engine.close()


def test_engine_weights_bitwise_the_trainers_rounded_after_each_update(trained):
    engine, mesh = trained["engine"], trained["mesh"]
    assert isinstance(engine, DeviceEngine) and isinstance(engine, WorkerEngine)
    n = mesh.devices.size
    assert set(engine.mesh.devices.flat) == set(jax.devices()[n:])
    assert engine.tensor == (SPLITS[trained["split"]][2] or 1)  # 0: the default, 1 on CPU devices
    assert [r.reply[:3] for r in trained["reports"]] == [("applied", v, "") for v in range(1, UPDATES + 1)]
    assert engine.resyncs == 0 and engine.version == UPDATES
    for version, (theirs, ours, (fetched_version, masters)) in enumerate(trained["steps"], 1):
        assert fetched_version == version
        for path, w in theirs.items():
            np.testing.assert_array_equal(_bits(masters[path]), _bits(w), err_msg=f"{path} master, v{version}")
            want = w.astype(jnp.bfloat16) if path.endswith(("kernel", "embedding")) else w
            assert ours[path].dtype == want.dtype, path
            np.testing.assert_array_equal(_bits(ours[path]), _bits(want), err_msg=f"{path} decode, v{version}")
    first, last = trained["steps"][0][0], trained["steps"][-1][0]
    assert any(not np.array_equal(first[p], last[p]) for p in first)  # the updates moved the weights
    # Everything the engine holds is on its own devices; the trainer's weights stay on the trainer's.
    assert _devices(engine.state) == _devices(engine.transport.weights.params) == set(engine.mesh.devices.flat)
    assert _devices(trained["params"]) == set(mesh.devices.flat)


def test_payloads_are_device_arrays_from_the_trainers_devices(trained):
    snapshot, *deltas = trained["received"]
    assert snapshot.kind == "snapshot" and [d.kind for d in deltas] == ["delta"] * UPDATES
    trainer = set(trained["mesh"].devices.flat)
    for payload in trained["received"]:
        arrays = [*payload.weights.values(), *payload.dense.values(), *(f.factor for f in payload.factors.values())]
        assert payload.on_device and arrays
        assert all(isinstance(a, jax.Array) and a.sharding.device_set <= trainer for a in arrays)
    assert {f.factor.dtype for d in deltas for f in d.factors.values()} == {jnp.dtype(jnp.bfloat16)}
    # Nothing but scalars (the fingerprints, a factor's step) was read back to the host on the way.
    assert trained["to_host"] and set(trained["to_host"]) == {()}
    trained["engine"].release()  # nothing on the trainer's devices to drop: the weights stay
    assert trained["engine"].state is not None


def test_rollouts_equal_the_colocated_engines_on_the_same_weights(trained):
    engine, mesh = trained["engine"], trained["mesh"]
    colocated = ColocatedEngine(CONFIG, SAMPLING, mesh, trained["params"], trained["rest"], tensor=engine.tensor)
    replicated, rows = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)) for spec in ((), ("fsdp",)))
    for seed in (0, 5):
        key = jax.random.key(seed)
        want = colocated.generate(PROMPTS, MASK, key)
        # inputs from the host and from the trainer's devices: the same rollout, on the engine's devices
        for prompts, mask, k in ((PROMPTS, MASK, key), (*jax.device_put((PROMPTS, MASK), rows),
                                                        jax.device_put(key, replicated))):
            got = engine.generate(prompts, mask, k)
            assert _devices(got.tokens) == set(engine.mesh.devices.flat)
            for name, w in want._asdict().items():
                if w is not None:
                    np.testing.assert_array_equal(_bits(getattr(got, name)), _bits(w), err_msg=name)
    colocated.close()


def test_engine_devices_errors():
    mesh = make_mesh(MeshConfig(), jax.devices()[:4])
    _, params, rest = nnx.split(init_model(CONFIG, seed=2), nnx.Param, ...)
    args = (CONFIG, SAMPLING, mesh, params, rest)
    with pytest.raises(ValueError, match=r"rollout.engine_devices \[3, 4, 5\] overlap .* devices \[3\]"):
        rollout_engine(0, *args, engine_devices=jax.devices()[3:6])
    with pytest.raises(ValueError, match=r"rollout.engine_devices .* needs workers=0 .* got workers=1"):
        rollout_engine(1, *args, engine_devices=jax.devices()[4:])
    with pytest.raises(ValueError, match=r"rollout.engine_devices .* got workers=0 and vLLM"):
        rollout_engine(0, *args, engine_devices=jax.devices()[4:], vllm=VLLMSettings())
    with pytest.raises(ValueError, match="only apply to workers=1"):
        rollout_engine(0, *args, engine_devices=jax.devices()[4:], platform="cpu")
    with pytest.raises(ValueError, match="engine_devices: the engine needs distinct devices"):
        rollout_engine(0, *args, engine_devices=[jax.devices()[4]] * 2)
    with pytest.raises(ValueError, match="decode_tensor = 3 must divide the 4 devices"):
        rollout_engine(0, *args, engine_devices=jax.devices()[4:], decode_tensor=3)


def test_place_moves_arrays_between_device_sets_without_the_host():
    trainer = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])
    want = np.arange(12 * 6, dtype=np.float32).reshape(12, 6)
    x = jax.device_put(want, jax.sharding.NamedSharding(trainer, jax.sharding.PartitionSpec("fsdp", "tensor")))
    engine = make_mesh(MeshConfig(data=3, fsdp=1, tensor=1), jax.devices()[5:])
    to_host = []
    for spec in ((), ("data",), (None, "data")):
        sharding = jax.sharding.NamedSharding(engine, jax.sharding.PartitionSpec(*spec))
        with _watch([], to_host):
            y = place(x, sharding)
        assert y.sharding == sharding
        np.testing.assert_array_equal(np.asarray(y), want)
    assert to_host == []
    with _watch([], to_host):  # what place avoids: jax.device_put reads a sharded array back to the host
        jax.device_put(x, jax.sharding.NamedSharding(engine, jax.sharding.PartitionSpec()))
    assert to_host == [(12, 6)]
    assert place(x, x.sharding) is x
