"""Only the job's own engines get in: keyed handshake and frames (logra_jax.rollout.wire) and the engine loop that
refuses a forged or replayed frame before applying anything (logra_jax.rollout.process.serve, as the worker runs
it)."""

import logging
import socket
import struct
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.rollout.process import OPS
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.sync import snapshot_payload
from logra_jax.rollout.wire import (
    Channel,
    FrameError,
    accept_engine,
    client_handshake,
    new_secret,
    secret_from_env,
    server_handshake,
    unpack,
)
from logra_jax.rollout.worker import RolloutWorker, serve


def _pair(secret_t: bytes, secret_e: bytes) -> tuple[Channel, Channel]:
    """(trainer, engine) channels over a socket pair after the handshake."""
    a, b = socket.socketpair()
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("t", server_handshake(a, secret_t, 5.0)))
    thread.start()
    engine = client_handshake(b, secret_e, 5.0)
    thread.join()
    return out["t"], engine


def test_frames_round_trip_and_bad_frames_are_refused():
    trainer, engine = _pair(*(2 * [new_secret()]))
    frames = [b"".join(bytes(p) for p in trainer.seal(b"S", b"payload %d" % i)) for i in range(3)]
    body = lambda f: memoryview(f)[8:]
    assert (engine.open(body(frames[0]))[0], bytes(engine.open(body(frames[1]))[1])) == (b"S", b"payload 1")
    with pytest.raises(FrameError, match="fails its tag"):  # replayed
        engine.open(body(frames[1]))
    tampered = bytearray(frames[2])
    tampered[12] ^= 1
    with pytest.raises(FrameError, match="fails its tag"):  # altered
        engine.open(body(tampered))
    engine.open(body(frames[2]))  # the refused frames consumed nothing: the genuine one is still next
    reflected = b"".join(bytes(p) for p in engine.seal(b"S", b"x"))
    with pytest.raises(FrameError):  # an engine frame sent back to the engine
        engine.open(body(reflected))
    other_trainer, other_engine = _pair(*(2 * [new_secret()]))
    forged = b"".join(bytes(p) for p in other_trainer.seal(b"S", b"payload 3"))
    with pytest.raises(FrameError):  # a valid frame of another session
        engine.open(body(forged))
    for chan in (trainer, engine, other_trainer, other_engine):
        chan.close()


def test_wrong_secret_fails_both_ways():
    a, b = socket.socketpair()
    errors = []

    def trainer():
        try:
            server_handshake(a, new_secret(), 5.0)
        except FrameError as err:
            errors.append(err)
            a.close()
    thread = threading.Thread(target=trainer)
    thread.start()
    with pytest.raises(ConnectionError):  # the trainer hangs up instead of proving the secret
        client_handshake(b, new_secret(), 5.0)
    thread.join()
    assert "does not know the run secret" in str(errors[0])


def test_stranger_connecting_first_is_refused_logged_and_engine_joins(caplog):
    secret = new_secret()
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    strangers = [socket.create_connection(address), socket.create_connection(address)]
    strangers[0].sendall(b"\0" * 64)  # answers the challenge with garbage; strangers[1] says nothing at all
    joined = {}

    def engine():
        with socket.create_connection(address) as sock:
            chan = client_handshake(sock, secret, 10.0)
            joined["op"] = chan.recv()[0]
            chan.send(b"R", b"ok")
    thread = threading.Thread(target=engine)
    thread.start()
    with caplog.at_level(logging.WARNING, logger="logra_jax.rollout.wire"):
        chan = accept_engine(listener, secret, 20.0, handshake_timeout_s=1.0)
    chan.send(b"H")
    assert bytes(chan.recv()[1]) == b"ok"
    thread.join()
    assert joined["op"] == b"H"
    refused = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 2, [r.getMessage() for r in caplog.records]
    for sock in (*strangers, listener):
        sock.close()
    chan.close()
    with pytest.raises(TimeoutError, match="no rollout engine"):
        accept_engine(socket.create_server(("127.0.0.1", 0)), secret, 0.6)


def test_secret_from_env_is_checked():
    assert secret_from_env({"LOGRA_ROLLOUT_SECRET": "ab" * 32}) == b"\xab" * 32
    for bad in ({}, {"LOGRA_ROLLOUT_SECRET": "zz"}, {"LOGRA_ROLLOUT_SECRET": "ab" * 4}):
        with pytest.raises(ValueError, match="LOGRA_ROLLOUT_SECRET"):
            secret_from_env(bad)


def test_worker_refuses_forged_and_replayed_sync_and_applies_nothing():
    config = preset("tiny")
    worker = RolloutWorker(config, SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0))
    _, params = nnx.split(init_model(config, seed=0))
    trainer, engine = _pair(*(2 * [new_secret()]))
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("worker", serve(engine, worker)))
    thread.start()

    def request(payload_bytes):
        frame = trainer.seal(OPS["sync"], payload_bytes)
        for piece in frame:
            trainer.sock.sendall(piece)
        return unpack(trainer.recv()[1])[0], frame

    first = snapshot_payload(params, 0).to_bytes()
    meta, replay = request(first)
    assert (meta["ok"], meta["status"], meta["version"]) == (True, "loaded", 0)
    doubled = jax.tree.map(lambda x: 2 * x, params)
    meta, _ = request(snapshot_payload(doubled, 1).to_bytes())
    assert (meta["status"], meta["version"]) == ("loaded", 1)
    for piece in replay:  # the version-0 snapshot again, byte for byte: its sequence number is spent
        trainer.sock.sendall(piece)
    thread.join(timeout=30)
    assert not thread.is_alive() and done["worker"] is worker
    assert worker.weights.version == 1 and worker.counts()["loaded"] == 2
    got = jax.device_get(worker.fetch()[1])
    want = {k: np.asarray(v) for k, v in snapshot_payload(doubled, 1).weights.items()}
    for path, w in want.items():
        np.testing.assert_array_equal(got[path], w, err_msg=path)
    engine.close()  # what the worker process does once serve returns
    with pytest.raises(ConnectionError):
        trainer.recv()
    trainer.close()

    # A forged frame: the right op and a well-formed payload, tagged without the session key.
    trainer, engine = _pair(*(2 * [new_secret()]))
    thread = threading.Thread(target=lambda: done.__setitem__("worker", serve(engine, worker)))
    thread.start()
    forged = snapshot_payload(jax.tree.map(lambda x: 3 * x, params), 2).to_bytes()
    trainer.sock.sendall(struct.pack("<Q", len(forged) + 1) + OPS["sync"] + forged + b"\0" * 32)
    thread.join(timeout=30)
    assert not thread.is_alive() and worker.weights.version == 1 and worker.counts()["loaded"] == 2
    for chan in (trainer, engine):
        chan.close()
