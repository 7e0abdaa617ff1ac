"""The main job with vLLM rollouts stopped from outside (as tests/train/test_run_lifecycle.py does with our
worker engine): Ctrl-C checkpoints and stops the job and the vLLM process with it; a trainer killed outright does
not leave vLLM running. Skipped without .venv-vllm (`make venv-vllm`)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# `make venv-vllm` writes its stamp after `import vllm` worked there (importing vllm to ask takes 6 s per
# module and xdist worker)
if not (PYTHON.is_file() and (PYTHON.parents[1] / ".installed-vllm").is_file()):
    pytest.skip("vLLM is not installed: run `make venv-vllm`", allow_module_level=True)

# vLLM's CPU build rejects head_dim 16 (the tiny preset's): the tiny preset with head_dim 64.
CONFIG = {
    "model": {"preset": "tiny", "overrides": {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2,
                                              "num_heads": 2, "num_kv_heads": 1, "head_dim": 64, "max_seq_len": 32}},
    "task": {"kind": "arithmetic", "difficulty": 1, "operations": "+", "train_size": 64, "eval_size": 4,
             "prompt_style": "compact"},
    "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_new_tokens": 3, "engine": "vllm",
                "vllm_python": str(PYTHON), "vllm_dtype": "float32", "vllm_kv_cache_gib": 1, "vllm_max_seqs": 8},
    "optimizer": {"name": "logra", "rank": 4, "update_ratio": 1e-2},
    "train": {"steps": 200, "microbatches": 1, "mesh_fsdp": 1, "checkpoint_every": 100},
}


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path, int]:
    """The job in its own process group, up to its first RL steps; (process, workdir, vLLM's pid)."""
    config = tmp_path / "c.py"
    config.write_text(textwrap.dedent(f"""
        import ml_collections

        def get_config():
            return ml_collections.ConfigDict({CONFIG!r})
    """))
    workdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=os.environ["LOGRA_TEST_XLA_FLAGS"])
    proc = subprocess.Popen([sys.executable, "-m", "logra_jax.main", f"--config={config}", f"--workdir={workdir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while "held-out accuracy before RL" not in _read(workdir / "log.txt"):  # vLLM is up and has decoded
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the job never reached RL: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    engines = [pid for pid in _children(proc.pid) if b"logra_jax.rollout.vllm.server" in _cmdline(pid)]
    assert len(engines) == 1, engines
    return proc, workdir, engines[0]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _running(pid)


def test_ctrl_c_stops_the_job_and_vllm_with_a_checkpoint(tmp_path):
    """Ctrl-C reaches the whole process group: vLLM ignores it and keeps serving, the job stops at its next step
    boundary with a checkpoint and status 130, and closes vLLM on its way out."""
    proc, workdir, engine = _start(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "SIGINT" in err.strip().splitlines()[-1]
    for noise in ("Segmentation fault", "Fatal Python error", "KeyboardInterrupt", "Traceback", "WorkerError"):
        assert noise not in err
    stops = [line for line in _read(workdir / "log.txt").splitlines() if " stopped: " in line]
    assert "stopped: preempted" in stops[-1]
    assert [p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
    gone = _wait_gone(engine, 30)
    if not gone:
        os.kill(engine, signal.SIGKILL)
    assert gone, f"vLLM (pid {engine}) still running 30 s after the job stopped"


def test_a_killed_job_does_not_leave_vllm_running(tmp_path):
    """SIGKILL gives the job no chance to close vLLM: vLLM sees the connection drop and exits by itself."""
    proc, _, engine = _start(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    gone = _wait_gone(engine, 120)
    if not gone:
        os.kill(engine, signal.SIGKILL)
    assert gone, f"vLLM (pid {engine}) still running 120 s after its job was killed"
