"""The rollout engine behind one interface (`RolloutEngine`): colocated, on devices of its own, or in a process of
its own.

Every engine answers the same calls, so the RL loop has one code path:
  publish(updates, params) -> SyncReport     bring the engine to the trainer's weights after an update
  release()                                  before the train step: drop what the engine holds on the trainer's
                                             devices (the colocated engine's copy; publish rebuilds it)
  generate(prompts, prompt_mask, key, config=None) -> Rollout     (logra_jax.rollout.slots; config: e.g. greedy)
  resyncs; close()
`rollout_engine` builds the one `config.rollout` asks for.

`ColocatedEngine` decodes on the trainer's devices from weights resident in a layout made for decoding: a
(data = n / t, fsdp = 1, tensor = t) mesh over the same devices, so every weight is split over a tensor-parallel
group of t devices and replicated across the n / t groups, and each group decodes its own slots. No decode step
gathers a weight (the trainer's FSDP layout would gather the whole model every token). The engine's matrices are
stored in the model's compute dtype (what the decoder casts them to at every use), so its logits are the trainer's
policy's; there is no float32 copy. `publish` rebuilds them from the trainer's weights once per update — a cast
and one reshard, bit for bit what the trainer's weights round to — and shares a trainer leaf as it is where its
dtype and layout already match (a float32 job on one device holds no second copy at all). On GPUs the engine
holds each layer's weights as arrays of their own (`ModelConfig.decode_unroll`: XLA:GPU would copy a layer's slice
out of a stacked weight in every decode step), cut out of the trainer's stacks by the same publish, so it never
shares a block's weight with the trainer there.

`DeviceEngine` is our engine in this process on devices of its own (a job gives the trainer its first n − k devices
and the engine the last k, `rollout.engine_devices`), so it can decode while the trainer trains. It holds float32
masters in a decode layout over its k devices (`DecodeLayout` on those devices alone) and is fed by low-rank policy
sync with device payloads: per update the trainer's factors (bf16(U) and the seed's step) move device to device
onto the engine's mesh (jax.device_put; nothing goes through the host but one fingerprint number per leaf), where
the trainer's merge is repeated on the masters, bitwise. From the masters it casts its decode weights, the
compute-dtype matrices of the colocated engine's layout, so they are bit for bit what the trainer's weights round
to; `release` has nothing to drop, and its rollouts come back on its own devices.

`WorkerEngine` drives an engine process (our worker, logra_jax.rollout.worker; vLLM's, logra_jax.rollout.vllm.engine
builds on it) through low-rank policy sync (logra_jax.rollout.sync.PolicySync): the process receives U and seeds,
never dense weights, and keeps its own float32 masters equal to the trainer's. `DeviceEngine` is one whose receiver
is in this process.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Collection, Sequence
from typing import Any, Protocol, Self

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from logra_jax.core.tree_paths import flat_params, path_str
from logra_jax.models.config import ModelConfig
from logra_jax.models.decoder import abstract_model, layer_source
from logra_jax.parallel.derived_specs import full_spec
from logra_jax.parallel.sharding import MeshConfig, device_bytes, make_mesh, param_shardings
from logra_jax.rollout.process import SyncReply
from logra_jax.rollout.sampling import Rollout, SamplingConfig
from logra_jax.rollout.slots import generate
from logra_jax.rollout.sync import PolicySync, SyncPayload, SyncReport
from logra_jax.rollout.vllm.settings import VLLMSettings
from logra_jax.rollout.worker import InProcessTransport, WorkerProcessTransport, place


class RolloutEngine(abc.ABC):
    """The rollout engine's interface (as Tunix's `BaseRollout`): what the RL loop calls, whichever engine serves
    it. `rollout_engine` builds the one a config asks for: `ColocatedEngine`, `DeviceEngine`, `WorkerEngine` or
    `logra_jax.rollout.vllm.engine.VLLMEngine`."""

    resyncs: int = 0  # snapshots sent to repair the engine's weights (a lost, corrupted or drifted update)

    @abc.abstractmethod
    def publish(self, updates: Any, params: Any) -> SyncReport:
        """Bring the engine to the trainer's weights `params`, reached by the update `updates`."""

    @abc.abstractmethod
    def release(self) -> None:
        """Drop what the engine holds on the trainer's devices until the next `publish` (before the train step)."""

    @abc.abstractmethod
    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout:
        """Sample with the engine's weights (config: other settings than the engine's, e.g. greedy)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the engine (stop its process, drop its weights)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Transport(Protocol):
    """The receiving end a `WorkerEngine` feeds: a payload receiver with a sampler on its weights
    (logra_jax.rollout.worker's transports, `logra_jax.rollout.vllm.engine.VLLMProcess`)."""

    def sync(self, payload: SyncPayload | bytes) -> SyncReply: ...

    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout: ...

    def fetch(self) -> tuple[int | None, dict[str, np.ndarray]]: ...

    def close(self) -> None: ...


def decode_config(config: ModelConfig, platform: str = "cpu", per_layer: bool | None = None) -> ModelConfig:
    """The engine's model config: matrices stored in the compute dtype (norm scales and biases stay float32); with
    `per_layer` (None: on GPUs) one module per layer and the layers of a decode step unrolled
    (`ModelConfig.decode_unroll`)."""
    unroll = platform == "gpu" if per_layer is None else per_layer
    return dataclasses.replace(config, param_dtype=config.dtype, decode_unroll=unroll)


def decode_mesh(mesh: Mesh, tensor: int) -> Mesh:
    """The (data = n / tensor, fsdp = 1, tensor) mesh over `mesh`'s devices, in their order.

    Raises:
      ValueError: `tensor` does not divide the number of devices (names config.rollout.decode_tensor).
    """
    devices = list(mesh.devices.flat)
    if not isinstance(tensor, int) or tensor < 1 or len(devices) % tensor:
        raise ValueError(f"config.rollout.decode_tensor = {tensor!r} must divide the {len(devices)} devices of the "
                         "mesh")
    return make_mesh(MeshConfig(data=len(devices) // tensor, fsdp=1, tensor=tensor), devices)


def decode_tensor_sizes(config: ModelConfig, num_devices: int) -> list[int]:
    """The t a decode layout can take: dividing the device count, the attention heads and the KV heads (so every
    device holds whole KV heads of its slots and the KV cache is split over all devices: heads over t, slots over
    n / t), smallest first."""
    return [t for t in range(1, num_devices + 1)
            if num_devices % t == 0 and config.num_heads % t == 0 and config.num_kv_heads % t == 0]


def default_decode_tensor(config: ModelConfig, mesh: Mesh) -> int:
    """t for the decode layout when the config leaves it to us (rollout.decode_tensor = 0).

    On accelerators, the largest of `decode_tensor_sizes`: a decode step reads every weight a device holds, so it
    costs weights / t per device (and the engine holds as much), the floor being weights / n. On CPU devices (tests,
    the demo), where a step is compute-bound and tensor parallelism only adds collectives: the trainer mesh's
    tensor size.
    """
    if mesh.devices.flat[0].platform == "cpu":
        return int(mesh.shape["tensor"])
    return decode_tensor_sizes(config, mesh.devices.size)[-1]


# Per device, the engine weights one publish program builds (a leaf larger than this is a group alone).
PUBLISH_GROUP_BYTES = 512 * 2**20


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of the model's parameters as stored under `config`."""
    return device_bytes(nnx.state(abstract_model(config), nnx.Param), whole=True)


def _drop_leading(sharding: Any, ndim: int) -> Any:
    """A NamedSharding of an [L, ...] array as the sharding of one of its [...] slices (the leading axis dropped);
    None for another kind of sharding, or none."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*full_spec(sharding.spec, ndim)[1:]))


class DecodeLayout:
    """Where and how the colocated engine holds the policy: the decode mesh, the engine's model (compute-dtype
    matrices), its abstract sharded state, and the cast + reshard that builds it from the trainer's leaves (the one
    program `publish` runs; `logra_jax.plan` compiles the same).

    Args:
      model_config: the trainer's model config.
      mesh: the trainer's mesh.
      tensor: t (0: `default_decode_tensor`).
      per_layer: hold the blocks' weights one leaf per layer and unroll the decode step's layers
        (`ModelConfig.decode_unroll`); None: on GPUs only.
    """

    def __init__(self, model_config: ModelConfig, mesh: Mesh, tensor: int = 0, per_layer: bool | None = None):
        self.tensor = tensor or default_decode_tensor(model_config, mesh)
        self.mesh = decode_mesh(mesh, self.tensor)
        self.config = decode_config(model_config, mesh.devices.flat[0].platform, per_layer)
        self.graphdef, abstract = nnx.split(abstract_model(self.config))
        shardings = param_shardings(abstract, self.mesh)
        self.abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                     shardings)
        self.leaves = flat_params(self.abstract)
        # {trainer path: [(engine path, layer or None)]}: a per-layer engine (GPUs) holds layer i of a stacked
        # trainer leaf as a leaf of its own (`models.decoder.layer_source`), cut out once per publish.
        self.sources: dict[str, list[tuple[str, int | None]]] = {}
        for path in self.leaves:
            source, layer = layer_source(path)
            self.sources.setdefault(source, []).append((path, layer))
        self._casts: dict[tuple[str, ...], Any] = {}

    def split(self, trainer_leaves: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, to_copy): the trainer's leaves (arrays or abstract, by path) the engine reads, split by whether
        it can hold them as they are (one engine leaf of the same dtype and an equivalent sharding: shared, by
        path) or builds its own from them (to_copy, by trainer path: `groups`, `cast`).

        Raises:
          ValueError: a parameter of the engine's model that the trainer's leaves lack (named).
        """
        missing = sorted(set(self.sources) - set(trainer_leaves))
        if missing:
            raise ValueError(f"DecodeLayout: the trainer's state lacks the engine's parameters {missing[:4]}")
        shared, to_copy = {}, {}
        for source, targets in self.sources.items():
            leaf = trainer_leaves[source]
            want = self.leaves[targets[0][0]]
            sharding = getattr(leaf, "sharding", None)
            same = (targets == [(source, None)] and leaf.dtype == want.dtype and sharding is not None
                    and sharding.is_equivalent_to(want.sharding, len(want.shape)))
            (shared if same else to_copy)[source] = leaf
        return shared, to_copy

    def groups(self, leaves: dict[str, Any], limit: int | None = None) -> list[dict[str, Any]]:
        """These trainer leaves (by path) in the groups `publish` casts and reshards one program at a time: in the
        engine's order, each making at most `limit` (default `PUBLISH_GROUP_BYTES`) bytes of engine weights per
        device (a larger leaf alone)."""
        limit = PUBLISH_GROUP_BYTES if limit is None else limit
        out: list[dict[str, Any]] = []
        size = limit
        for path, x in leaves.items():
            nbytes = self.device_bytes([path])
            if size + nbytes > limit:
                out.append({})
                size = 0
            out[-1][path] = x
            size += nbytes
        return out

    def device_bytes(self, trainer_paths: Collection[str]) -> int:
        """Bytes per device of the engine's leaves made from these trainer leaves (by path)."""
        return device_bytes([self.leaves[target] for p in trainer_paths for target, _ in self.sources[p]])

    def cast(self, leaves: dict[str, Any]) -> Any:
        """The jitted cast + reshard of these trainer leaves (arrays or abstract, by path) into the engine's leaves
        they make (by engine path), built once per set of paths and input shardings: each leaf is cast where it
        lies, then moved in the engine's dtype (a bf16 engine moves half a float32 trainer's bytes, and no float32
        copy is gathered); a per-layer engine cuts each layer out of the trainer's stack where it lies, then casts and
        moves that layer alone (no whole stack is moved at once)."""
        ins = {p: getattr(x, "sharding", None) for p, x in leaves.items()}
        key = tuple((p, ins[p]) for p in leaves)
        if key not in self._casts:
            def cast(tree: dict[str, Any]) -> dict[str, Any]:
                out = {}
                for p, x in tree.items():
                    for target, layer in self.sources[p]:  # a layer cut out of the stack where it lies, then cast
                        y = (x if layer is None else x[layer]).astype(self.leaves[target].dtype)
                        where = ins[p] if layer is None else _drop_leading(ins[p], x.ndim)
                        out[target] = y if where is None else jax.lax.with_sharding_constraint(y, where)
                return out
            outs = {target: self.leaves[target].sharding for p in leaves for target, _ in self.sources[p]}
            self._casts[key] = jax.jit(cast, out_shardings=outs)
        return self._casts[key]

    def state(self, flat: dict[str, Any]) -> Any:
        """The engine's state tree (nnx.State) from leaves by path."""
        return jax.tree_util.tree_map_with_path(lambda k, _: flat[path_str(k)], self.abstract)

    def build(self, leaves: dict[str, Any], share: bool = True) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """The engine's state from these source leaves (arrays by path: the trainer's, or a `DeviceEngine`'s
        masters), ready on the devices: the leaves it can hold as they are shared (with `share`; else copied too),
        the others cast and resharded one group at a time (bounded reshard temporaries). Returns (state, shared,
        copied), the last two by path.

        Raises:
          ValueError: a parameter of the engine's model that `leaves` lack (`split`).
        """
        shared, to_copy = self.split(leaves)
        if not share:
            shared, to_copy = {}, {p: leaves[p] for p in self.sources}
        copied: dict[str, Any] = {}
        for group in self.groups(to_copy):
            copied.update(self.cast(group)(group))
        return jax.block_until_ready(self.state({**shared, **copied})), shared, copied


class ColocatedEngine(RolloutEngine):
    """The engine on the trainer's devices, its weights resident in the decode layout (see the module docstring).

    Args:
      model_config: the trainer's model config (its compute dtype is the engine's weight dtype).
      sampling: the rollout's sampling and scheduling settings.
      mesh: the trainer's mesh (the engine uses its devices).
      params, rest: the trainer's weights and the model's other state (nnx.State trees) at `version`.
      tensor: t of the decode layout (0: `default_decode_tensor`).
      per_layer: the weights one leaf per layer (`DecodeLayout`; None: on GPUs only).

    Example:
      >>> from logra_jax.models.config import preset
      >>> from logra_jax.models.decoder import init_model
      >>> model = init_model(preset("tiny"))
      >>> _, params, rest = nnx.split(model, nnx.Param, ...)
      >>> engine = ColocatedEngine(preset("tiny"), SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0),
      ...                          make_mesh(MeshConfig(), jax.devices()[:1]), params, rest)
      >>> engine.generate(jnp.array([[5, 6, 7]]), jnp.array([[1, 1, 1]]), jax.random.key(0)).tokens.shape
      (1, 7)
    """

    def __init__(self, model_config: ModelConfig, sampling: SamplingConfig, mesh: Mesh, params: Any, rest: Any, *,
                 version: int = 0, tensor: int = 0, per_layer: bool | None = None):
        self.sampling = sampling
        self.layout = DecodeLayout(model_config, mesh, tensor, per_layer)
        self.graphdef, self.mesh, self.tensor = self.layout.graphdef, self.layout.mesh, self.layout.tensor
        self._rest = flat_params(rest)
        self.version = version
        self.shared_bytes = self.copied_bytes = 0
        self.state: Any = None
        self.publish(None, params, version=version)

    def publish(self, updates: Any, params: Any, *, version: int | None = None) -> SyncReport:
        """Bring the engine to the trainer's `params` (after the update `updates`, unused: the engine reads the
        weights themselves): cast to the engine's dtypes and reshard into the decode layout."""
        del updates
        start = time.perf_counter()
        leaves = {**self._rest, **flat_params(params)}
        self.layout.split(leaves)  # a missing parameter is reported before the previous copy goes
        self.state = None  # the previous copy goes before the new one is built (the peak holds one copy)
        self.state, shared, copied = self.layout.build(leaves)
        self.version = self.version + 1 if version is None else version
        self.shared_bytes, self.copied_bytes = device_bytes(shared, whole=True), device_bytes(copied, whole=True)
        seconds = time.perf_counter() - start
        return SyncReport(self.version, self.copied_bytes, seconds, 0.0,
                          SyncReply("loaded", self.version, "", {"apply": seconds}), "")

    def release(self) -> None:
        """Drop the engine's weights until the next `publish` (the job calls it before the train step, which then
        holds no engine copy beside the trainer's state; `publish` rebuilds the copy from the new weights)."""
        self.state = None

    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout:
        """Sample with the engine's weights (config: another SamplingConfig, e.g. greedy for evaluation).

        Raises:
          RuntimeError: the weights were released and not published since.
        """
        if self.state is None:
            raise RuntimeError("ColocatedEngine.generate: the engine's weights were released (release()) and not "
                               "published since; call publish(updates, params) first")
        return generate(self.graphdef, self.state, jnp.asarray(prompts), jnp.asarray(prompt_mask), key,
                        config or self.sampling, mesh=self.mesh)

    def close(self) -> None:
        self.state = None


class WorkerEngine(RolloutEngine):
    """An engine in a process of its own (our rollout worker; vLLM's, `VLLMEngine`, builds on this) fed by low-rank
    payloads: `publish` pushes the update through `PolicySync` (`sync`) to the transport's receiver."""

    def __init__(self, transport: Transport, params: Any, *, version: int = 0, trained: Collection[str] = (),
                 on_device: bool = False):
        """transport: the receiver; params: the trainer's weights at `version` (the bootstrap snapshot); trained:
        non-target paths trained densely; on_device: hand the payloads over as device arrays (a receiver in this
        process, `DeviceEngine`) instead of host copies."""
        self.transport = transport
        self.sync = PolicySync(self._receive, params, version=version, trained=trained, on_device=on_device)

    def _receive(self, payload: SyncPayload | bytes) -> SyncReply:
        """Hand a payload to the transport (PolicySync's receiver)."""
        return self.transport.sync(payload)

    @property
    def resyncs(self) -> int:
        return self.sync.resyncs

    def publish(self, updates: Any, params: Any) -> SyncReport:
        return self.sync.push(updates, params)

    def release(self) -> None:
        """Nothing to drop: the engine's weights live in its own process."""

    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout:
        return self.transport.generate(prompts, prompt_mask, key, config=config)

    def fetch(self) -> tuple[int | None, dict[str, np.ndarray]]:
        """(version, {path: float32 master}) of the engine's weights (for drift measurements)."""
        return self.transport.fetch()

    def close(self) -> None:
        self.transport.close()


class DeviceEngine(WorkerEngine):
    """Our engine in this process on devices of its own (none of the trainer's), fed by low-rank payloads that move
    device to device (see the module docstring).

    Its float32 masters are an `InProcessTransport`'s, held in the shardings of a decode layout over `devices`
    (`DecodeLayout`: a (data = k / t, fsdp = 1, tensor = t) mesh); each update arrives as a device payload
    (`PolicySync(..., on_device=True)`) whose factors the receiver moves from the trainer's devices onto that mesh
    with jax.device_put, never through the host, and merges as the trainer did, so the masters stay bitwise the
    trainer's weights. After every accepted payload the engine casts the masters into its decode weights (the
    layout's compute-dtype matrices), bit for bit what the trainer's weights round to, and decodes from those. The
    decode weights share no buffer with the masters (each update donates those), so a rollout still running keeps
    its weights while the next payload applies. The devices hold both: 1.5× the float32 weights of a bf16 model
    (2× of a float32 one), over k devices.

    Args:
      model_config: the trainer's model config (its compute dtype is the decode weights' dtype).
      sampling: the rollout's sampling and scheduling settings.
      devices: the engine's devices (none of the trainer mesh's; `rollout_engine` checks).
      params: the trainer's weights (nnx.State) at `version`: the bootstrap snapshot, moved device to device.
      version: trainer updates completed at `params`.
      trained: non-target paths trained densely (their dense updates are sent).
      tensor: t of the decode layout (0: `default_decode_tensor` on these devices).
      per_layer: the decode weights one leaf per layer (`DecodeLayout`; None: on GPUs only).

    Raises:
      ValueError: no devices, a device listed twice, or a `tensor` that does not divide their number.
    """

    def __init__(self, model_config: ModelConfig, sampling: SamplingConfig, devices: Sequence[jax.Device],
                 params: Any, *, version: int = 0, trained: Collection[str] = (), tensor: int = 0,
                 per_layer: bool | None = None):
        devices = list(devices)
        if not devices or len(set(devices)) != len(devices):
            raise ValueError(f"config.rollout.engine_devices: the engine needs distinct devices, got "
                             f"{[d.id for d in devices]}")
        self.sampling = sampling
        self.layout = DecodeLayout(model_config, make_mesh(MeshConfig(), devices), tensor, per_layer)
        self.graphdef, self.mesh, self.tensor = self.layout.graphdef, self.layout.mesh, self.layout.tensor
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self.state: Any = None
        self.version: int | None = None  # trainer updates in the decode weights (None: no weights)
        masters = flat_params(param_shardings(nnx.state(abstract_model(model_config)), self.mesh))
        super().__init__(InProcessTransport(model_config, sampling, masters), params, version=version,
                         trained=trained, on_device=True)

    def _receive(self, payload: SyncPayload | bytes) -> SyncReply:
        """Apply a payload to the masters, then rebuild the decode weights from them (once they hold a version the
        trainer vouched for; unsynchronised masters leave none until the snapshot that repairs them)."""
        reply = self.transport.sync(payload)
        if reply.status in ("applied", "loaded"):
            self.state = None  # the previous copy goes before the new one is built (unless a rollout holds it)
            self.state = self.layout.build(flat_params(self.transport.weights.params), share=False)[0]
            self.version = reply.version
        elif self.transport.weights.version is None:
            self.state = self.version = None  # the masters drifted: nothing to decode from until a snapshot
        return reply

    def release(self) -> None:
        """Nothing to drop: the engine's weights are on devices of its own."""

    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout:
        """Sample with the engine's decode weights (config: another SamplingConfig, e.g. greedy). Prompts, mask and
        key may lie anywhere (host, the trainer's devices, sharded or not): they are put on the engine's mesh,
        replicated, device to device (`logra_jax.rollout.worker.place`); the Rollout comes back on the engine's
        devices (the caller moves it where it needs it).

        Raises:
          RuntimeError: the engine holds no synchronised weights (closed, or a failed sync).
        """
        if self.state is None:
            raise RuntimeError("DeviceEngine.generate: the engine holds no synchronised weights (closed, or a sync "
                               "that no snapshot repaired)")
        put = lambda x: place(x if isinstance(x, jax.Array) else np.asarray(x), self._replicated)
        return generate(self.graphdef, self.state, put(prompts), put(prompt_mask), put(key), config or self.sampling,
                        mesh=self.mesh)

    def close(self) -> None:
        self.state = self.version = None
        super().close()


def rollout_engine(workers: int, model_config: ModelConfig, sampling: SamplingConfig, mesh: Mesh, params: Any,
                   rest: Any, *, version: int = 0, trained: Collection[str] = (), decode_tensor: int = 0,
                   per_layer: bool | None = None, vllm: VLLMSettings | None = None, model_dir: str | None = None,
                   engine_devices: Sequence[jax.Device] = (), **worker_options: Any) -> RolloutEngine:
    """The engine for `config.rollout`.

    - `vllm` (its VLLMSettings): vLLM in its own process on the Hugging Face folder `model_dir`, fed by low-rank
      payloads (`logra_jax.rollout.vllm.engine.VLLMEngine`);
    - `engine_devices` (with workers = 0): our engine in this process on those devices, none of `mesh`'s (a job
      gives the trainer its first n − k devices and the engine the last k), fed by low-rank payloads that move
      device to device (`DeviceEngine`: decode layout over the k devices with t = decode_tensor, weights per layer
      or stacked by per_layer);
    - else by `workers`: 0 = colocated on the trainer's devices (`ColocatedEngine`, decode layout with t =
      decode_tensor, weights per layer or stacked by per_layer), 1 = a worker process fed by low-rank payloads
      (`WorkerEngine`; worker_options go to `WorkerProcessTransport`).

    Raises:
      ValueError: another `workers` value; worker options for an engine in this process; `engine_devices` with
        workers = 1 or vLLM, listing a device twice or one of the trainer mesh's (each named).
    """
    if engine_devices:
        if vllm is not None or workers != 0:
            raise ValueError(f"rollout.engine_devices places our JAX engine in this process: it needs workers=0 and "
                             f"no vLLM, got workers={workers!r}{' and vLLM' if vllm is not None else ''}")
        ids = [d.id for d in engine_devices]
        shared = sorted(set(ids) & {d.id for d in mesh.devices.flat})
        if shared:
            raise ValueError(f"rollout.engine_devices {ids} overlap the trainer's mesh on devices {shared}: the engine "
                             "needs devices of its own")
    if vllm is not None:
        from logra_jax.rollout.vllm.engine import VLLMEngine
        return VLLMEngine(model_config, sampling, params, model_dir=model_dir, settings=vllm, version=version,
                          trained=trained)
    if workers == 0:
        if worker_options:
            raise ValueError(f"rollout_engine: options {sorted(worker_options)} only apply to workers=1")
        if engine_devices:
            return DeviceEngine(model_config, sampling, engine_devices, params, version=version, trained=trained,
                                tensor=decode_tensor, per_layer=per_layer)
        return ColocatedEngine(model_config, sampling, mesh, params, rest, version=version, tensor=decode_tensor,
                               per_layer=per_layer)
    if workers == 1:
        return WorkerEngine(WorkerProcessTransport(model_config, sampling, **worker_options), params,
                            version=version, trained=trained)
    raise ValueError(f"rollout_engine: workers must be 0 (colocated) or 1 (worker process), got {workers!r}")
