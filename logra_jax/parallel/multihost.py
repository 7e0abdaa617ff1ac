"""Multi-process JAX (`jax.distributed`) from a config or the environment, with a rendezvous that fails cleanly.

Every process of a multi-controller run calls `initialize(config)` before touching devices; afterwards
`jax.devices()` lists the devices of all processes and one global mesh (`logra_jax.parallel.sharding.make_mesh`) spans
them. On CPU the cross-process collectives use gloo.

`jax.distributed.initialize` aborts the process (SIGABRT from C++) when a peer never arrives, instead of raising.
So `initialize` first runs a small TCP rendezvous on the coordinator's address: process 0 listens, every other
process connects and announces (process_id, num_processes); process 0 answers once all have arrived. A missing,
duplicated or misconfigured peer becomes a `DistributedInitError` naming the processes and the address, raised
within `timeout_s` on every process that is alive. Only then does JAX start its own coordination service, on
the same port (process 0 closes its listener first; clients retry until the service is up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_TIMEOUT = "LOGRA_DISTRIBUTED_TIMEOUT_S"
ENV_HEARTBEAT = "LOGRA_HEARTBEAT_TIMEOUT_S"

_HELLO = b"logra-rendezvous"
_GO = b"go\n"
_RETRY_S = 0.1


class DistributedInitError(RuntimeError):
    """The processes of a multi-process run could not all meet at the coordinator."""


@dataclasses.dataclass(frozen=True, slots=True)
class DistributedConfig:
    """Where and how the processes of one run meet.

    Attributes:
      coordinator_address: "host:port" of process 0 (the same on every process).
      num_processes: number of processes in the run.
      process_id: this process's index in [0, num_processes).
      local_device_ids: devices of this host that this process uses (None: all).
      timeout_s: seconds to wait for every peer (rendezvous and JAX's own initialization).
      heartbeat_timeout_s: seconds without a heartbeat after which JAX's coordination service declares a process
        dead (killed, out of memory, lost host) and stops every other process with that news.

    Example:
      >>> DistributedConfig("127.0.0.1:12345", num_processes=2, process_id=1).port
      12345
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    timeout_s: int = 300
    heartbeat_timeout_s: int = 100

    def __post_init__(self) -> None:
        host, sep, port = self.coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"DistributedConfig.coordinator_address must be 'host:port', got "
                             f"{self.coordinator_address!r}")
        for name in ("num_processes", "timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DistributedConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"DistributedConfig.process_id must be in [0, {self.num_processes}), got "
                             f"{self.process_id!r}")

    @property
    def host(self) -> str:
        return self.coordinator_address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.coordinator_address.rpartition(":")[2])

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistributedConfig | None:
        """From JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (+ JAX_LOCAL_DEVICE_IDS,
        LOGRA_DISTRIBUTED_TIMEOUT_S); None when JAX_COORDINATOR_ADDRESS is unset (a single-process run).

        Raises:
          ValueError: the address is set but another required variable is missing or not an integer.
        """
        env = os.environ if env is None else env
        if not env.get(ENV_COORDINATOR):
            return None

        def integer(name: str, default: int | None = None) -> int:
            raw = env.get(name)
            if raw is None and default is not None:
                return default
            if raw is None or not raw.strip().lstrip("-").isdigit():
                raise ValueError(f"environment variable {name} must be an integer when {ENV_COORDINATOR} is "
                                 f"set, got {raw!r}")
            return int(raw)

        ids = env.get("JAX_LOCAL_DEVICE_IDS")
        local = tuple(int(i) for i in ids.split(",")) if ids else None
        return cls(env[ENV_COORDINATOR], integer(ENV_NUM_PROCESSES), integer(ENV_PROCESS_ID), local,
                   integer(ENV_TIMEOUT, 300), integer(ENV_HEARTBEAT, 100))


def _recv_line(conn: socket.socket, deadline: float) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(deadline - time.monotonic(), 1e-3))
        chunk = conn.recv(256)
        if not chunk:
            break
        data += chunk
    return data


def _serve(config: DistributedConfig, deadline: float) -> None:
    """Process 0: accept one announcement from each other process, then release them all."""
    peers: dict[int, socket.socket] = {}
    dual = socket.has_dualstack_ipv6()  # listen on IPv4 and IPv6, like JAX's own service ([::]:port)
    with socket.create_server(("", config.port), family=socket.AF_INET6 if dual else socket.AF_INET,
                              dualstack_ipv6=dual) as server:
        try:
            while len(peers) < config.num_processes - 1:
                server.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, config.num_processes)) - set(peers))
                    raise DistributedInitError(
                        f"process(es) {missing} of {config.num_processes} did not reach the coordinator at "
                        f"{config.coordinator_address} within {config.timeout_s} s") from None
                try:
                    words = _recv_line(conn, deadline).split()
                except TimeoutError:
                    words = []
                if len(words) != 3 or words[0] != _HELLO or not (words[1].isdigit() and words[2].isdigit()):
                    conn.close()  # not one of ours (or it hung up): keep waiting for the real peers
                    continue
                pid, n = int(words[1]), int(words[2])
                if n != config.num_processes or not 0 < pid < n or pid in peers:
                    conn.close()
                    raise DistributedInitError(
                        f"process {pid} announced num_processes={n} at {config.coordinator_address}; the "
                        f"coordinator expects num_processes={config.num_processes} and unique ids "
                        f"1..{config.num_processes - 1} (already joined: {sorted(peers)})")
                peers[pid] = conn
            for conn in peers.values():
                conn.sendall(_GO)
            # Clients close first, so the coordinator's port is free again for JAX's service.
            for conn in peers.values():
                _recv_line(conn, time.monotonic() + 5.0)
        finally:
            for conn in peers.values():
                conn.close()


