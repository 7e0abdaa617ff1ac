"""experiments/sweep.py's reuse of recorded results: a (variant, seed) whose configuration a committed results file
already holds is taken from it, not run again; any other difference in the configuration is a different run."""

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # as `python -m experiments...` has it; the sweep's worker processes inherit it
sweep = importlib.import_module("experiments.sweep")

ADAMW = {"sft": {"steps": 40, "cache_dir": "/old/checkout/sft_cache"},
         "optimizer": {"name": "adamw", "learning_rate": 1e-5}}


def _point(seed: int, after: float) -> dict:
    return {"seed": seed, "accuracy_before": 0.25, "accuracy_after": after, "gain": after - 0.25,
            "final_reward": 0.5, "step_time_median": 1.0, "peak_rss_bytes": 1, "step_bytes": -1, "seconds": 9.0,
            "kl_realised_median": None, "largest_drop": 0.0}


def _write(path: Path, name: str, overrides: dict, points: list[dict]) -> Path:
    path.write_text(json.dumps({"title": "", "seeds": [p["seed"] for p in points],
                                "variants": {name: {"overrides": overrides, "seeds": points, "mean_std": {}}}}))
    return path


def test_a_recorded_run_is_reused_whatever_its_name_or_cache_path(tmp_path):
    recorded = _write(tmp_path / "old.json", "adamw-targets", ADAMW, [_point(0, 0.5), _point(1, 0.75)])
    # the same configuration under another name, its keys in another order, its SFT cache elsewhere
    same = {"optimizer": {"learning_rate": 1e-5, "name": "adamw"}, "sft": {"cache_dir": "/here", "steps": 40}}
    logs = []
    results = sweep.run_sweep({}, {"adamw@learning_rate=1e-05": same}, [0, 1], tmp_path / "out", jobs=1,
                              step_memory=False, reuse=[tmp_path / "missing.json", recorded], log=logs.append)
    points = results["variants"]["adamw@learning_rate=1e-05"]["seeds"]
    assert [(p["seed"], p["accuracy_after"], p["recorded_in"]) for p in points] == [(0, 0.5, "old.json"),
                                                                                   (1, 0.75, "old.json")]
    assert "2 of 2 runs taken from recorded results" in logs[0]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["variants"]["adamw@learning_rate=1e-05"]


def test_a_different_setting_or_seed_is_not_the_recorded_run(tmp_path):
    recorded = sweep.recorded_points([_write(tmp_path / "old.json", "a", ADAMW, [_point(0, 0.5)])])
    key = sweep.same_run_key(ADAMW)
    assert (key, 0) in recorded and (key, 1) not in recorded
    other_lr = {**ADAMW, "optimizer": {"name": "adamw", "learning_rate": 3e-5}}
    other_sft = {**ADAMW, "sft": {"steps": 80, "cache_dir": "/old/checkout/sft_cache"}}
    assert sweep.same_run_key(other_lr) != key and sweep.same_run_key(other_sft) != key


def test_the_first_file_holding_a_run_wins(tmp_path):
    first = _write(tmp_path / "a.json", "x", ADAMW, [_point(0, 0.5)])
    second = _write(tmp_path / "b.json", "y", ADAMW, [_point(0, 0.9)])
    point = sweep.recorded_points([first, second])[(sweep.same_run_key(ADAMW), 0)]
    assert (point["accuracy_after"], point["recorded_in"]) == (0.5, "a.json")


def test_a_recorded_run_from_another_warm_start_is_refused(tmp_path):
    """Seed 0's new run (here: one already finished, read back as a sweep reads it) started from held-out 0.30
    after its warm start; the recorded run of seed 0 from 0.25: another warm start, so not comparable."""
    recorded = _write(tmp_path / "old.json", "adamw", ADAMW, [_point(0, 0.5)])
    other = {"optimizer": {"name": "adamw", "learning_rate": 3e-5}}
    done = sweep.run_dir(tmp_path / "out", "adamw-3e-5", 0)
    done.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({"accuracy_before": 0.30, "accuracy_after": 0.6, "seconds": 1.0}))
    (done / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1, "reward_mean": 0.5, "step_time": 1.0,
                                                    "eval_accuracy": 0.6}) + "\n")
    with pytest.raises(ValueError, match=r"adamw seed 0 recorded in old.json .* another warm start"):
        sweep.run_sweep({"train": {}}, {"adamw": ADAMW, "adamw-3e-5": other}, [0], tmp_path / "out", jobs=1,
                        step_memory=False, reuse=[recorded], log=lambda _: None)


def test_accuracy_after_reads_the_run_then_the_recorded_files(tmp_path):
    recorded = [_write(tmp_path / "old.json", "a", ADAMW, [_point(0, 0.5)])]
    out = tmp_path / "out"
    assert sweep.accuracy_after(out, "a", ADAMW, 0, recorded) == 0.5
    assert sweep.accuracy_after(out, "a", ADAMW, 1, recorded) is None
    assert sweep.accuracy_after(out, "a", ADAMW, 0) is None  # nothing recorded given, no run here
    sweep.run_dir(out, "a", 0).mkdir(parents=True)
    (sweep.run_dir(out, "a", 0) / "summary.json").write_text(json.dumps({"accuracy_after": 0.75}))
    assert sweep.accuracy_after(out, "a", ADAMW, 0, recorded) == 0.75  # the run here wins
