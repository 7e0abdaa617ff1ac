"""Process identity and the rendezvous: a missing peer is a clear error within the timeout, not a hang or abort;
identities come from flags, the environment or cluster detection (the main job across processes:
test_multihost_main.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from logra_jax.parallel import multihost
from logra_jax.parallel.multihost import DistributedConfig, DistributedInitError, rendezvous

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(process_id: int, num_processes: int, port: int, workdir: Path, timeout_s: int) -> subprocess.Popen:
    """The main job as one process of a run, its identity given by flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["LOGRA_DISTRIBUTED_TIMEOUT_S"] = str(timeout_s)
    return subprocess.Popen([sys.executable, "-m", "logra_jax.main", "--config=configs/demo.py:runlocal",
                             f"--workdir={workdir}", f"--coordinator_address=127.0.0.1:{port}",
                             f"--num_processes={num_processes}", f"--process_id={process_id}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"worker hung (killed after {timeout_s} s):\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.slow
def test_missing_peer_is_a_clear_error(tmp_path):
    # Process 0 of 2 alone, and process 1 of 2 with no coordinator: both must fail fast and say why.
    alone = _spawn(0, 2, _free_port(), tmp_path / "a", 3)
    orphan = _spawn(1, 2, _free_port(), tmp_path / "b", 3)
    (rc0, log0), (rc1, log1) = _finish(alone, 90), _finish(orphan, 90)
    assert rc0 == 1 and "DistributedInitError" in log0 and "process(es) [1] of 2 did not reach" in log0, log0
    assert rc1 == 1 and "DistributedInitError" in log1 and "no coordinator (process 0)" in log1, log1


def test_rendezvous_rejects_mismatched_process_counts():
    port = _free_port()
    peer = subprocess.Popen([sys.executable, "-c", (
        "from logra_jax.parallel.multihost import DistributedConfig, rendezvous\n"
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


def test_identity_from_flags_then_environment_then_cluster_detection():
    env = {"JAX_COORDINATOR_ADDRESS": "node0:8476", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    # flags win over the environment
    assert multihost.resolve("10.0.0.1:1234", 2, 1, env=env) == DistributedConfig("10.0.0.1:1234", 2, 1)
    assert multihost.resolve(env=env) == DistributedConfig("node0:8476", 4, 3)
    assert multihost.resolve(env={**env, "LOGRA_HEARTBEAT_TIMEOUT_S": "20"}).heartbeat_timeout_s == 20
    with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive integer"):
        DistributedConfig("node0:8476", 4, 3, heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match="missing: --num_processes, --process_id"):
        multihost.resolve("10.0.0.1:1234", env=env)
    # nothing set and no cluster environment here: a single-process run
    assert multihost.resolve(env={}) is None and multihost.detect_cluster() is None


def test_slurm_environment_is_detected(monkeypatch):
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[3-4]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    config = multihost.detect_cluster(timeout_s=30)
    assert config is not None and (config.num_processes, config.process_id) == (2, 1)
    assert config.host == "node3" and config.timeout_s == 30


def test_single_process_helpers_need_no_runtime():
    assert multihost.is_primary()
    multihost.barrier("nothing to wait for")
    with multihost.primary_first("alone"):
        pass
    np.testing.assert_array_equal(multihost.gather(np.float64(0.1)), [0.1])  # [processes, *shape]
    assert multihost.gather(np.arange(3, dtype=np.int64)).shape == (1, 3)
    multihost.announce_failure("no peers to tell")  # no-ops without jax.distributed
    multihost.watch_failures(lambda text: None)
    multihost.stop_watching()