def _join(config: DistributedConfig, deadline: float) -> None:
    """Processes 1..n-1: announce to the coordinator (retrying until it listens) and wait for the release."""
    while True:
        try:
            conn = socket.create_connection((config.host, config.port),
                                            timeout=max(deadline - time.monotonic(), 1e-3))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise DistributedInitError(
                    f"process {config.process_id}: no coordinator (process 0) at {config.coordinator_address} "
                    f"within {config.timeout_s} s") from None
            time.sleep(_RETRY_S)
    with conn:
        conn.sendall(b"%s %d %d\n" % (_HELLO, config.process_id, config.num_processes))
        try:
            reply = _recv_line(conn, deadline)
        except TimeoutError:
            reply = b""
        if reply != _GO:
            raise DistributedInitError(
                f"process {config.process_id}: the coordinator at {config.coordinator_address} did not release "
                f"the rendezvous within {config.timeout_s} s (another process of {config.num_processes} is "
                "missing or misconfigured)")


def rendezvous(config: DistributedConfig) -> None:
    """Block until all `config.num_processes` processes have reached the coordinator's address.

    Raises:
      DistributedInitError: within `config.timeout_s` when a peer is missing, the coordinator is unreachable,
        or processes disagree on num_processes / have duplicate ids.
    """
    if config.num_processes == 1:
        return
    deadline = time.monotonic() + config.timeout_s
    if config.process_id == 0:
        _serve(config, deadline)
    else:
        _join(config, deadline)


def initialize(config: DistributedConfig | None = None) -> bool:
    """Initialise multi-process JAX from `config` (default: the environment, `DistributedConfig.from_env`).

    Call it once per process, before any other JAX call that touches devices. Selects gloo for CPU collectives,
    runs the `rendezvous`, then `jax.distributed.initialize`.

    Returns:
      True when a multi-process runtime was initialised; False for a single-process run (no config).

    Raises:
      DistributedInitError: a peer did not arrive in time (see `rendezvous`).

    Example (in each of 2 processes):
      >>> initialize(DistributedConfig("127.0.0.1:12345", num_processes=2, process_id=0))  # doctest: +SKIP
      True
    """
    config = DistributedConfig.from_env() if config is None else config
    if config is None:
        return False
    if "jax_cpu_collectives_implementation" in jax.config.values:  # the option may move between JAX versions
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rendezvous(config)
    local: Sequence[int] | None = list(config.local_device_ids) if config.local_device_ids is not None else None
    options = {}
    if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
        options["heartbeat_timeout_seconds"] = config.heartbeat_timeout_s
    jax.distributed.initialize(config.coordinator_address, num_processes=config.num_processes,
                               process_id=config.process_id, local_device_ids=local,
                               initialization_timeout=config.timeout_s, **options)
    return True


def shutdown() -> None:
    """Leave the multi-process runtime (a no-op when it was never initialised)."""
    jax.distributed.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# The main job's view: who this process is, one place that says "process 0 only", barriers, and failures that
# stop every process instead of leaving the others blocked in a collective.

_FAILURE_KEY = "logra_jax/failure"
_WATCH_POLL_MS = 500
LINGER_S = 2.0  # how long process 0 (host of the coordination service) stays after a failure, for the news to spread
_WATCH_RETRIES = 10  # consecutive store errors (not timeouts) before the coordinator counts as lost
_watch: dict[str, Any] = {}


