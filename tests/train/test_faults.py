"""Faults beyond kills in a whole run (issue 63): a disk that fills during a save, a NaN or Inf in a step's rewards
or gradients, a half-written metrics line, a flipped bit in the newest checkpoint's data item, a checkpoint of
another config.

One tiny 2-step run (checkpoints 1 and 2) is made once per session; each test copies it and resumes it with the
fault injected. The checkpoint-layer faults (a full disk, a flipped bit in every file of a checkpoint, leftovers
of interrupted saves) are tested on CheckpointManager in tests/ckpt/test_ckpt_faults.py.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
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

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def healthy_run(finish_tiny_run):
    """A finished 2-step run with checkpoints 1 and 2, and its config."""
    return finish_tiny_run("healthy", steps=2, checkpoint_every=1)


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
    assert dropped in log
    assert read_metrics(workdir) == read_metrics(healthy_run[0])  # the same run, redone from step 1


def test_a_checkpoint_of_another_config_is_refused_without_its_config_json(healthy_run, tmp_path):
    """Checkpoints moved into a workdir without their config.json (or beside another run's) are refused, in one
    line naming the field, when the run's fixed fields differ from theirs."""
    workdir, config = resumable_copy(healthy_run, tmp_path)
    (workdir / "config.json").unlink()
    config["optimizer"]["base_seed"] = 7  # other projections: the same shapes, so the restore itself succeeds
    with pytest.raises(ValueError, match=r"optimizer\.base_seed: 42 in the checkpointed run, 7 now"):
        train_and_evaluate(config, workdir)


FILL_THE_DISK = """
import json, os, sys, time
import logra_jax.job.train as train
from logra_jax.job.train import train_and_evaluate

config, workdir, mount = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
filler = os.path.join(mount, "filler")
real, calls, out = train.score_responses, [0], {}

def score_then_fill_the_disk(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 2:  # RL step 2: once checkpoint 1 is committed, leave 64 kB: too little for checkpoint 2
        while not os.path.isdir(os.path.join(workdir, "checkpoints", "1")):
            time.sleep(0.05)
        disk = os.statvfs(mount)
        with open(filler, "wb") as f:
            f.write(bytes(disk.f_bavail * disk.f_frsize - 64 * 1024))
    return real(*args, **kwargs)

train.score_responses = score_then_fill_the_disk
try:
    train_and_evaluate(config, workdir)
except Exception as e:
    out["error"] = type(e).__name__ + ": " + str(e)
train.score_responses = real
os.remove(filler)  # space is back
out["summary"] = train_and_evaluate(config, workdir)  # the same command again
print("RESULT " + json.dumps(out))
"""


def test_a_disk_full_during_a_save_stops_the_run_and_the_same_command_resumes(healthy_run, tmp_path, read_metrics,
                                                                               tmpfs_refusal):
    """The run's workdir on a 4 MB tmpfs that a file fills at step 2, leaving 64 kB: saving checkpoint 2 fails with
    ENOSPC. The run stops naming the directory, the full disk and checkpoint 1 (intact); the log line saying so
    cannot raise in place of that error on the full disk. Once the file is gone, the same call removes the partial
    save and resumes from checkpoint 1 to the healthy run's metrics."""
    mount = tmp_path / "disk"
    mount.mkdir()
    reason = tmpfs_refusal(mount)
    if reason:
        pytest.skip(f"no small filesystem to fill: {reason}")
    workdir, config = mount / "run", healthy_run[1]
    driver = tmp_path / "driver.py"
    driver.write_text(FILL_THE_DISK)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["LOGRA_TEST_XLA_FLAGS"]}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=4m tmpfs {mount} && "
                           f"{sys.executable} {driver} '{json.dumps(config)}' {workdir} {mount} && "
                           f"cp -r {workdir} {tmp_path / 'after'}"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out, after = json.loads(lines[-1].removeprefix("RESULT ")), tmp_path / "after"
    ckpt = workdir / "checkpoints"
    assert out["error"].startswith(f"CheckpointError: saving checkpoint 2 in {ckpt} failed: the disk is full (No "
                                   f"space left on device); checkpoint 1 ({ckpt / '1'}) is intact. Free space"), out
    assert f"removed the partial checkpoint of an interrupted save: {ckpt / '2'}.orbax-checkpoint-tmp" in proc.stderr
    assert out["summary"]["steps"] == 2
    assert read_metrics(after) == read_metrics(healthy_run[0])
    log = (after / "log.txt").read_text()
    assert "resumed from checkpoint step 1" in log and log.rstrip().endswith("stopped: finished 2 steps")
