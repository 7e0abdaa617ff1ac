"""Bytes on the wire between the trainer and its rollout engines, with numpy and the standard library only (the
vLLM extension imports this module inside vLLM's process, where there is no JAX).

Messages (`pack` / `unpack`, no pickle): b"LGRASYNC", u64 little-endian header length, UTF-8 JSON header
{"meta", "arrays": [{name, dtype, shape, offset, nbytes}]}, then the raw little-endian array bytes.

Keyed channel (`Channel`): only the job's own engines get in. Each run draws a secret (`new_secret`, 32 random
bytes) and hands it to the engines it starts through a pipe or the environment, never on a command line. The
trainer listens; for each connection (`accept_engine`):
  trainer → engine   b"LGRAAUTH" · n_t                         (n_t: 32 fresh random bytes)
  engine  → trainer  n_e · MAC(secret, "engine" · n_t · n_e)
  trainer → engine   MAC(secret, "trainer" · n_t · n_e)         (the engine checks the trainer knows it too)
  session key k = MAC(secret, "session" · n_t · n_e)
MAC = keyed BLAKE2b-256. A connection that does not answer correctly within the handshake timeout is logged and
closed, and the trainer goes on waiting for its engine. Afterwards every frame is
  u64 LE length of (op · body) · op (1 byte) · body · MAC(k, direction · u64 LE sequence number · op · body)
with one sequence counter per direction, so a forged, altered, replayed, reordered or reflected frame fails its
tag (`FrameError`) before anything in it is read; a channel that saw a bad frame is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

_MAGIC = b"LGRASYNC"
_AUTH = b"LGRAAUTH"
_NONCE = 32
_TAG = 32
SECRET_ENV = "LOGRA_ROLLOUT_SECRET"
DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in
                               ("float32", "float16", "int32", "uint32", "int8", "uint8", "bool")}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)

log = logging.getLogger(__name__)


class PayloadError(ValueError):
    """A payload or frame that cannot be trusted: malformed, truncated or failing its checksum."""


class FrameError(ConnectionError):
    """A frame or handshake without a valid tag under the run's secret (forged, altered, replayed or a stranger)."""


def contiguous(a: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")


def header(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """The magic, header length and JSON header `pack` writes before the array bytes."""
    table, offset = [], 0
    for name, a in arrays.items():
        if a.dtype.name not in DTYPES:
            raise TypeError(f"pack: array {name!r} has unsupported dtype {a.dtype} (supported: {sorted(DTYPES)})")
        table.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset,
                      "nbytes": a.nbytes})
        offset += a.nbytes
    text = json.dumps({"meta": meta, "arrays": table}, separators=(",", ":")).encode()
    return _MAGIC + struct.pack("<Q", len(text)) + text


