"""The rollout pipeline (rollout.max_staleness ≥ 1) end to end on the tiny model: the engine generates ahead of the
trainer, each batch k versions behind the policy it trains, its staleness logged in versions and in predicted KL
(the sum of the controller's predicted KLs since its version), the run independent of the two sides' speeds, a
kill resumed bit for bit (the batches in flight saved with the checkpoint), and the KL budget enforced by
regenerating or clipping a batch over it."""

import math
import os
import signal
import time

import pytest

import logra_jax.job.pipeline as pipeline_mod
import logra_jax.job.train as train_mod
from logra_jax.job.run_config import RunConfig
from logra_jax.job.train import train_and_evaluate
from logra_jax.rollout.process import WorkerError

STEPS = 5


def _digit_fraction(response, problem):
    """Reward: the fraction of the 4 response characters that are digits (the policy learns to move it)."""
    del problem
    return sum(c.isdigit() for c in response) / 4


def _config(tiny_config, **rollout):
    return tiny_config(optimizer={"kl_control": True, "probe_responses": 2, "kl_budget": 1e-3},
                       rollout={"engine_devices": 1, **rollout}, train={"steps": STEPS, "checkpoint_every": 2})


def _steps(read_metrics, workdir):
    return [r for r in read_metrics(workdir) if "loss" in r]


class _Crash(RuntimeError):
    pass


@pytest.mark.slow
def test_an_engine_on_devices_of_its_own_reproduces_the_colocated_run(tmp_path, monkeypatch, tiny_config,
                                                                      read_metrics):
    """rollout.engine_devices = 2: the trainer on 2 of the 8 devices, the engine on the last 2, fed device to
    device by low-rank sync; synchronous (max_staleness 0), the run is the colocated engine's on the trainer's 2
    devices bit for bit (the engine's weights are what the trainer's round to: tests/rollout/test_device_engine.py)."""
    config = tiny_config(optimizer={"kl_control": True, "probe_responses": 2}, train={"steps": 3, "mesh_fsdp": 2})
    train_and_evaluate(config, tmp_path / "colocated", reward_fn=_digit_fraction)
    config["rollout"] = {**config["rollout"], "engine_devices": 2}
    real, placed = train_mod.rollout_engine, []

    def recorded(*args, **kwargs):
        placed.append(({d.id for d in args[3].devices.flat}, {d.id for d in kwargs["engine_devices"]}))
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "rollout_engine", recorded)
    train_and_evaluate(config, tmp_path / "own", reward_fn=_digit_fraction)
    assert placed == [({0, 1}, {6, 7})]  # the trainer's mesh, the engine's devices
    own = read_metrics(tmp_path / "own")
    assert own == read_metrics(tmp_path / "colocated")
    assert len(_steps(read_metrics, tmp_path / "own")) == 3


