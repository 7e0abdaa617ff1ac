"""experiments/device/step_check.py and sync_check.py: their failure paths (their smoke runs are checked in
test_device_check.py, through check.sh, which runs them).

The accelerator runs these same scripts once, unattended, without --smoke: every contender must report, a
failing or timed-out one must be recorded while the others run, and a kill must leave the JSON behind.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
STEP = ROOT / "experiments" / "device" / "step_check.py"
SYNC = ROOT / "experiments" / "device" / "sync_check.py"


def _env() -> dict[str, str]:
    """CPU, one device (as on the GPU machine), the repository importable."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def _run(script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_step_check_records_a_timed_out_contender_and_runs_the_next(tmp_path):
    out = tmp_path / "step.json"
    proc = _run(STEP, "--smoke", "--out", str(out), "--timeout", "1", "--contenders", "adamw", "adamw_targets",
                timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["finished"] and list(report["contenders"]) == ["adamw", "adamw_targets"]
    for c in report["contenders"].values():
        assert c["status"] == "timeout" and c["error"].startswith("timed out after 1 s"), c
        assert c.get("median_step_s") is None
    assert "timeout" in proc.stdout


def test_step_check_on_sigterm_stops_the_contender_and_writes_the_report(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.Popen([sys.executable, str(STEP), "--smoke", "--out", str(out)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the first contender's process is running
            if out.exists() and json.loads(out.read_text())["contenders"]:
                break
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["interrupted"] == f"signal {int(signal.SIGTERM)}" and not report["finished"]
    (name, c), = report["contenders"].items()
    assert name == "logra_sketch_native_kl" and c["status"] == "interrupted", c
    assert "interrupted by signal" in c["error"] and "train step tiny" in stdout


def test_sync_check_crash_writes_the_error_and_exits_nonzero(tmp_path):
    out = tmp_path / "sync.json"
    proc = _run(SYNC, "--model", "no-such-model", "--out", str(out), timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "no-such-model" in report["error"] and report["phase"] == "build" and report["bitwise_equal"] is None
    assert report["verdict"].startswith("CRASHED") and "[sync_check] CRASHED" in proc.stdout


def test_bitwise_compare_reports_count_and_largest_difference():
    spec = importlib.util.spec_from_file_location("sync_check", SYNC)
    sync_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync_check)
    a = {"w": np.array([1.0, np.nan, -0.0], np.float32), "b": np.ones((2, 2), np.float32),
         "c": np.zeros(3, np.float32)}
    same = sync_check.bitwise_compare(a, {k: v.copy() for k, v in a.items()})
    assert same["n_differing"] == 0 and same["max_abs_diff"] == 0.0 and not same["missing"]  # NaN == NaN bitwise
    other = {"w": np.array([1.0, np.nan, 0.0], np.float32),  # -0.0 vs 0.0: equal as floats, not bitwise
             "b": np.ones((2, 2), np.float32) + np.float32(0.5), "d": np.zeros(3, np.float32)}
    got = sync_check.bitwise_compare(a, other)
    assert got["n_differing"] == 2 and set(got["differing"]) == {"w", "b"}
    assert got["max_abs_diff"] == 0.5 and got["missing"] == ["c", "d"]


def test_vllm_script_without_vllm_records_why_it_skipped(tmp_path):
    """experiments/device/vllm.sh on a machine whose Python holds no vLLM (the lent image): a record saying so,
    exit 0; an unknown argument is refused before anything runs."""
    env = {**_env(), "PYTHON": sys.executable, "VLLM_PYTHON": "false"}
    proc = subprocess.run(["bash", "experiments/device/vllm.sh", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "vllm.json").read_text())["skipped"].startswith("missing vLLM")
    proc = subprocess.run(["bash", "experiments/device/vllm.sh", "--stpes", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument --stpes" in proc.stderr
