"""Two local processes (jax.distributed over 127.0.0.1, gloo) run one sharded train step on a global 8-device
mesh and match the single-process step; a missing peer is a clear error within the timeout, not a hang or abort."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from logra_jax.multihost import DistributedConfig, DistributedInitError, rendezvous
from logra_jax.sharding import FAST_CPU_COMPILE

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(process_id: int, num_processes: int, port: int, out: Path, timeout_s: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.Popen([sys.executable, str(WORKER), str(process_id), str(num_processes), str(port), str(out),
                             str(timeout_s)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"worker hung (killed after {timeout_s} s):\n{out[-3000:]}")
    return proc.returncode, out


def _load_worker():
    spec = importlib.util.spec_from_file_location("multihost_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_processes_match_single_process(tmp_path):
    port, out = _free_port(), tmp_path / "result.npz"
    procs = [_spawn(pid, 2, port, out, 60) for pid in (0, 1)]
    results = [_finish(p, 180) for p in procs]
    for rc, log in results:
        assert rc == 0, log[-3000:]
    got = np.load(out)
    assert int(got["devices"]) == 8 and int(got["processes"]) == 2

    worker = _load_worker()
    init_fn, step_fn, batch = worker.make_problem()
    with jax.default_device(jax.devices()[0]):
        state, rest = jax.jit(init_fn, compiler_options=FAST_CPU_COMPILE)()
        state, metrics = jax.jit(step_fn, compiler_options=FAST_CPU_COMPILE)(state, rest, batch)
    np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=1e-5)
    for i, ref in enumerate(jax.tree.leaves(state.params)):
        np.testing.assert_allclose(got[f"p{i}"], ref, rtol=1e-5, atol=1e-6)


def test_missing_peer_is_a_clear_error(tmp_path):
    # Process 0 of 2 alone, and process 1 of 2 with no coordinator: both must fail fast and say why.
    alone = _spawn(0, 2, _free_port(), tmp_path / "a.npz", 3)
    orphan = _spawn(1, 2, _free_port(), tmp_path / "b.npz", 3)
    (rc0, log0), (rc1, log1) = _finish(alone, 90), _finish(orphan, 90)
    assert rc0 == 1 and "DistributedInitError" in log0 and "process(es) [1] of 2 did not reach" in log0, log0
    assert rc1 == 1 and "DistributedInitError" in log1 and "no coordinator (process 0)" in log1, log1


def test_rendezvous_rejects_mismatched_process_counts():
    port = _free_port()
    peer = subprocess.Popen([sys.executable, "-c", (
        "from logra_jax.multihost import DistributedConfig, rendezvous\n"
        f"rendezvous(DistributedConfig('127.0.0.1:{port}', num_processes=3, process_id=1, timeout_s=20))")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with pytest.raises(DistributedInitError, match="announced num_processes=3"):
        rendezvous(DistributedConfig(f"127.0.0.1:{port}", num_processes=2, process_id=0, timeout_s=20))
    rc, log = _finish(peer, 60)
    assert rc == 1 and "did not release the rendezvous" in log, log


@pytest.mark.parametrize("env, message", [
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID"),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "host:port"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "process_id"),
])
def test_config_from_env_validates(env, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig.from_env(env)


def test_config_from_env():
    assert DistributedConfig.from_env({}) is None
    config = DistributedConfig.from_env({"JAX_COORDINATOR_ADDRESS": "node0:8476", "JAX_NUM_PROCESSES": "4",
                                         "JAX_PROCESS_ID": "3", "JAX_LOCAL_DEVICE_IDS": "0,1",
                                         "LOGRA_DISTRIBUTED_TIMEOUT_S": "30"})
    assert config == DistributedConfig("node0:8476", 4, 3, (0, 1), 30)
    assert (config.host, config.port) == ("node0", 8476)
