"""Policy sync across processes: a small RL loop trains the tiny model with logra(...) on rollouts served by the
engine (colocated, then a worker process); weights stay bitwise equal, the worker run reproduces the colocated
run exactly, and corrupted, dropped, reordered or drifted payloads are caught and repaired by a snapshot."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.optim import LowRankUpdate, apply_updates, find_targets, logra, path_str
from logra_jax.optim.spec import SketchSpec
from logra_jax.parallel.sharding import MeshConfig, make_mesh
from logra_jax.rollout.engine import ColocatedEngine, RolloutEngine, rollout_engine
from logra_jax.rollout.process import SyncReply, WorkerError
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.slots import Sampler
from logra_jax.rollout.sync import PolicySync, flat_params
from logra_jax.rollout.worker import InProcessTransport, WorkerProcessTransport

# its module-scoped fixtures are built once: every test of the module on one xdist worker (make test's
# --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("sync_worker"), pytest.mark.slow]

CONFIG = preset("tiny")
SAMPLING = SamplingConfig(max_new_tokens=8, eos_id=1, pad_id=0, num_samples=2, temperature=1.0)
PROMPTS = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13], [0, 0, 0, 40, 41]], np.int32)
MASK = PROMPTS != 0
UPDATES = 20
P = PROMPTS.shape[1]

GRAPHDEF, PARAMS0 = nnx.split(init_model(CONFIG, seed=3))
TX = logra(rank=8, update_ratio=2e-2)


@jax.jit
def _train_step(params, opt_state, tokens, attention_mask, response_mask):
    """REINFORCE on a verifiable toy reward (share of even response tokens), updates by logra(...)."""
    reward = jnp.sum((tokens[:, P:] % 2 == 0) & response_mask, axis=1) / jnp.maximum(response_mask.sum(1), 1)
    advantage = reward - reward.mean()
    mask = jnp.concatenate([jnp.zeros((tokens.shape[0], P - 1), bool), response_mask], axis=1)

    def loss_fn(p):
        logits = nnx.merge(GRAPHDEF, p)(tokens[:, :-1], attention_mask=attention_mask[:, :-1])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.mean(advantage * jnp.sum(logp * mask, axis=1))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state, updates, {"loss": loss, "reward": reward.mean()}


def _rl_run(engine):
    params, opt_state = PARAMS0, TX.init(PARAMS0)
    sync = PolicySync(engine.sync, params)
    history, metrics = [(None, params)], []
    for i in range(UPDATES):
        rollout = engine.generate(PROMPTS, MASK, jax.random.key(i))
        params, opt_state, updates, m = _train_step(params, opt_state, rollout.tokens, rollout.attention_mask(),
                                                    rollout.response_mask)
        report = sync.push(updates, params)
        assert report.reply[:3] == ("applied", i + 1, ""), report
        assert set(report.reply.seconds) == {"check", "apply", "fingerprint"}
        metrics.append({"tokens": np.asarray(rollout.tokens), "logprobs": np.asarray(rollout.logprobs),
                        **{k: np.asarray(v) for k, v in m.items()}})
        history.append((updates, params))
    return {"metrics": metrics, "history": history, "resyncs": sync.resyncs, "fetched": engine.fetch()}


def _assert_bitwise(got, want):
    want = jax.device_get(flat_params(want))
    assert set(got) == set(want)
    for path, w in want.items():
        np.testing.assert_array_equal(np.asarray(got[path]).view(np.uint32), np.asarray(w).view(np.uint32),
                                      err_msg=path)


@pytest.fixture(scope="module")
def worker():
    with WorkerProcessTransport(CONFIG, SAMPLING) as engine:
        yield engine


@pytest.fixture(scope="module")
def colocated():
    with InProcessTransport(CONFIG, SAMPLING) as engine:
        yield engine


@pytest.fixture(scope="module")
def runs(colocated, worker):
    return {"colocated": _rl_run(colocated), "worker": _rl_run(worker)}


def test_worker_weights_bitwise_equal_after_20_updates_and_run_reproduces_colocated(runs):
    final = runs["worker"]["history"][-1][1]
    version, fetched = runs["worker"]["fetched"]
    assert version == UPDATES and runs["worker"]["resyncs"] == 0
    _assert_bitwise(fetched, final)
    _assert_bitwise(runs["colocated"]["fetched"][1], runs["colocated"]["history"][-1][1])
    _assert_bitwise(flat_params(final), runs["colocated"]["history"][-1][1])
    for step, (a, b) in enumerate(zip(runs["colocated"]["metrics"], runs["worker"]["metrics"])):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"update {step}: {name}")
    # The policy really moved, so serving stale weights would have shown up in the rollouts.
    first, last = runs["worker"]["metrics"][0]["tokens"], runs["worker"]["metrics"][-1]["tokens"]
    assert not np.array_equal(first, last)


def test_worker_rollouts_equal_in_process_sampler(worker):
    # Weights 4x the init scale: sharper, more varied next-token distributions than the 0.02-std init.
    params = jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, PARAMS0)
    PolicySync(worker.sync, params)
    sampler = Sampler(nnx.merge(GRAPHDEF, params), SAMPLING)
    for seed in (0, 7):
        key = jax.random.key(seed)
        want, got = sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), key), worker.generate(PROMPTS, MASK, key)
        for name, w in want._asdict().items():
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(w), err_msg=name)
        stale = sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), key, state=PARAMS0)
        assert not np.array_equal(np.asarray(stale.tokens), np.asarray(got.tokens))


@pytest.fixture(scope="module")
def history():
    """Trainer states (updates, params after them) over 8 updates with random bf16-wire low-rank factors."""
    targets = find_targets(PARAMS0)

    @jax.jit
    def step(params, key, count):
        keys = dict(zip(targets, jax.random.split(key, len(targets))))

        def leaf(keypath, _):
            t = targets.get(path_str(keypath))
            if t is None:
                return None
            factor = 1e-2 * jax.random.normal(keys[t.path], (*t.batch_shape, *t.rows_shape, 8))
            return LowRankUpdate(factor, count, target=t, spec=SketchSpec(rank=8, base_seed=42, round_bf16=True))

        updates = jax.tree_util.tree_map_with_path(leaf, params)
        return updates, apply_updates(params, updates)

    states = [(None, PARAMS0)]
    for version in range(8):
        states.append(step(states[-1][1], jax.random.key(version), jnp.int32(version)))
    return states


class FaultyLink:
    """A lossy link in front of an engine: corrupts, drops or holds back chosen delta versions."""

    def __init__(self, engine, faults):
        self.engine, self.faults, self.held = engine, faults, []

    def __call__(self, payload):
        fault = self.faults.pop(payload.version, None) if payload.kind == "delta" else None
        if fault in ("drop", "hold"):
            if fault == "hold":
                self.held.append(payload)
            return SyncReply("applied", payload.version)  # what the trainer believes happened
        if fault is None:
            return self.engine.sync(payload)
        data = bytearray(payload.to_bytes())
        header_end = 16 + int.from_bytes(data[8:16], "little")
        if fault == "flip_data":
            data[header_end + 5] ^= 0x10
        else:  # flip_header: a digit of the version, which still parses
            at = data.index(b'"version":') + len(b'"version":')
            data[at] ^= 0x01
        return self.engine.sync(bytes(data))


@pytest.mark.parametrize("engine_name", ["colocated", "worker"])
def test_corrupt_missing_out_of_order_and_drift_are_recovered(history, engine_name, request):
    engine = request.getfixturevalue(engine_name)
    before = engine.counts()
    link = FaultyLink(engine, {2: "flip_data", 3: "flip_header", 4: "drop", 6: "hold"})
    sync = PolicySync(link, history[0][1])
    reasons = {}
    for version in range(1, 9):
        updates, params = history[version]
        if version == 8:  # trainer weights that the delta does not explain
            params = jax.tree.map(lambda x: x, params)
            params["final_norm"]["scale"] = params["final_norm"]["scale"].replace(
                params["final_norm"]["scale"][...].at[0].add(1e-3))
        report = sync.push(updates, params)
        reasons[version] = report.resync_reason
        if version == 7:
            assert engine.sync(link.held.pop()).status == "stale"  # v6 arrives late: ignored
    assert reasons[1] == reasons[4] == reasons[6] == ""
    assert "checksum mismatch" in reasons[2] and "checksum mismatch" in reasons[3]
    assert "version gap" in reasons[5] and "version gap" in reasons[7]
    assert "fingerprint mismatch" in reasons[8] and "final_norm.scale" in reasons[8]
    assert sync.resyncs == 5
    counts = {k: v - before[k] for k, v in engine.counts().items()}
    assert counts == {"applied": 1, "loaded": 6, "stale": 1, "resync": 5}  # v8's delta counts as a resync
    version, fetched = engine.fetch()
    assert version == 8
    _assert_bitwise(fetched, params)


def test_worker_errors_are_clear():
    with pytest.raises(WorkerError, match="did not connect within"):
        WorkerProcessTransport(CONFIG, SAMPLING, start_timeout_s=0.01)
    engine = WorkerProcessTransport(CONFIG, SAMPLING)
    with pytest.raises(WorkerError, match="no weights yet"):
        engine.generate(PROMPTS, MASK, jax.random.key(0))  # reported by the worker, which keeps serving
    assert engine.fetch() == (None, {})
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="exited with code"):
        engine.fetch()
    engine.close()
    with pytest.raises(WorkerError, match="closed"):
        engine.fetch()


def test_rollout_engine_switch():
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    args = (CONFIG, SAMPLING, mesh, PARAMS0, {})
    engine = rollout_engine(0, *args)
    assert isinstance(engine, ColocatedEngine) and isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="workers must be 0"):
        rollout_engine(2, *args)
    with pytest.raises(ValueError, match="only apply to workers=1"):
        rollout_engine(0, *args, platform="cpu")