def pack(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """Frame a JSON-able `meta` dict and named arrays as bytes (see the module docstring); `unpack` inverts it.

    Example:
      >>> meta, arrays = unpack(pack({"a": 1}, {"x": np.arange(3, dtype=np.int32)}))
      >>> meta, arrays["x"].tolist()
      ({'a': 1}, [0, 1, 2])
    """
    arrays = {name: contiguous(a) for name, a in arrays.items()}
    blobs = [a.reshape(-1).view(np.uint8).data for a in arrays.values()]
    return b"".join([header(meta, arrays), *blobs])


def unpack(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) from `pack`'s bytes; arrays are read-only views into `data` (no copy).

    Raises:
      PayloadError: bad magic, truncated data, unreadable header or an array table that does not fit.
    """
    view = memoryview(data).cast("B")
    start = len(_MAGIC) + 8
    if len(view) < start or bytes(view[:len(_MAGIC)]) != _MAGIC:
        raise PayloadError(f"frame does not start with {_MAGIC!r} (length {len(view)})")
    (size,) = struct.unpack("<Q", view[len(_MAGIC):start])
    if start + size > len(view):
        raise PayloadError(f"header length {size} exceeds the frame ({len(view)} bytes)")
    try:
        head = json.loads(bytes(view[start:start + size]).decode())
        body = view[start + size:]
        arrays = {}
        for entry in head["arrays"]:
            lo, n = int(entry["offset"]), int(entry["nbytes"])
            dtype, shape = DTYPES[entry["dtype"]], tuple(int(s) for s in entry["shape"])
            if lo < 0 or lo + n > len(body) or n != dtype.itemsize * int(np.prod(shape)):
                raise PayloadError(f"array {entry['name']!r} ({n} bytes at {lo}) does not fit the frame")
            arrays[entry["name"]] = np.frombuffer(body[lo:lo + n], dtype=dtype).reshape(shape)
        return head["meta"], arrays
    except PayloadError:
        raise
    except (ValueError, KeyError, TypeError) as err:  # includes JSON and UTF-8 decoding errors
        raise PayloadError(f"unreadable frame header: {err!r}") from err


def payload_checksum(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    """BLAKE2b-256 hex digest of canonical JSON `meta` and, in name order, each array's name, dtype, shape, bytes."""
    h = hashlib.blake2b(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode(), digest_size=32)
    for name in sorted(arrays):
        a = contiguous(arrays[name])
        h.update(json.dumps([name, a.dtype.name, list(a.shape)]).encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def new_secret() -> bytes:
    """A fresh run secret: 32 bytes from the OS's cryptographic generator."""
    return secrets.token_bytes(32)


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The run secret from the environment variable LOGRA_ROLLOUT_SECRET (hex), for an engine started elsewhere.

    Raises:
      ValueError: the variable is missing, not hex, or shorter than 16 bytes.
    """
    text = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    return check_secret(bytes.fromhex(text.strip()) if _is_hex(text) else b"", SECRET_ENV)


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text.strip())
    except ValueError:
        return False
    return True


def check_secret(secret: bytes, where: str = "secret") -> bytes:
    """`secret` if it is bytes of length 16 to 64 (BLAKE2b's key size), else ValueError naming `where`."""
    if not isinstance(secret, bytes) or not 16 <= len(secret) <= 64:
        raise ValueError(f"{where}: the run secret must be 16 to 64 bytes (hex in the environment), got "
                         f"{len(secret) if isinstance(secret, bytes) else type(secret).__name__}")
    return secret


def mac(key: bytes, *parts: bytes) -> bytes:
    """Keyed BLAKE2b-256 of the concatenated parts."""
    h = hashlib.blake2b(key=key, digest_size=_TAG)
    for part in parts:
        h.update(part)
    return h.digest()


def recv_exact(sock: socket.socket, n: int) -> memoryview:
    """Exactly n bytes from `sock` (ConnectionError if the peer closes first)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection ({got} of {n} bytes received)")
        got += k
    return view


class Channel:
    """Keyed frames over a connected socket (see the module docstring); built by `server_handshake` (the trainer)
    or `client_handshake` (an engine)."""

    def __init__(self, sock: socket.socket, key: bytes, role: bytes):
        if role not in (b"T", b"E"):
            raise ValueError(f"Channel: role must be b'T' (trainer) or b'E' (engine), got {role!r}")
        self.sock, self._key, self._role = sock, key, role
        self._peer = b"E" if role == b"T" else b"T"
        self._sent = self._received = 0

    def seal(self, op: bytes, body: bytes | memoryview = b"") -> list[bytes | memoryview]:
        """The pieces of the next outgoing frame (advances the send counter)."""
        if len(op) != 1:
            raise ValueError(f"Channel.send: op must be one byte, got {op!r}")
        tag = mac(self._key, self._role, struct.pack("<Q", self._sent), op, body)
        self._sent += 1
        return [struct.pack("<Q", len(body) + 1) + op, body, tag]

    def send(self, op: bytes, body: bytes | memoryview = b"") -> None:
        for piece in self.seal(op, body):
            self.sock.sendall(piece)

    def open(self, frame: memoryview) -> tuple[bytes, memoryview]:
        """(op, body) of a received frame (op · body · tag), checked against the receive counter.

        Raises:
          FrameError: the tag is wrong (forged, altered, replayed, reordered or reflected); nothing is returned.
        """
        if len(frame) < 1 + _TAG:
            raise FrameError(f"frame of {len(frame)} bytes is shorter than an op and its tag")
        op, body, tag = bytes(frame[:1]), frame[1:-_TAG], bytes(frame[-_TAG:])
        want = mac(self._key, self._peer, struct.pack("<Q", self._received), op, body)
        if not hmac.compare_digest(tag, want):
            raise FrameError(f"frame {self._received} from the {'engine' if self._peer == b'E' else 'trainer'} "
                             f"fails its tag (op {op!r}, {len(body)} bytes): refused")
        self._received += 1
        return op, body

    def recv(self) -> tuple[bytes, memoryview]:
        (size,) = struct.unpack("<Q", recv_exact(self.sock, 8))
        return self.open(recv_exact(self.sock, size + _TAG))

    def close(self) -> None:
        self.sock.close()


def server_handshake(sock: socket.socket, secret: bytes, timeout_s: float = 10.0) -> Channel:
    """The trainer's side of the handshake on an accepted connection. Raises FrameError (or OSError) on failure."""
    sock.settimeout(timeout_s)
    n_t = secrets.token_bytes(_NONCE)
    sock.sendall(_AUTH + n_t)
    answer = recv_exact(sock, _NONCE + _TAG)
    n_e, tag = bytes(answer[:_NONCE]), bytes(answer[_NONCE:])
    if not hmac.compare_digest(tag, mac(secret, b"engine", n_t, n_e)):
        raise FrameError("the peer does not know the run secret")
    sock.sendall(mac(secret, b"trainer", n_t, n_e))
    sock.settimeout(None)
    return Channel(sock, mac(secret, b"session", n_t, n_e), b"T")


def client_handshake(sock: socket.socket, secret: bytes, timeout_s: float = 60.0) -> Channel:
    """An engine's side of the handshake on a connected socket. Raises FrameError if the trainer fails it."""
    sock.settimeout(timeout_s)
    hello = recv_exact(sock, len(_AUTH) + _NONCE)
    if bytes(hello[:len(_AUTH)]) != _AUTH:
        raise FrameError(f"the trainer did not open with {_AUTH!r}")
    n_t, n_e = bytes(hello[len(_AUTH):]), secrets.token_bytes(_NONCE)
    sock.sendall(n_e + mac(secret, b"engine", n_t, n_e))
    if not hmac.compare_digest(bytes(recv_exact(sock, _TAG)), mac(secret, b"trainer", n_t, n_e)):
        raise FrameError("the listener does not know the run secret: not our trainer")
    sock.settimeout(None)
    return Channel(sock, mac(secret, b"session", n_t, n_e), b"E")


def accept_engine(listener: socket.socket, secret: bytes, timeout_s: float, *,
                  alive: Callable[[], None] = lambda: None, handshake_timeout_s: float = 10.0) -> Channel:
    """Accept connections on `listener` until one passes the handshake; refuse (log and close) the others.

    Args:
      alive: called between attempts; raises to give up (e.g. the engine process exited).

    Raises:
      TimeoutError: no engine passed the handshake within `timeout_s`.
    """
    listener.settimeout(0.5)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        try:
            sock, peer = listener.accept()
        except TimeoutError:
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            return server_handshake(sock, secret, min(handshake_timeout_s, max(deadline - time.monotonic(), 0.1)))
        except (OSError, ConnectionError) as err:  # FrameError is a ConnectionError
            log.warning("rollout engine port: refused a connection from %s:%s (%s)", *peer[:2], err)
            sock.close()
    raise TimeoutError(f"no rollout engine passed the handshake within {timeout_s} s")

