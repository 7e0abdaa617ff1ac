"""experiments/vllm/rl.py's report: runs on disk and runs an earlier report recorded (whose folders are gone) are
both reported, and the paired vLLM − ours verdict covers the seeds where both engines finished."""

import json

import pytest

import experiments.vllm.rl as rl
from experiments.vllm.rl import report


def _run(workdir, accuracy, rewards, mismatch):
    workdir.mkdir(parents=True)
    steps = [{"step": i + 1, "loss": 0.1, "reward_mean": r, "rollout_mismatch": mismatch, "tis_weight": 1.0,
              "sync_bytes": 1.0, "sync_time": 0.1, "sync_resyncs": 0, "rollout_time": 2.0, "response_length": 4.0,
              "step_time": 3.0} for i, r in enumerate(rewards)]
    evals = [{"step": 0, "eval_accuracy": 0.25}, {"step": len(rewards), "eval_accuracy": accuracy}]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
    (workdir / "summary.json").write_text(json.dumps({"accuracy_before": 0.25, "accuracy_after": accuracy}))


def test_recorded_and_new_runs_are_paired_per_seed(tmp_path, monkeypatch):
    runs, out = tmp_path / "runs", tmp_path / "out"
    _run(runs / "jax-seed0", 0.5, [0.2] * 12, 1e-8)
    _run(runs / "vllm-seed0", 0.625, [0.3] * 12, 1e-6)
    with monkeypatch.context() as m:
        m.setattr(rl, "_plot", lambda runs, path: None)  # one plot is enough, below
        report(runs, out)  # seed 0 recorded in out/rl.json
    for name in ("jax-seed0", "vllm-seed0"):
        for f in (runs / name).iterdir():
            f.unlink()
        (runs / name).rmdir()
    _run(runs / "jax-seed1", 0.5, [0.1] * 12, 1e-8)
    _run(runs / "vllm-seed1", 0.5, [0.1] * 10 + [0.5, 0.5], 1e-6)
    _run(runs / "vllm-seed2", 0.75, [0.1] * 12, 1e-6)  # its pair has not run: reported, not paired
    record = report(runs, out)
    assert sorted(record["runs"]) == ["jax-seed0", "jax-seed1", "vllm-seed0", "vllm-seed1", "vllm-seed2"]
    diff = record["paired_vllm_minus_jax"]
    assert diff["seeds"] == [0, 1]
    assert diff["accuracy_after"]["per_seed"] == pytest.approx([0.125, 0.0])
    assert diff["final_reward"]["per_seed"] == pytest.approx([0.1, 0.08])  # last 10 steps: 2 of them at 0.5
    assert diff["accuracy_after"]["verdict"] == "level"  # t(1) interval of {0.125, 0}: −0.73 … +0.86
    text = (out / "rl.md").read_text()
    assert "Paired vLLM − ours over seeds 0, 1" in text and (out / "rl.png").stat().st_size > 0
