"""Faults beyond kills in a whole run (issue 63): a NaN or Inf in a step's rewards or gradients, a half-written
metrics line, a flipped bit in the newest checkpoint's data item, a checkpoint of another config.

One tiny 2-step run (checkpoints 1 and 2) is made once per session; each test copies it and resumes it with the
fault injected. The checkpoint-layer faults (a full disk, a flipped bit in every file of a checkpoint, leftovers
of interrupted saves) are tested on CheckpointManager in tests/ckpt/test_ckpt_faults.py.
"""

import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import logra_jax.job.train as train_mod
from logra_jax.job.metrics import NonFiniteMetricError
from logra_jax.job.train import train_and_evaluate

# one xdist worker for the module, so that the session fixture is built once (see test_run_lifecycle.py)
pytestmark = [pytest.mark.xdist_group("faults"), pytest.mark.slow]


@pytest.fixture(scope="session")
def healthy_run(tmp_path_factory, tiny_config):
    """A finished 2-step run with checkpoints 1 and 2, and its config."""
    workdir = tmp_path_factory.mktemp("healthy")
    config = tiny_config(train={"steps": 2, "checkpoint_every": 1})
    train_and_evaluate(config, workdir)
    return workdir, config


def resumable_copy(healthy_run, tmp_path, **train):
    """A copy of the healthy run without its summary (so that it resumes), and its config with `train` changed."""
    workdir, config = healthy_run
    shutil.copytree(workdir, tmp_path / "run")
    (tmp_path / "run" / "summary.json").unlink()
    config = json.loads(json.dumps(config))
    config["train"].update(train)
    return tmp_path / "run", config


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def stopped_line(workdir: Path) -> str:
    return [line for line in (workdir / "log.txt").read_text().splitlines() if " stopped: " in line][-1]


def _rewards_of(value):
    real = train_mod.score_responses

    def score(*args, **kwargs):
        rewards, stats = real(*args, **kwargs)
        return np.full_like(rewards, value), stats
    return "score_responses", score


def _advantages_of(value):
    real = train_mod._rl_batch

    def rl_batch(rollout, advantages, tis_cap=None):
        return real(rollout, np.full(np.shape(advantages), value, np.float32), tis_cap)
    return "_rl_batch", rl_batch


@pytest.mark.parametrize(("inject", "metric"), [(lambda: _rewards_of(np.inf), "reward_mean"),
                                                (lambda: _advantages_of(np.nan), "sketch_norm")],
                         ids=["inf-rewards", "nan-gradients"])
def test_a_non_finite_step_stops_the_run_naming_it_and_reaches_no_checkpoint(healthy_run, tmp_path, monkeypatch,
                                                                             inject, metric):
    """Step 3 (the first after resuming from checkpoint 2) meets +inf rewards (a scorer's bug: the task's reward
    functions are guarded and score such a value 0) or NaN gradients (NaN advantages): the run stops naming
    step 3 and the metric; checkpoint 2 stays the newest, byte for byte the healthy run's, its weights finite,
    and no metrics line of step 3 is written."""
    workdir, config = resumable_copy(healthy_run, tmp_path, steps=4)
    monkeypatch.setattr(train_mod, *inject())
    with pytest.raises(NonFiniteMetricError) as info:
        train_and_evaluate(config, workdir)
    assert info.value.step == 3 and metric in info.value.metrics
    if metric == "sketch_norm":
        assert "reward_mean" not in info.value.metrics  # the rewards were finite: the gradients are named
    assert stopped_line(workdir).endswith(f"stopped: {info.value}") and f"{metric}=" in stopped_line(workdir)
    checkpoints = workdir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["1", "2"]
    assert files_of(checkpoints / "2") == files_of(healthy_run[0] / "checkpoints" / "2")
    state = ocp.StandardCheckpointer().restore(checkpoints / "2" / "state")
    floats = [np.asarray(x) for x in jax.tree.leaves(state) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    assert floats and all(np.isfinite(x).all() for x in floats)
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2


def test_a_flipped_digit_in_the_newest_data_item_falls_back_naming_it_and_drops_a_half_metrics_line(
        healthy_run, tmp_path, read_metrics, caplog):
    """A run killed while writing its metrics line leaves it half-written, and a flipped bit in checkpoint 2's
    data-iterator state turns its position into another number (valid JSON). With train.resume_fallback the
    run sets checkpoint 2 aside, resumes from 1, names both in the log, and ends as the healthy run did."""
    workdir, config = resumable_copy(healthy_run, tmp_path, resume_fallback=True)
    data_file = workdir / "checkpoints" / "2" / "data" / "metadata"
    text = data_file.read_text()
    last_digit = max(i for i, c in enumerate(text) if c.isdigit())
    data_file.write_text(text[:last_digit] + chr(ord(text[last_digit]) ^ 1) + text[last_digit + 1:])
    with (workdir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_mean": 0.')
    with caplog.at_level(logging.WARNING, logger="logra_jax.job.metrics"):
        train_and_evaluate(config, workdir)
    log = (workdir / "log.txt").read_text()
    assert f"its data item ({data_file}) does not match the SHA-256 in its layout" in log
    assert "falling back to checkpoint 1" in log
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints_set_aside").iterdir()] == ["2"]
    dropped = f"{workdir / 'metrics.jsonl'}: dropped its unfinished last line"
    assert dropped in log or dropped in caplog.text  # log.txt once train.py passes its log to MetricsWriter
    assert read_metrics(workdir) == read_metrics(healthy_run[0])  # the same run, redone from step 1


@pytest.mark.xfail(strict=True, raises=pytest.fail.Exception,  # DID NOT RAISE: the run resumed
                   reason="the checkpoints do not record the config they were written with: train.py checks a "
                          "resume against config.json alone (see the issue 63 report)")
def test_a_checkpoint_of_another_config_is_refused_without_its_config_json(healthy_run, tmp_path):
    """Checkpoints moved into a workdir without their config.json (or beside another run's) are refused, in one
    line naming the field, when the run's fixed fields differ from theirs."""
    workdir, config = resumable_copy(healthy_run, tmp_path)
    (workdir / "config.json").unlink()
    config["optimizer"]["base_seed"] = 7  # other projections: the same shapes, so the restore itself succeeds
    with pytest.raises(ValueError, match=r"optimizer\.base_seed: 0 in the checkpointed run, 7 now"):
        train_and_evaluate(config, workdir)
