"""experiments/device/check.sh end to end with --smoke (CPU, tiny shapes): every step runs and reports.

What runs on the accelerator is this same script without --smoke, so a break in any step shows up here first.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_check_script_names_an_unknown_argument(tmp_path):
    proc = subprocess.run(["bash", "experiments/device/check.sh", "--smoek", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument --smoek" in proc.stderr
    assert not (tmp_path / "log.txt").exists()  # refused before anything ran


@pytest.mark.slow
def test_check_script_smoke_runs_every_step_and_prints_the_table(tmp_path, tmp_path_factory):
    wheels = tmp_path_factory.mktemp("wheels")  # a carried wheel that --smoke (without --wheels) must not install
    (wheels / "broken-0.0-py3-none-any.whl").write_bytes(b"not a wheel")
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS_DIR": str(wheels)}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", "experiments/device/check.sh", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-5000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["exit_status"] == {"lower": "0", "kernels": "0", "sync": "0", "train_step": "0"}
    assert "carried wheels" not in log  # --smoke installs wheels only when --wheels asks (rehearse.sh)
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
    _check_step_report(json.loads((tmp_path / "step.json").read_text()), log)
    _check_sync_report(json.loads((tmp_path / "sync.json").read_text()), log)
    # the table is the last thing printed, and the files fit what the device tool brings back (≤ 8)
    assert "train step" in proc.stdout and "LoGRA peak vs adamw" in proc.stdout
    assert len(list(tmp_path.iterdir())) <= 8, sorted(p.name for p in tmp_path.iterdir())


def _check_step_report(report: dict, log: str) -> None:
    """step_check.py --smoke (as check.sh runs it): every contender measured, the ratios and targets reported."""
    assert report["finished"] and report["interrupted"] is None and report["smoke"]
    for name, c in report["contenders"].items():
        assert c["status"] == "ok" and "error" not in c, (name, c)
        assert math.isfinite(c["median_step_s"]) and c["median_step_s"] > 0, (name, c)
        assert len(c["step_s"]) == report["steps"] and c["compile_first_step_s"] > 0
        assert c["compiled_bytes"]["total"] > 0 and c["loss_finite"]
        assert c["peak_bytes_in_use"] is None  # no memory_stats() on CPU: reported as missing, not as 0
        # progress per contender in the log
        assert f"{name}: start" in log and f"{name}: ok after" in log
    # like for like: LoGRA holds less optimizer state than AdamW on the same targets
    c = report["contenders"]
    assert c["logra_sketch_native_kl"]["opt_state_bytes"] < c["adamw_targets"]["opt_state_bytes"]
    ratios = report["ratios"]
    assert all(math.isfinite(ratios[k]) for k in ("logra_time_vs_adamw", "logra_time_vs_adamw_targets",
                                                  "logra_compiled_vs_adamw"))
    assert ratios["logra_peak_vs_adamw"] is None
    assert report["targets"]["logra_peak_vs_adamw"] == {"limit": 0.5, "value": None, "pass": None}
    assert report["targets"]["logra_time_vs_adamw"]["limit"] == 0.8
    assert "LoGRA / adamw " in log and "target logra time vs adamw <= 0.8" in log


def _check_sync_report(report: dict, log: str) -> None:
    """sync_check.py --smoke: five low-rank updates, the engine's weights bitwise equal to the trainer's."""
    assert report["bitwise_equal"] is True and report["passed"] is True, report["verdict"]
    assert report["statuses"] == ["applied"] * 5 and report["resyncs"] == 0 and report["lowrank_only"]
    assert report["engine_version"] == report["trainer_version"] == 5
    assert report["n_differing"] == 0 and report["max_abs_diff"] == 0.0
    assert report["leaves_changed"] == report["targets"] > 0  # the targets moved, frozen weights did not
    assert all(u["low_rank_leaves"] == report["targets"] and u["factor_abs_max"] > 0 for u in report["updates"])
    assert "[sync_check] PASS: bitwise equal" in log
