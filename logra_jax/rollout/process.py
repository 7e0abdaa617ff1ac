"""An engine in its own process, both ends: the trainer's handle (`EngineProcess`) and the engine's main and request
loop (`run_engine`, `serve`); what our JAX rollout worker (logra_jax.rollout.worker) and the vLLM server
(logra_jax.rollout.vllm.server) share. The standard library, numpy and logra_jax.rollout.wire only: the vLLM server
runs it in a venv without JAX.

The trainer listens on a loopback port and starts `python -m <engine module> --connect HOST:PORT --secret-stdin`
with the run secret on its stdin (never on its command line); the engine connects back, proves the secret
(logra_jax.rollout.wire's keyed channel) and answers one request at a time until it is shut down or the trainer
hangs up. A request is a keyed frame whose op byte names it (`OPS`) and whose body is the op's own bytes (a packed
message, or a sync payload's bytes); every reply is a packed {"ok": true, ...} (or {"ok": false, "error",
"traceback"}) frame with op b"R".
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Self, TypeVar

import numpy as np

from logra_jax.rollout.wire import (
    SECRET_ENV,
    Channel,
    FrameError,
    accept_engine,
    check_secret,
    client_handshake,
    pack,
    secret_from_env,
    unpack,
)

if TYPE_CHECKING:
    from logra_jax.rollout.sync import SyncPayload

OPS: Mapping[str, bytes] = {"hello": b"H", "sync": b"S", "generate": b"G", "fetch": b"F", "counts": b"C",
                            "probe": b"P", "shutdown": b"Q"}
_OP_NAMES = {code: name for name, code in OPS.items()}
_REPLY = b"R"
# In an engine's environment: the CPUs its process (and every thread it starts) may run on, as taskset's list
# ("1", "2-3,6"); set before the engine starts (measuring overlap on a small host: each side its own cores).
CPUS_ENV = "LOGRA_ENGINE_CPUS"

Reply = tuple[Mapping[str, Any], Mapping[str, np.ndarray]]  # a reply's meta (beside "ok") and arrays
E = TypeVar("E")


class WorkerError(RuntimeError):
    """An engine process failed to start, died, or reported an error (the message carries its log)."""


class SyncReply(NamedTuple):
    """Receiver's answer: status "applied" (delta), "loaded" (snapshot), "stale" (ignored) or "resync" (with the
    reason); the version it now holds (None: unsynchronised); its wall seconds per phase ("check": parse, checksum
    and structure; "apply": merge or load; "fingerprint")."""

    status: Literal["applied", "loaded", "stale", "resync"]
    version: int | None
    reason: str = ""
    seconds: Mapping[str, float] | None = None


class EngineProcess:
    """An engine process on this host, driven over the keyed channel (see the module docstring): started with the
    run secret on its stdin and its output in a log file, connected back to a loopback listener, one request at a
    time, and stopped with its owner (`close`, or when it is dropped). Subclasses name their `label` and build the
    command and the hello message.

    Args:
      argv: the engine's command line, less --connect and --secret-stdin.
      env: its whole environment.
      secret: the run's secret (`logra_jax.rollout.wire.new_secret`).
      hello: the body of the hello request (what the engine builds itself from).
      start_timeout_s: how long the engine may take to connect and answer the hello.
      request_timeout_s: how long one request may take.
      cwd: its working folder (None: ours).

    Raises:
      WorkerError: the engine exits, does not connect within `start_timeout_s`, or fails its hello (with its log).
    """

    label = "engine process"

    def __init__(self, argv: list[str], env: Mapping[str, str], secret: bytes, hello: bytes, *,
                 start_timeout_s: float, request_timeout_s: float, cwd: str | Path | None = None):
        self.request_timeout_s = request_timeout_s
        self._launch(argv, env, check_secret(secret, type(self).__name__), start_timeout_s, cwd)
        try:
            self._request("hello", hello, timeout_s=start_timeout_s)
        except WorkerError:
            self.close()  # an engine that cannot build itself has nothing left to serve
            raise

    def _launch(self, argv: list[str], env: Mapping[str, str], secret: bytes, start_timeout_s: float,
                cwd: str | Path | None) -> None:
        self._log = Path(tempfile.mkstemp(prefix=self.label.replace(" ", "_") + "_", suffix=".log")[1])
        listener = socket.create_server(("127.0.0.1", 0))
        cpus = cpu_list(env.get(CPUS_ENV, ""))
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [*argv, "--connect", f"127.0.0.1:{listener.getsockname()[1]}", "--secret-stdin"], env=dict(env),
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self._finalizer = weakref.finalize(self, _stop, self._proc, None, self._log)
        try:
            self._proc.stdin.write(secret.hex().encode() + b"\n")
            self._proc.stdin.close()
        except OSError:  # it died at once: accept_engine reports its log
            pass
        try:
            self._chan: Channel | None = accept_engine(listener, secret, start_timeout_s, alive=self._alive)
        except TimeoutError:
            _stop(self._proc, None, None, grace_s=0.0)
            raise WorkerError(f"{self.label} did not connect within {start_timeout_s} s:\n{self.log_tail()}") from None
        finally:
            listener.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._chan.sock, self._log)

    def _alive(self) -> None:
        if self._proc.poll() is not None:
            raise WorkerError(f"{self.label} exited with code {self._proc.returncode} before connecting:\n"
                              f"{self.log_tail()}")

    @property
    def pid(self) -> int:
        """The engine's process id."""
        return self._proc.pid

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the engine's stdout/stderr log."""
        try:
            return self._log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def _request(self, op: str, body: bytes | memoryview = b"", timeout_s: float | None = None
                 ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        if self._chan is None:
            raise WorkerError(f"{self.label} is closed")
        self._chan.sock.settimeout(self.request_timeout_s if timeout_s is None else timeout_s)
        try:
            self._chan.send(OPS[op], body)
            _, reply = self._chan.recv()
        except (OSError, ConnectionError) as err:  # FrameError included: the stream cannot be trusted any more
            raise self._lost(op, err) from err
        meta, arrays = unpack(reply)
        if not meta.pop("ok", False):
            raise WorkerError(f"{self.label} {op!r} request failed: {meta.get('error')}\n{meta.get('traceback')}")
        return meta, arrays

    def _lost(self, op: str, err: Exception) -> WorkerError:
        """The error for a request the connection failed under; the engine is stopped (the stream is out of step)."""
        try:  # an engine that dropped the connection is usually on its way out: let it finish
            code = self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        state = "was still running (killed)" if code is None else f"exited with code {code}"
        message = f"{self.label} {op!r} request failed ({err!r}); it {state}:\n{self.log_tail()}"
        self._proc.kill()
        self._finalizer()
        self._chan = None
        return WorkerError(message)

    def sync(self, payload: SyncPayload | bytes | bytearray | memoryview) -> SyncReply:
        """Send a sync payload (or its bytes) to the engine's receiver; its answer."""
        data = payload if isinstance(payload, (bytes, bytearray, memoryview)) else payload.to_bytes()
        meta, _ = self._request("sync", data)
        return SyncReply(**{name: meta[name] for name in SyncReply._fields})

    def fetch(self) -> tuple[int | None, dict[str, np.ndarray]]:
        """(version, {path: float32 master}) of the engine's weights ((None, {}) before the first snapshot)."""
        meta, arrays = self._request("fetch")
        return meta["version"], {name: np.array(a) for name, a in arrays.items()}

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the engine to exit; kill it if it has not within `timeout_s`. Idempotent."""
        if self._chan is not None:
            try:
                self._chan.sock.settimeout(timeout_s)
                self._chan.send(OPS["shutdown"])
                self._chan.recv()
            except (OSError, ConnectionError):
                pass
        self._finalizer()
        self._chan = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def cpu_list(text: str, *, check_host: bool = True) -> set[int]:
    """CPUs from taskset's list syntax ("" → none: no pinning); check_host: each must be one this host has.

    Raises:
      ValueError: a malformed list, or a CPU this host does not have (naming CPUS_ENV and the value).

    Example:
      >>> sorted(cpu_list("0,2-3", check_host=False))
      [0, 2, 3]
    """
    cpus: set[int] = set()
    try:
        for part in filter(None, text.replace(" ", "").split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{CPUS_ENV}={text!r}: not a CPU list such as '1' or '2-3,6'") from None
    unknown = sorted(cpus - set(range(os.cpu_count() or 1))) if check_host else []
    if unknown:
        raise ValueError(f"{CPUS_ENV}={text!r}: this host has CPUs 0-{(os.cpu_count() or 1) - 1}, not {unknown}")
    return cpus


def _stop(proc: subprocess.Popen, sock: socket.socket | None, log: Path | None, grace_s: float = 10.0) -> None:
    """Close the socket, give the engine `grace_s` to exit (it does once the trainer hangs up), then kill it."""
    if sock is not None:
        sock.close()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if log is not None:
        log.unlink(missing_ok=True)


def serve(chan: Channel, hello: Callable[[memoryview], E], answers: Mapping[str, Callable[[E, memoryview], Reply]],
          engine: E | None = None, *, label: str) -> E | None:
    """An engine process's loop: answer requests on `chan` until a shutdown request, the trainer hanging up, or a
    frame that fails its tag (refused unread and logged to stderr as `label`; the connection is then closed).

    Args:
      hello: builds the engine from the body of the trainer's hello request.
      answers: {op: answer(engine, body) -> (meta, arrays)} for the other requests the engine serves. An error is
        sent back as the reply (the trainer raises WorkerError) and the engine keeps serving.
      engine: the engine to serve (None: built by the hello request).

    Returns:
      The engine (None if no hello came).
    """
    while True:
        try:
            code, body = chan.recv()
        except FrameError as err:
            print(f"{label}: {err}; closing the connection", file=sys.stderr, flush=True)
            return engine
        except ConnectionError:
            return engine
        op = _OP_NAMES.get(code, repr(code))
        if op == "shutdown":
            chan.send(_REPLY, pack({"ok": True}, {}))
            return engine
        try:
            engine, (meta, arrays) = _answer(engine, op, body, hello, answers)
            reply = pack({"ok": True, **meta}, arrays)
        except Exception as err:  # reported to the trainer, which raises WorkerError; the engine keeps serving
            reply = pack({"ok": False, "error": repr(err), "traceback": traceback.format_exc()}, {})
        chan.send(_REPLY, reply)


def _answer(engine: E | None, op: str, body: memoryview, hello: Callable[[memoryview], E],
            answers: Mapping[str, Callable[[E, memoryview], Reply]]) -> tuple[E, Reply]:
    if op == "hello":
        return hello(body), ({}, {})
    if engine is None:
        raise RuntimeError(f"request {op!r} before hello")
    if op not in answers:
        raise RuntimeError(f"unknown op {op!r}")
    return engine, answers[op](engine, body)


def run_engine(argv: list[str] | None, description: str, serve: Callable[[Channel], Any]) -> None:
    """An engine process's main (our worker, the vLLM server): connect back to the trainer's --connect HOST:PORT,
    prove the run secret (a hex line on stdin with --secret-stdin, else $LOGRA_ROLLOUT_SECRET) and `serve` the
    keyed channel. Ctrl-C in a terminal reaches the whole process group: the trainer stops at its next step boundary
    and then shuts the engine down itself, so the engine ignores SIGINT rather than die under it mid-rollout."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--connect", required=True, help="HOST:PORT the trainer listens on")
    parser.add_argument("--secret-stdin", action="store_true",
                        help=f"read the run secret (hex) from stdin; otherwise from ${SECRET_ENV}")
    args = parser.parse_args(argv)
    secret = check_secret(bytes.fromhex(sys.stdin.readline().strip()), "stdin") if args.secret_stdin \
        else secret_from_env()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host, port = args.connect.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        serve(client_handshake(sock, secret))
