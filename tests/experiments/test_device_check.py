"""experiments/device/check.sh end to end with --smoke (CPU, tiny shapes): every step runs and reports.

What runs on the accelerator is this same script without --smoke, so a break in any step shows up here first.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_check_script_smoke_runs_every_step_and_prints_the_table(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", "experiments/device/check.sh", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-5000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["exit_status"] == {"lower": "0", "kernels": "0", "sync": "0", "train_step": "0"}
    assert report["lower"]["all_ok"] and len(report["lower"]["results"]) >= 14
    # the GPU kernels ran (interpreted) against their references: every one accurate, none errored
    kernels = report["kernels"]
    assert {k["kernel"] for k in kernels} == {"project_fwd", "project_bwd", "merge", "row_moment_paper",
                                              "row_moment_nemo"}
    assert all(k["accurate"] and k["error_text"] is None for k in kernels), kernels
    assert report["sync"]["bitwise_equal"] is True
    assert set(report["step"]["contenders"]) == {"adamw", "adamw_targets", "logra_sketch_native_kl",
                                                 "logra_sketch_native_kl_pallas"}
    assert all(c.get("median_step_s") for c in report["step"]["contenders"].values())
    # the table is the last thing printed, and the files fit what the device tool brings back (≤ 8)
    assert "train step" in proc.stdout and "LoGRA peak vs adamw" in proc.stdout
    assert len(list(tmp_path.iterdir())) <= 8, sorted(p.name for p in tmp_path.iterdir())