def detect_cluster(timeout_s: int = 300) -> DistributedConfig | None:
    """The run JAX's own cluster auto-detection finds (TPU pod slices, SLURM, Open MPI, Kubernetes), or None.

    Uses `jax._src.clusters` (the code behind `jax.distributed.initialize()` without arguments) so that an
    auto-detected run goes through the same `rendezvous` as an explicit one. Returns None when no cluster
    environment is present, when it describes a single process, or when this JAX moved that module.
    """
    try:
        from jax._src import clusters
        present = [env for env in clusters.ClusterEnv._cluster_types
                   if not env.opt_in_only_method and env.is_env_present()]
    except (ImportError, AttributeError):
        return None
    if not present:
        return None
    try:
        address, n, pid, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, timeout_s)
    except Exception as e:  # cluster back ends raise anything (DNS, Kubernetes, a metadata server)
        raise DistributedInitError(f"JAX's cluster detection found {[env.__name__ for env in present]} but could "
                                   f"not read this process's identity: {type(e).__name__}: {e} (set "
                                   f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} instead)") from e
    if address is None or n is None or pid is None or int(n) <= 1:
        return None
    local_ids = None if local is None else tuple(int(i) for i in ([local] if isinstance(local, int) else local))
    heartbeat = int(os.environ.get(ENV_HEARTBEAT, 100))
    return DistributedConfig(str(address), int(n), int(pid), local_ids, timeout_s, heartbeat)


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, *, env: Mapping[str, str] | None = None,
            auto_detect: bool = True) -> DistributedConfig | None:
    """This process's identity, in order: explicit values (flags), the JAX_* environment variables, JAX's
    cluster auto-detection (`detect_cluster`); None for a single-process run.

    Raises:
      ValueError: explicit values given only in part (names the missing ones), or invalid ones.
    """
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"--coordinator_address, --num_processes and --process_id go together; missing: "
                             f"{', '.join('--' + m for m in missing)}")
        env = os.environ if env is None else env
        return DistributedConfig(coordinator_address, num_processes, process_id,
                                 timeout_s=int(env.get(ENV_TIMEOUT, 300)),
                                 heartbeat_timeout_s=int(env.get(ENV_HEARTBEAT, 100)))
    config = DistributedConfig.from_env(env)
    if config is not None or not auto_detect:
        return config
    return detect_cluster(int(os.environ.get(ENV_TIMEOUT, 300)))


def is_primary() -> bool:
    """True on process 0 (the one that writes logs, metrics, plots and summaries)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def gather(x: Any) -> np.ndarray:
    """Every process's `x` (the same shape and dtype on each), stacked: [num_processes, *shape], bit for bit (the
    bytes travel, so float64 and int64 survive JAX's 32-bit default). `x[None]` in a single-process run.

    Example:
      >>> gather(np.float64(0.1)).tolist()
      [0.1]
    """
    x = np.asarray(x, order="C")  # (np.ascontiguousarray would make a scalar 1-d)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils
    rows = np.asarray(multihost_utils.process_allgather(x.reshape(-1).view(np.uint8)))
    return np.ascontiguousarray(rows).view(x.dtype).reshape(-1, *x.shape)


def host_array(x: jax.Array | np.ndarray) -> np.ndarray:
    """The whole of `x` on this host: gathered from every process when it spans several (every process calls this
    and gets the same global value); where `x` is whole here already, possibly a read-only view of it."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@contextlib.contextmanager
def primary_first(name: str) -> Iterator[None]:
    """Run the block on process 0 first, then on the others (shared files: process 0 writes, the others read)."""
    if jax.process_index() != 0:
        barrier(f"{name}: process 0 done")
    yield
    if jax.process_index() == 0:
        barrier(f"{name}: process 0 done")


def _client() -> Any:
    from jax._src import distributed
    return distributed.global_state.client


def announce_failure(message: str, *, linger_s: float = LINGER_S) -> None:
    """Tell every process of the run that this one failed with `message` (they stop at once, naming it).

    The message goes into the coordination service's key-value store, which every process's failure watch
    (`watch_failures`) polls. Process 0 hosts that service, so it lingers `linger_s` seconds before the caller
    exits, for the others to read the message. A no-op in a single-process run.
    """
    client = _client() if jax.process_count() > 1 else None
    if client is None:
        return
    stop_watching()
    with contextlib.suppress(Exception):  # another process announced first, or the service is gone
        client.key_value_set(_FAILURE_KEY, f"process {jax.process_index()}: {message}")
    if jax.process_index() == 0:
        time.sleep(linger_s)


def watch_failures(on_failure: Any) -> None:
    """Start a daemon thread that calls `on_failure(text)` when another process announces a failure, or when
    the coordination service (hosted by process 0) becomes unreachable. A no-op in a single-process run."""
    client = _client() if jax.process_count() > 1 else None
    if client is None or _watch:
        return
    import threading

    stop = threading.Event()

    def loop() -> None:
        errors = 0
        while not stop.is_set():
            try:
                text = client.blocking_key_value_get(_FAILURE_KEY, _WATCH_POLL_MS)
            except Exception as e:  # the runtime raises one error type: tell timeouts apart by their text
                if stop.is_set() or "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    errors = 0
                    continue
                errors += 1  # a transient store error is retried; a coordinator gone for good is not
                if errors < _WATCH_RETRIES:
                    time.sleep(_WATCH_POLL_MS / 1000)
                    continue
                on_failure(f"this process lost contact with the coordinator, hosted by process 0 "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                return
            if not stop.is_set():
                on_failure(text)
            return

    thread = threading.Thread(target=loop, name="logra-failure-watch", daemon=True)
    _watch.update(stop=stop, thread=thread)
    thread.start()


def stop_watching() -> None:
    """Stop the failure watch (before a normal shutdown, so that the peers leaving is not taken for a failure)."""
    if _watch:
        _watch["stop"].set()
        _watch["thread"].join(timeout=2 * _WATCH_POLL_MS / 1000 + 1)
        _watch.clear()
