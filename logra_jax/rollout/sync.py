"""Low-rank policy synchronization, trainer → rollout engine (docs/method.md §6): payloads, wire format, trainer side.

Per update the trainer ships, for every target, the factor exactly as its merge consumed it (bf16(U) when the
update rounds to bf16, U = −α·D already carrying the sign, else U in float32), the seed triple's step and the
static projection settings; trained non-targets ship their dense update; frozen ones ship nothing. The rollout
side regenerates A_l from (base seed, step, "path.l") and runs the trainer's own merge,
  W_l ← cast_W( (1 + c)·f32(W_l) + f32(bf16(U_l)) · A_l )        (logra_jax.optim.apply_updates, jitted),
on its own float32 masters. Both ends hold float32 masters and feed identical float32 operands to the same
jitted XLA computation, so on the same backend and JAX version the weights stay bitwise equal after any number
of updates (the tests check this across processes). Anything else is detected, not assumed:
- version chain: a delta carries `version` (trainer updates after it) and `parent` = version − 1; the receiver
  applies it only on top of `parent`; a gap (missing or out-of-order payload) asks for a full resync, an
  older one is dropped as stale;
- payload checksum: BLAKE2b-256 over the canonical JSON header and every array's bytes (corruption);
- weight fingerprint: per parameter leaf, one uint32 computed on device where the leaf lies,
  `logra_jax.core.fingerprint.tree_fingerprint` (Σ_i c_i·w_i mod 2³² over the leaf's bit patterns w_i in row-major
  order,
  odd position weights c_i: the checkpoints' fingerprint). Any single changed element changes it, and swapped
  elements do but for a vanishing fraction of values; it costs one read of the weights per update on device and a
  JSON number per leaf on the wire, where hashing the weights on the host would move all of them off the device
  every step. It guards against drift, not against an adversary.
A mismatch of either leaves the receiver unsynchronised until the trainer sends a snapshot (every parameter,
float32, with the same version, checksum and fingerprint), which is also the bootstrap. The receiving end is
`logra_jax.rollout.worker.RolloutWeights`; `PolicySync` is the sending end.

Wire format: `logra_jax.rollout.wire.pack` (no pickle; jax-free, so a PyTorch engine reads it too).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.core.fingerprint import tree_fingerprint
from logra_jax.core.tree_paths import flat_params, path_str
from logra_jax.optim.lowrank import LowRankUpdate, is_lowrank
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import MatrixDims, Target
from logra_jax.rollout.process import SyncReply
from logra_jax.rollout.wire import PayloadError, header, pack, payload_checksum, unpack

FORMAT = "logra-sync/2"  # /2: one fingerprint number per leaf (/1: two)


@dataclasses.dataclass(frozen=True)
class TargetFactor:
    """One target's share of a delta: everything `LowRankUpdate` needs to be rebuilt on the rollout side.

    Attributes:
      factor: (*batch, *rows, r), bf16 when `spec.round_bf16` (the merge's own rounding), else float32.
      decay: None or the float32 scalar c of a decayed merge (NeMo variant).
      step: the LowRankUpdate's step.
      spec: its SketchSpec as this target sees it (`SketchSpec.for_target`: the target's own rank, no rank rules;
        on the wire: `SketchSpec.wire_fields`, the projection settings with that rank, the rounding and the merge
        kernel the trainer used, so the rollout side repeats it exactly).
      shape, rows, width: the kernel's shape and its MatrixDims (normalised axes).
    """

    factor: np.ndarray
    decay: np.ndarray | None
    step: int
    spec: SketchSpec
    shape: tuple[int, ...]
    rows: tuple[int, ...]
    width: tuple[int, ...]

    def meta(self) -> dict[str, Any]:
        out = {"step": self.step, **self.spec.wire_fields(), "shape": self.shape, "rows": self.rows,
               "width": self.width}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def update(self, path: str) -> LowRankUpdate:
        """The LowRankUpdate this factor came from (factor widened to float32: exact for bf16)."""
        rows, width = tuple(self.rows), tuple(self.width)
        target = Target(path=path, keys=tuple(path.split(".")), shape=tuple(self.shape),
                        dims=MatrixDims(rows=rows, width=width),
                        batch_axes=tuple(a for a in range(len(self.shape)) if a not in rows + width))
        decay = None if self.decay is None else jnp.asarray(self.decay, jnp.float32)
        return LowRankUpdate(jnp.asarray(self.factor, jnp.float32), self.step, target=target, spec=self.spec,
                             decay=decay)


@dataclasses.dataclass(frozen=True)
class SyncPayload:
    """What the trainer sends after an update (kind "delta") or to (re)start a rollout engine ("snapshot").

    Attributes:
      kind: "delta" or "snapshot".
      version: trainer updates completed when the weights are those the payload leads to.
      parent: version − 1 for a delta (the weights it applies to), None for a snapshot.
      factors: delta: {target path: TargetFactor}.
      dense: delta: {path: additive update} of trained non-targets (empty when they are frozen).
      weights: snapshot: {path: value} of every parameter.
      fingerprint: {path: fingerprint} of the trainer's weights at `version`
        (`logra_jax.core.fingerprint.tree_fingerprint`).
      checksum: BLAKE2b-256 hex digest of everything above, as `payload_checksum` computes it ("" on device).
      on_device: the arrays are the trainer's device arrays (global arrays in a multi-process run), handed to a
        colocated engine in the same process: never framed, so no checksum; each process's engine applies
        the factors to its own shards.
    """

    kind: Literal["delta", "snapshot"]
    version: int
    parent: int | None
    factors: Mapping[str, TargetFactor]
    dense: Mapping[str, np.ndarray]
    weights: Mapping[str, np.ndarray]
    fingerprint: Mapping[str, int]
    checksum: str
    on_device: bool = False

    def parts(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(meta without the checksum, named arrays): the canonical content that is hashed and framed."""
        meta = {"format": FORMAT, "kind": self.kind, "version": self.version, "parent": self.parent,
                "targets": {p: f.meta() for p, f in self.factors.items()},
                "fingerprint": {p: int(w) for p, w in self.fingerprint.items()}}
        arrays = {f"factor/{p}": f.factor for p, f in self.factors.items()}
        arrays |= {f"decay/{p}": f.decay for p, f in self.factors.items() if f.decay is not None}
        arrays |= {f"dense/{p}": a for p, a in self.dense.items()}
        arrays |= {f"weight/{p}": a for p, a in self.weights.items()}
        return meta, arrays

    @property
    def nbytes(self) -> int:
        """Bytes of the framed payload (`to_bytes` length), computed without framing it."""
        meta, arrays = self.parts()
        return len(header({**meta, "checksum": self.checksum}, arrays)) + sum(a.nbytes for a in arrays.values())

    def to_bytes(self) -> bytes:
        if self.on_device:
            raise PayloadError("a device payload is handed over in process, not framed (build it with host=True)")
        meta, arrays = self.parts()
        return pack({**meta, "checksum": self.checksum}, arrays)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> SyncPayload:
        """Parse a framed payload (checksum not yet verified: call `verify`). Raises PayloadError."""
        meta, arrays = unpack(data)
        try:
            if meta["format"] != FORMAT or meta["kind"] not in ("delta", "snapshot"):
                raise PayloadError(f"not a {FORMAT} payload: format {meta['format']!r}, kind {meta['kind']!r}")
            factors = {}
            for p, m in meta["targets"].items():
                factors[p] = TargetFactor(
                    factor=arrays[f"factor/{p}"], decay=arrays.get(f"decay/{p}"), step=int(m["step"]),
                    spec=SketchSpec.from_wire(m),
                    shape=tuple(m["shape"]), rows=tuple(m["rows"]), width=tuple(m["width"]))
            pick = lambda prefix: {k[len(prefix):]: a for k, a in arrays.items() if k.startswith(prefix)}
            return cls(kind=meta["kind"], version=int(meta["version"]), parent=meta["parent"], factors=factors,
                       dense=pick("dense/"), weights=pick("weight/"),
                       fingerprint={p: int(w) for p, w in meta["fingerprint"].items()},
                       checksum=str(meta["checksum"]))
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise PayloadError(f"malformed payload header: {err!r}") from err

    def verify(self) -> None:
        """Raise PayloadError unless `checksum` matches the content (a device payload crossed no wire)."""
        if self.on_device:
            return
        got = payload_checksum(*self.parts())
        if got != self.checksum:
            raise PayloadError(f"checksum mismatch for {self.kind} version {self.version}: payload says "
                               f"{self.checksum[:16]}…, content hashes to {got[:16]}…")


def _sealed(**fields: Any) -> SyncPayload:
    unsealed = SyncPayload(checksum="", **fields)
    return dataclasses.replace(unsealed, checksum=payload_checksum(*unsealed.parts()))


@jax.jit
def _wire_factors(updates: list[LowRankUpdate]) -> list[tuple[jax.Array, jax.Array, jax.Array | None]]:
    return [(u.factor.astype(jnp.bfloat16) if u.spec.round_bf16 else u.factor.astype(jnp.float32), u.step,
             u.decay) for u in updates]


def delta_payload(updates: Any, params: Any, version: int, *, trained: Collection[str] = (),
                  host: bool = True) -> SyncPayload:
    """The delta of one update: factors of the LowRankUpdate leaves of `updates`, dense updates of `trained`.

    Args:
      updates: the update tree the trainer merged (LowRankUpdate leaves for targets; arrays, None or
        optax.MaskedNode elsewhere).
      params: the trainer's parameters after the update (fingerprinted).
      version: trainer updates completed after this one (≥ 1).
      trained: paths of non-target parameters trained densely; other plain leaves are frozen and not sent.
      host: copy the factors to host and seal them (for a wire); False keeps the device arrays (`on_device`).

    Returns:
      A delta with parent = version − 1 (sealed when `host`).

    Raises:
      ValueError: version < 1, a `trained` path missing from `updates` or holding a low-rank update.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"delta_payload: version must be an int >= 1, got {version!r}")
    leaves = jax.tree_util.tree_leaves_with_path(
        updates, is_leaf=lambda x: x is None or is_lowrank(x) or isinstance(x, optax.MaskedNode))
    flat = {path_str(k): v for k, v in leaves}
    lowrank = {p: u for p, u in flat.items() if is_lowrank(u)}
    for p in trained:
        if p not in flat or is_lowrank(flat[p]) or flat[p] is None or isinstance(flat[p], optax.MaskedNode):
            raise ValueError(f"delta_payload: trained path {p!r} has no dense update in `updates`")
    wire, dense = _wire_factors(list(lowrank.values())), {p: flat[p] for p in trained}
    keep = (lambda a: np.asarray(a)) if host else (lambda a: a)
    if host:
        wire, dense = jax.device_get((wire, dense))
    factors = {}
    for (p, u), (factor, step, decay) in zip(lowrank.items(), wire):
        t = u.target
        factors[p] = TargetFactor(factor=keep(factor), decay=None if decay is None else keep(decay),
                                  step=int(step), spec=u.spec.for_target(t.path), shape=t.shape, rows=t.dims.rows,
                                  width=t.dims.width)
    fields = dict(kind="delta", version=version, parent=version - 1, factors=factors,
                  dense={p: keep(a) for p, a in dense.items()}, weights={}, fingerprint=tree_fingerprint(params))
    return _sealed(**fields) if host else SyncPayload(checksum="", on_device=True, **fields)


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def snapshot_payload(params: Any, version: int, *, host: bool = True) -> SyncPayload:
    """A full snapshot of `params` (every leaf, its own dtype) at `version`: sealed host copies, or (host=False)
    device copies in the same shardings, each process copying only its own shards."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"snapshot_payload: version must be an int >= 0, got {version!r}")
    fields = dict(kind="snapshot", version=version, parent=None, factors={}, dense={},
                  fingerprint=tree_fingerprint(params))
    if not host:
        return SyncPayload(weights=_copy(flat_params(params)), checksum="", on_device=True, **fields)
    weights = {p: np.asarray(a) for p, a in jax.device_get(flat_params(params)).items()}
    return _sealed(weights=weights, **fields)


class SyncError(RuntimeError):
    """The rollout engine could not be brought in sync even by a full snapshot."""


class SyncReport(NamedTuple):
    """One publication: version, bytes sent (delta + any resync snapshot), wall seconds in all and of building the
    delta on the trainer (factors to the host, fingerprint, checksum), the final reply, and why a resync happened
    ("" when none did)."""

    version: int
    nbytes: int
    seconds: float
    build_seconds: float
    reply: SyncReply
    resync_reason: str


class PolicySync:
    """Trainer side: publishes each update as a delta, answers a resync request with a snapshot.

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.rollout.worker import RolloutWeights
      >>> params = {"q_proj": {"kernel": jnp.ones((4, 8))}}
      >>> rollout = RolloutWeights(jax.eval_shape(lambda: params))
      >>> sync = PolicySync(rollout.receive, params)        # bootstrap snapshot at version 0
      >>> rollout.version, sync.resyncs
      (0, 0)
    """

    def __init__(self, receive: Callable[[SyncPayload | bytes], SyncReply], params: Any, *, version: int = 0,
                 trained: Collection[str] = (), on_device: bool = False):
        """receive: the engine's `sync` (a transport's, or `RolloutWeights.receive`); params: the trainer's weights
        at `version`; trained: non-target paths trained densely (their updates are sent); on_device: hand the
        device arrays over (a colocated engine, `SyncPayload.on_device`) instead of host copies."""
        self._receive = receive
        self.version = version
        self.trained = tuple(trained)
        self.on_device = on_device
        self.resyncs = 0
        self.bootstrap = self.send(snapshot_payload(params, version, host=not on_device), params)

    def push(self, updates: Any, params: Any) -> SyncReport:
        """Publish the update that took the trainer from `self.version` to `self.version + 1` (params after it)."""
        payload, start = self.prepare(updates, params)
        return self.send(payload, params, start)

    def prepare(self, updates: Any, params: Any) -> tuple[SyncPayload, float]:
        """The delta of the update that took the trainer from `self.version` to `self.version + 1` (params after
        it), built now (factors copied to the host, or kept on device), and the time building it began: what
        `send` then delivers, possibly later and from another thread (an asynchronous pipeline builds each delta
        before the trainer's next step takes the weights)."""
        start = time.perf_counter()
        payload = delta_payload(updates, params, self.version + 1, trained=self.trained, host=not self.on_device)
        self.version += 1
        return payload, start

    def send(self, payload: SyncPayload | bytes, params: Any, start: float | None = None) -> SyncReport:
        """Deliver a payload (or raw bytes); on a resync request deliver a snapshot of `params` at `self.version`.

        `start` (a time.perf_counter() reading) marks when building the payload began; None = now. With params
        None (weights the caller can no longer offer, e.g. donated to the next step) a resync request is returned
        unanswered: the report's reply has status "resync", and the caller repairs the engine with `repair`.

        Raises:
          SyncError: the snapshot is not accepted either.
        """
        sent = time.perf_counter()
        start = sent if start is None else start
        nbytes = payload.nbytes if isinstance(payload, SyncPayload) else len(payload)
        reply = self._receive(payload)
        reason = ""
        if reply.status == "resync":
            reason = reply.reason
            if params is None:
                return SyncReport(self.version, nbytes, time.perf_counter() - start, sent - start, reply, reason)
            repaired = self.repair(params)
            nbytes += repaired.nbytes
            reply = repaired.reply
        return SyncReport(self.version, nbytes, time.perf_counter() - start, sent - start, reply, reason)

    def repair(self, params: Any) -> SyncReport:
        """Send a snapshot of `params` (the trainer's weights at `self.version`) in answer to a resync request.

        Raises:
          SyncError: the engine does not load it.
        """
        start = time.perf_counter()
        self.resyncs += 1
        snapshot = snapshot_payload(params, self.version, host=not self.on_device)
        reply = self._receive(snapshot)
        if reply.status != "loaded":
            raise SyncError(f"rollout engine refused the version {self.version} snapshot: {reply.reason}")
        return SyncReport(self.version, snapshot.nbytes, time.perf_counter() - start, 0.0, reply, "")