@pytest.mark.slow
def test_two_versions_behind_logged_timing_free_and_resumed_exactly(tmp_path, monkeypatch, tiny_config,
                                                                     read_metrics):
    """max_staleness = 2: versions behind 0, 1, 2, 2, ... and each batch's predicted stale KL the sum of the
    predicted KLs of the updates it missed (read back from the same run's metrics); a second run whose engine is
    slowed (0.3 s after each answer) and which is killed at step 4 (after the checkpoint of step 2, which holds the
    two batches in flight) resumes to the straight run's metrics bit for bit."""
    config = _config(tiny_config, max_staleness=2)
    train_and_evaluate(config, tmp_path / "straight", reward_fn=_digit_fraction)
    straight = _steps(read_metrics, tmp_path / "straight")
    assert [r["versions_behind"] for r in straight] == [0, 1, 2, 2, 2]
    predicted = [r["kl_predicted"] * (1 - r["kl_refused"]) for r in straight]
    for s, r in enumerate(straight):
        assert r["stale_kl_predicted"] == pytest.approx(sum(predicted[max(s - 2, 0):s]), rel=1e-6, abs=1e-12)
    assert all(r["stale_kl_predicted"] > 0 for r in straight[1:])
    assert straight[0]["behaviour_kl"] < min(r["behaviour_kl"] for r in straight[2:])  # staleness shows

    real_request, scored = pipeline_mod.RolloutPipeline.request, []

    def slow_request(self, *args, **kwargs):  # the engine's thread stalls 0.3 s after each answer
        batch = real_request(self, *args, **kwargs)
        batch.answer.add_done_callback(lambda _: time.sleep(0.3))
        return batch

    def crash_at_step_4(ctx, t, batch, reward_cfg):
        scored.append(batch.step)
        if batch.step == 3:
            raise _Crash("killed")
        return real_score(ctx, t, batch, reward_cfg)

    real_score = train_mod._score
    monkeypatch.setattr(pipeline_mod.RolloutPipeline, "request", slow_request)
    monkeypatch.setattr(train_mod, "_score", crash_at_step_4)
    with pytest.raises(_Crash):
        train_and_evaluate(config, tmp_path / "killed", reward_fn=_digit_fraction)
    monkeypatch.undo()
    train_and_evaluate(config, tmp_path / "killed", reward_fn=_digit_fraction)
    assert "resumed from checkpoint step 2" in (tmp_path / "killed" / "log.txt").read_text()
    assert read_metrics(tmp_path / "killed") == read_metrics(tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.parametrize("action", ["regenerate", "clip"])
def test_a_batch_over_the_kl_budget_is_regenerated_or_clipped(tmp_path, tiny_config, read_metrics, action):
    """max_stale_kl below any update's predicted KL: every stale batch is over it, so (regenerate) each is made
    again with the current policy (0 versions behind, the first step as the synchronous run's), or (clip) trained
    with its importance weights capped at stale_tis_cap."""
    config = _config(tiny_config, max_staleness=1, max_stale_kl=1e-12, stale_action=action, stale_tis_cap=0.5)
    train_and_evaluate(config, tmp_path, reward_fn=_digit_fraction)
    steps = _steps(read_metrics, tmp_path)
    assert all(math.isfinite(r["loss"]) for r in steps)
    over = [r["stale_kl_predicted"] > 1e-12 for r in steps]  # a step whose update moved nothing adds 0
    assert not over[0] and sum(over) >= 2, steps
    if action == "regenerate":
        assert [bool(r["regenerated"]) for r in steps] == over
        assert [r["versions_behind"] for r in steps] == [0 if o or s == 0 else 1 for s, o in enumerate(over)]
    else:
        assert [bool(r["stale_clipped"]) for r in steps] == over
        assert [r["versions_behind"] for r in steps] == [0] + [1] * (STEPS - 1)
        assert all(r["tis_weight"] <= 0.5 + 1e-6 for r, o in zip(steps, over) if o)
        assert steps[0]["tis_weight"] > 0.5


def test_pipeline_fields_are_validated_naming_them():
    with pytest.raises(ValueError, match=r"rollout\.max_staleness.*devices of its own"):
        RunConfig.from_dict({"rollout": {"max_staleness": 1}})
    with pytest.raises(ValueError, match=r"rollout\.max_stale_kl.*kl_control"):
        RunConfig.from_dict({"rollout": {"max_staleness": 1, "engine_devices": 1, "max_stale_kl": 0.1}})
    with pytest.raises(ValueError, match=r"rollout\.max_stale_kl.*max_staleness"):
        RunConfig.from_dict({"rollout": {"engine_devices": 1, "max_stale_kl": 0.1},
                             "optimizer": {"kl_control": True}})
    with pytest.raises(ValueError, match=r"rollout\.stale_action"):
        RunConfig.from_dict({"rollout": {"stale_action": "drop"}})
    with pytest.raises(ValueError, match=r"rollout\.engine_devices.*workers=0"):
        RunConfig.from_dict({"rollout": {"engine_devices": 2, "workers": 1}})
    with pytest.raises(ValueError, match=r"rollout\.engine_cpus.*workers=1"):
        RunConfig.from_dict({"rollout": {"engine_cpus": "0"}})


def _killing_engines(monkeypatch, kill_at, kill_publish_at=()):
    """train.rollout_engine whose engines' processes are killed (SIGKILL) just before the generate calls numbered
    in `kill_at` (counted over every engine of the run, the held-out evaluation's included), and before the
    publish calls numbered in `kill_publish_at` (one per RL step)."""
    real, calls = train_mod.rollout_engine, {"generate": 0, "publish": 0}

    def dying(engine, name, at):
        method = getattr(engine, name)

        def call_or_die(*a, **k):
            calls[name] += 1
            if calls[name] in at:
                os.kill(engine.transport.pid, signal.SIGKILL)
            return method(*a, **k)

        setattr(engine, name, call_or_die)

    def engine_that_dies(*args, **kwargs):
        engine = real(*args, **kwargs)
        dying(engine, "generate", kill_at)
        dying(engine, "publish", kill_publish_at)
        return engine

    monkeypatch.setattr(train_mod, "rollout_engine", engine_that_dies)


@pytest.mark.slow
def test_a_killed_engine_process_is_restarted_and_the_run_unchanged(tmp_path, monkeypatch, tiny_config,
                                                                     read_metrics):
    """The worker process killed while step 2 asks for its batch, and again while step 3's update is synced: each
    time the engine is restarted from the trainer's weights (the batch asked again; the update already in them),
    logged; the synchronous run's metrics are the uninterrupted run's."""
    config = tiny_config(rollout={"workers": 1}, train={"steps": 3})
    train_and_evaluate(config, tmp_path / "straight", reward_fn=_digit_fraction)
    _killing_engines(monkeypatch, kill_at={3}, kill_publish_at={3})  # generate 1: evaluation before RL, 2: step 1
    train_and_evaluate(config, tmp_path / "killed", reward_fn=_digit_fraction)
    log = (tmp_path / "killed" / "log.txt").read_text()
    assert "RL step 2: the rollout engine failed (rollout worker 'generate' request failed" in log
    assert "restart 1 of at most 3" in log and "1 batch(es) asked again" in log
    assert "RL step 3: the rollout engine failed (rollout worker 'sync' request failed" in log
    assert "restart 2 of at most 3" in log and "0 batch(es) asked again" in log
    killed = read_metrics(tmp_path / "killed")
    assert [r.pop("engine_restarts", None) for r in killed] == [None, 0, 1, 2, None]
    assert killed == [{k: v for k, v in r.items() if k != "engine_restarts"}
                      for r in read_metrics(tmp_path / "straight")]


@pytest.mark.slow
def test_an_engine_failing_past_its_restarts_stops_the_run_naming_it(tmp_path, monkeypatch, tiny_config):
    """Pipelined (one step off), the engine killed twice with rollout.engine_restarts = 1: the first failure is
    survived (the lost batch asked again of a new engine), the second stops the run naming the engine, the count
    and the engine's output."""
    config = tiny_config(rollout={"workers": 1, "max_staleness": 1, "engine_restarts": 1}, train={"steps": 4})
    _killing_engines(monkeypatch, kill_at={2, 5})
    with pytest.raises(WorkerError, match=r"(?s)failed 2 times \(config\.rollout\.engine_restarts = 1\).*"
                                          r"rollout worker 'generate' request failed"):
        train_and_evaluate(config, tmp_path, reward_fn=_digit_fraction)
    assert "restart 1 of at most 1" in (tmp_path / "log.txt").read_text()
