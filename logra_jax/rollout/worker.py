"""The receiving end of low-rank policy sync: `RolloutWeights` (float32 masters kept bitwise equal to the
trainer's by the payloads of logra_jax.rollout.sync) and the engine around them, in a worker process
(`WorkerProcessTransport`, what `logra_jax.rollout.engine.WorkerEngine` drives) or in this process
(`InProcessTransport`: the same receiver without a process boundary, for tests and benchmarks of the payload route).

Both transports expose the same calls: sync(payload | bytes) -> SyncReply; generate(prompts, prompt_mask, key,
config=None) -> Rollout (logra_jax.rollout.slots, on the engine's current weights); fetch() -> (version, {path:
array}); counts(); close().
The worker (`python -m logra_jax.rollout.worker --connect HOST:PORT --secret-stdin`) is an engine process of
logra_jax.rollout.process: it connects back to the trainer, proves the run's secret, receives in its hello the model
and sampling configs and the JAX numerics flags that must match the trainer's (default matmul precision, threefry
partitioning, x64), then serves one request at a time. It runs on the trainer's platform by default (bitwise sync
needs the same backend on both ends) and, on CPU, on one device whatever XLA_FLAGS asked for.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.core.fingerprint import tree_fingerprint
from logra_jax.core.tree_paths import flat_params, path_str
from logra_jax.models.config import ModelConfig
from logra_jax.models.decoder import abstract_model
from logra_jax.optim.lowrank import apply_updates
from logra_jax.rollout import process
from logra_jax.rollout.process import EngineProcess, Reply, SyncReply, run_engine
from logra_jax.rollout.sampling import Rollout, SamplingConfig
from logra_jax.rollout.slots import Sampler
from logra_jax.rollout.sync import SyncPayload
from logra_jax.rollout.wire import Channel, PayloadError, new_secret, pack, unpack

_JAX_FLAGS = ("jax_default_matmul_precision", "jax_threefry_partitionable", "jax_enable_x64")

_apply = jax.jit(apply_updates, donate_argnums=0)


_reshard = jax.jit(jax.lax.with_sharding_constraint, static_argnums=1)


def place(a: Any, sharding: jax.sharding.NamedSharding) -> jax.Array:
    """`a` laid out in `sharding`, a device array never through the host.

    jax.device_put reads an array back to the host when it moves it to other devices in another layout (jax
    0.10.2: a sharded source has no buffer holding a whole destination shard), so an array on other devices (the
    trainer's, for `logra_jax.rollout.engine.DeviceEngine`) is gathered where it lies, copied whole to each of the
    sharding's devices (buffer copies between devices), then cut there.

    Args:
      a: a device array (a global array of a multi-process run too, when already laid out so) or a host array.
      sharding: where it goes.

    Returns:
      `a` itself when already laid out so; else a copy: resharded where it lies (on the sharding's devices),
      moved as above (from other devices), or copied in (a host array).
    """
    if not isinstance(a, jax.Array):
        return jax.device_put(a, sharding)
    if a.sharding.is_equivalent_to(sharding, a.ndim):
        return a
    if a.sharding.device_set == sharding.device_set:
        return _reshard(a, sharding)
    if not a.sharding.is_fully_replicated:
        a = _reshard(a, jax.sharding.NamedSharding(a.sharding.mesh, jax.sharding.PartitionSpec()))
    whole = jax.device_put(a, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
    return whole if whole.sharding.is_equivalent_to(sharding, a.ndim) else _reshard(whole, sharding)


class RolloutWeights:
    """The rollout engine's float32 masters, kept bitwise equal to the trainer's through payloads.

    Example:
      >>> from logra_jax.rollout.sync import snapshot_payload
      >>> params = {"q_proj": {"kernel": jnp.ones((4, 8))}}
      >>> rollout = RolloutWeights(jax.eval_shape(lambda: params))
      >>> rollout.receive(snapshot_payload(params, 0)).status
      'loaded'
    """

    def __init__(self, abstract_params: Any, shardings: Mapping[str, jax.sharding.NamedSharding] | None = None):
        """abstract_params: the parameter tree with ShapeDtypeStruct (or array) leaves: structure, shapes, dtypes.
        shardings: {path: NamedSharding} of every leaf, all on one mesh (the trainer's, for a colocated engine on
        the trainer's mesh; a mesh of its own for `logra_jax.rollout.engine.DeviceEngine`): the weights are kept,
        and every update applied, in these shardings, and the arrays of a device payload that lie on other devices
        are moved onto the mesh device to device (`place`, `_onto_mesh`); None: one device."""
        self._abstract = abstract_params
        self._shapes = {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in flat_params(abstract_params).items()}
        self._apply = _apply
        self._place = lambda a, p: jnp.asarray(a)
        self._shardings = shardings
        if shardings is not None:
            missing = sorted(set(self._shapes) - set(shardings))
            if missing:
                raise ValueError(f"RolloutWeights: no sharding for parameters {missing[:4]}")
            tree = jax.tree_util.tree_map_with_path(lambda k, _: shardings[path_str(k)], abstract_params)
            self._apply = jax.jit(apply_updates, donate_argnums=0, out_shardings=tree)
            self._place = lambda a, p: place(a, shardings[p])
        self.params: Any = None
        self.version: int | None = None
        self.counts = {"applied": 0, "loaded": 0, "stale": 0, "resync": 0}
        self._clock: dict[str, float] = {}

    def _lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._clock[phase] = now - self._clock.pop("_last", now)
        self._clock["_last"] = now

    def receive(self, payload: SyncPayload | bytes | bytearray | memoryview) -> SyncReply:
        """Check and apply a payload (or its bytes); see the module docstring for the rules."""
        self._clock = {"_last": time.perf_counter()}
        try:
            if not isinstance(payload, SyncPayload):
                payload = SyncPayload.from_bytes(payload)
            payload.verify()
            self._check_structure(payload)
            payload = self._onto_mesh(payload)
            updates = None if payload.kind == "snapshot" else jax.tree_util.tree_map_with_path(
                lambda k, _: self._update_of(payload, path_str(k)), self._abstract)
        except ValueError as err:  # PayloadError, or factors that do not fit their targets
            return self._reply("resync", f"rejected payload: {err}")
        self._lap("check")
        if payload.kind == "snapshot":
            self.params = jax.block_until_ready(jax.tree_util.tree_map_with_path(
                lambda k, _: self._place(payload.weights[path_str(k)], path_str(k)), self._abstract))
            return self._commit(payload, "loaded")
        if self.version is None:
            return self._reply("resync", f"delta {payload.version} received before any snapshot")
        if payload.version <= self.version:
            return self._reply("stale", f"delta {payload.version} is not newer than {self.version}")
        if payload.parent != self.version:
            return self._reply("resync", f"version gap: holding {self.version}, delta {payload.version} applies to "
                                         f"{payload.parent}")
        self.params = jax.block_until_ready(self._apply(self.params, updates))
        return self._commit(payload, "applied")

    def _onto_mesh(self, payload: SyncPayload) -> SyncPayload:
        """A device payload with its factors, decays and dense updates on the weights' mesh: an array that lies on
        other devices (the trainer's, for an engine on devices of its own) is moved there device to device (`place`:
        factors and decays replicated, in the dtype they came in; a dense update in its weight's sharding); one on
        the mesh's devices already is kept as it is. A host payload is returned unchanged."""
        if not payload.on_device or self._shardings is None:
            return payload
        shardings = self._shardings
        mesh = next(iter(shardings.values())).mesh
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        devices = set(mesh.devices.flat)

        def move(a: Any, sharding: jax.sharding.NamedSharding) -> Any:
            if not isinstance(a, jax.Array) or a.sharding.device_set == devices:
                return a
            return place(a, sharding)

        factors = {p: dataclasses.replace(f, factor=move(f.factor, replicated), decay=move(f.decay, replicated))
                   for p, f in payload.factors.items()}
        dense = {p: move(a, shardings[p]) for p, a in payload.dense.items()}
        return dataclasses.replace(payload, factors=factors, dense=dense)

    @staticmethod
    def _update_of(payload: SyncPayload, path: str) -> Any:
        if path in payload.factors:
            return payload.factors[path].update(path)
        return jnp.asarray(payload.dense[path]) if path in payload.dense else None

    def _check_structure(self, payload: SyncPayload) -> None:
        if payload.kind == "snapshot":
            got = {p: (a.shape, a.dtype) for p, a in payload.weights.items()}
            if got != self._shapes:
                bad = sorted(set(got.items()) ^ set(self._shapes.items()))[:4]
                raise PayloadError(f"snapshot parameters differ from the rollout model's, e.g. {bad}")
        shapes = [("target", p, tuple(f.shape)) for p, f in payload.factors.items()]
        for kind, p, shape in shapes + [("dense update", p, a.shape) for p, a in payload.dense.items()]:
            if self._shapes.get(p, (None,))[0] != shape:
                raise PayloadError(f"{kind} {p!r} with shape {shape} is not a rollout parameter of that shape")
        if set(payload.fingerprint) != set(self._shapes):
            raise PayloadError("the fingerprint does not cover exactly the rollout model's parameters")

    def _commit(self, payload: SyncPayload, status: str) -> SyncReply:
        self._lap("apply")
        ours = tree_fingerprint(self.params)
        self._lap("fingerprint")
        drifted = [p for p, w in payload.fingerprint.items() if ours[p] != w]
        if drifted:
            self.version = None  # unsynchronised: only a snapshot is accepted from here
            return self._reply("resync", f"weight fingerprint mismatch after {payload.kind} {payload.version} in "
                                         f"{len(drifted)} leaves, e.g. {drifted[:3]}")
        self.version = payload.version
        return self._reply(status)

    def _reply(self, status: str, reason: str = "") -> SyncReply:
        self.counts[status] += 1
        self._clock.pop("_last", None)
        return SyncReply(status, self.version, reason, self._clock)


class RolloutWorker:
    """The engine: synchronised weights plus a sampler over them; what the worker process hosts.

    Example:
      >>> from logra_jax.models.config import preset
      >>> worker = RolloutWorker(preset("tiny"), SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0))
      >>> worker.weights.version is None      # nothing until the bootstrap snapshot
      True
    """

    def __init__(self, model_config: ModelConfig, sampling: SamplingConfig,
                 shardings: Mapping[str, jax.sharding.NamedSharding] | None = None):
        mesh = None if not shardings else next(iter(shardings.values())).mesh
        self.sampler = Sampler(abstract_model(model_config), sampling, mesh=mesh)
        self.weights = RolloutWeights(self.sampler.state, shardings)

    def sync(self, payload: SyncPayload | bytes) -> SyncReply:
        return self.weights.receive(payload)

    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout:
        """Sample with the current weights (config: other sampling settings, e.g. greedy). Raises RuntimeError
        before the first snapshot."""
        if self.weights.params is None:
            raise RuntimeError("RolloutWorker.generate: no weights yet (send a snapshot first)")
        return self.sampler(jnp.asarray(prompts), jnp.asarray(prompt_mask), key, state=self.weights.params,
                            config=config)

    def fetch(self) -> tuple[int | None, dict[str, np.ndarray]]:
        params = self.weights.params
        return self.weights.version, {} if params is None else jax.device_get(flat_params(params))

    def counts(self) -> dict[str, int]:
        """Receiver outcomes so far: applied, loaded, stale, resync."""
        return dict(self.weights.counts)

    def close(self) -> None:
        self.weights.params = None

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class InProcessTransport(RolloutWorker):
    """The payload receiver in the trainer's process, with its own float32 copy of the weights (the payload route
    without a process boundary; the job's colocated engine is `logra_jax.rollout.engine.ColocatedEngine`).

    Payloads may be handed over as device arrays (`PolicySync(..., on_device=True)`); with `shardings` the copy
    lives on that mesh, each process of a multi-process run holding and updating its own shards, and `generate`
    takes and returns global arrays. The mesh may be the trainer's or one of other devices (the masters of
    `logra_jax.rollout.engine.DeviceEngine`): a device payload's arrays then move onto it device to device."""


def _key_arrays(key: jax.Array) -> tuple[str | None, np.ndarray]:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)), np.asarray(jax.random.key_data(key))
    return None, np.asarray(key)


def _worker_env(platform: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS=platform)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


class WorkerProcessTransport(EngineProcess):
    """A rollout worker process on this host, driven over a loopback TCP socket.

    Args:
      model_config, sampling: the rollout model's config (weights come by snapshot) and sampling settings.
      platform: JAX platform of the worker; None = this process's default backend.
      env: extra environment variables for the worker (e.g. CUDA_VISIBLE_DEVICES to give it its own GPU).
      start_timeout_s: how long the worker may take to connect and build its model.
      request_timeout_s: how long one request may take.
      secret: the run's secret (`logra_jax.rollout.wire.new_secret`), handed to the worker through its stdin;
        None draws one for this worker.

    Raises:
      WorkerError: the worker exits or does not come up within `start_timeout_s` (with its log).

    Example:
      >>> from logra_jax.models.config import preset
      >>> sampling = SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0)
      >>> with WorkerProcessTransport(preset("tiny"), sampling) as engine:  # doctest: +SKIP
      ...     sync = PolicySync(engine.sync, params)          # bootstrap snapshot, then sync.push(...) per update
      ...     rollout = engine.generate(prompts, prompt_mask, jax.random.key(0))
    """

    label = "rollout worker"

    def __init__(self, model_config: ModelConfig, sampling: SamplingConfig, *, platform: str | None = None,
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 120.0,
                 request_timeout_s: float = 600.0, secret: bytes | None = None):
        flags = {name: getattr(jax.config, name) for name in _JAX_FLAGS}
        hello = pack({"model": dataclasses.asdict(model_config), "sampling": dataclasses.asdict(sampling),
                      "jax_config": flags}, {})
        super().__init__([sys.executable, "-m", "logra_jax.rollout.worker"],
                         {**_worker_env(platform or jax.default_backend()), **(env or {})},
                         new_secret() if secret is None else secret, hello, start_timeout_s=start_timeout_s,
                         request_timeout_s=request_timeout_s)

    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout:
        impl, key_data = _key_arrays(key)
        sampling = None if config is None else dataclasses.asdict(config)
        body = pack({"key_impl": impl, "sampling": sampling}, {"prompts": np.asarray(prompts, np.int32),
                                         "prompt_mask": np.asarray(prompt_mask, bool), "key": key_data})
        _, arrays = self._request("generate", body)
        return Rollout.from_arrays(arrays)

    def counts(self) -> dict[str, int]:
        """Receiver outcomes so far: applied, loaded, stale, resync."""
        return self._request("counts")[0]["counts"]




def _hello(body: memoryview) -> RolloutWorker:
    """The worker the trainer's hello asks for, under the trainer's JAX numerics flags."""
    meta, _ = unpack(body)
    for name, value in meta["jax_config"].items():
        jax.config.update(name, value)
    return RolloutWorker(ModelConfig(**meta["model"]), SamplingConfig(**meta["sampling"]))


def _generate(worker: RolloutWorker, body: memoryview) -> Reply:
    meta, arrays = unpack(body)
    key = jax.random.wrap_key_data(arrays["key"], impl=meta["key_impl"]) if meta["key_impl"] else arrays["key"]
    config = None if meta.get("sampling") is None else SamplingConfig(**meta["sampling"])
    out = worker.generate(arrays["prompts"], arrays["prompt_mask"], key, config)
    return {}, {name: np.asarray(v) for name, v in out._asdict().items() if v is not None}  # experts: MoE only


def _fetch(worker: RolloutWorker, body: memoryview) -> Reply:
    version, params = worker.fetch()
    return {"version": version}, params


_ANSWERS: Mapping[str, Callable[[RolloutWorker, memoryview], Reply]] = {
    "sync": lambda worker, body: (worker.sync(body)._asdict(), {}),
    "generate": _generate,
    "fetch": _fetch,
    "counts": lambda worker, body: ({"counts": worker.counts()}, {}),
}


def serve(chan: Channel, worker: RolloutWorker | None = None) -> RolloutWorker | None:
    """The worker process's loop (`logra_jax.rollout.process.serve` over the worker's requests): `worker` is the
    engine to serve (None: built by the trainer's hello request); returns it."""
    return process.serve(chan, _hello, _ANSWERS, worker, label="rollout worker")


def main(argv: list[str] | None = None) -> None:
    run_engine(argv, "LoGRA rollout worker (started by WorkerProcessTransport)", serve)


if __name__ == "__main__":
    main()
