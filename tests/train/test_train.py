"""The main job end to end on the tiny model: every optimizer choice, kill-and-resume, and bad input."""

import itertools
import json
import math
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import logra_jax.job.train as train_mod
from logra_jax.job.checkpoint import CheckpointError
from logra_jax.job.run_config import RunConfig
from logra_jax.job.train import train_and_evaluate
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout.sync import flat_params


@pytest.mark.parametrize("optimizer", [
    {"name": "adamw", "learning_rate": 1e-3, "grad_clip": 1.0},
    {"name": "galore", "learning_rate": 1e-3, "rank": 4},
    {"name": "logra", "sketch_native": False, "kl_control": False},
    {"name": "logra", "sketch_native": True, "kl_control": True, "probe_responses": 2, "non_targets": "adamw"},
], ids=["adamw", "galore", "logra_dense_grad", "logra_sketch_native_kl"])
@pytest.mark.slow
def test_three_steps_end_to_end(tmp_path, optimizer, tiny_config, read_metrics):
    calls = []

    def flaky_reward(response, problem):
        calls.append(response)
        if len(calls) % 3 == 0:
            raise RuntimeError("reward service down")
        return 1.0 if response.strip() == f"#### {problem.answer}" else 0.0

    summary = train_and_evaluate(tiny_config(optimizer=optimizer, sft={"steps": 2, "batch_size": 4}), tmp_path,
                                 reward_fn=flaky_reward)
    rows = read_metrics(tmp_path)
    assert summary["steps"] == 3
    # held-out greedy accuracy on the 4 eval problems, before and after, as logged
    assert [r["eval_accuracy"] for r in rows if "eval_accuracy" in r] == [summary["accuracy_before"],
                                                                            summary["accuracy_after"]]
    assert 4 * summary["accuracy_after"] == round(4 * summary["accuracy_after"])
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert sum(r["reward_failures"] for r in steps) == len(calls) // 3 > 0  # raised, scored 0, counted
    assert all(r["sync_resyncs"] == 0 for r in steps)  # the rollout engine followed every update exactly
    if optimizer.get("kl_control"):
        assert all("kl_alpha" in r and "kl_realised" in r and "kl_predicted" in r for r in steps)
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    assert (tmp_path / "summary.json").exists() and list(tmp_path.rglob("events.out.tfevents*"))


@pytest.mark.slow
def test_sharded_run_with_reference_kl(tmp_path, monkeypatch, tiny_config, read_metrics):
    """A data=2 × fsdp=2 mesh with a reference-KL penalty: runs, stays finite, the engine stays in sync. The engine
    holds its weights per layer (`rollout.decode_layers`, the GPU layout; the other CPU runs hold them stacked)."""
    config = tiny_config(train={"steps": 2, "microbatches": 1, "mesh_data": 2, "mesh_fsdp": 2},
                         algorithm={"kl_beta": 0.05},
                         rollout={"prompts_per_step": 4, "num_samples": 4, "decode_layers": "per_layer"})
    layouts = []
    build = engine_lib.DecodeLayout.__init__

    def spy(self, *args, **kwargs):
        build(self, *args, **kwargs)
        layouts.append(self.config.decode_unroll)

    monkeypatch.setattr(engine_lib.DecodeLayout, "__init__", spy)
    train_and_evaluate(config, tmp_path, reward_fn=_digit_fraction)  # rewards that differ: the first step learns
    assert layouts == [True]
    steps = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert len(steps) == 2 and all(r["sync_resyncs"] == 0 for r in steps)
    assert all(math.isfinite(v) for r in steps for v in r.values())
    # k3 ≥ 0 per token; the reference is the initial policy, so the first step's KL is 0 and the second's is not
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[1]["kl"] > 1e-6


class _Interrupt(Exception):
    pass


@pytest.mark.slow
def test_kill_and_resume_is_bit_identical(tmp_path, monkeypatch, tiny_config, read_metrics):
    """Killed after the checkpoint at step 2 of 4 and run again: the resumed run's metrics and final checkpoint
    equal the uninterrupted run's. With an SFT warm start, a reference-KL penalty and the KL controller: the
    reference is the policy RL starts from (after SFT), and the resumed run must use that one, not the policy it
    restores, to reproduce the uninterrupted run's KL and losses."""
    config = tiny_config(optimizer={"kl_control": True, "probe_responses": 2}, algorithm={"kl_beta": 0.05},
                         sft={"steps": 3, "batch_size": 4, "train_size": 32},
                         train={"steps": 4, "checkpoint_every": 2, "microbatches": 2})
    train_and_evaluate(config, tmp_path / "straight", reward_fn=_digit_fraction)  # rewards that differ: it learns

    real = train_mod.score_responses
    calls = {"n": 0}

    def dies_after_step_two(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the third step's rewards: after the checkpoint at step 2
            raise _Interrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "score_responses", dies_after_step_two)
    with pytest.raises(_Interrupt):
        train_and_evaluate(config, tmp_path / "resumed", reward_fn=_digit_fraction)
    monkeypatch.setattr(train_mod, "score_responses", real)
    train_and_evaluate(config, tmp_path / "resumed", reward_fn=_digit_fraction)

    straight = read_metrics(tmp_path / "straight")
    assert sum("loss" in r for r in straight) == 4 and any(r.get("kl", 0) > 0 for r in straight)  # KL in play
    assert read_metrics(tmp_path / "resumed") == straight
    layouts = [json.loads((tmp_path / run / "checkpoints" / "4" / "layout" / "metadata").read_text())
               for run in ("straight", "resumed")]
    assert [leaf["fingerprint"] for leaf in layouts[0]["leaves"]] == [
        leaf["fingerprint"] for leaf in layouts[1]["leaves"]]

    # A corrupted checkpoint is an error naming it, never a silent restart.
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "resumed", broken)
    shutil.rmtree(broken / "checkpoints" / "2")
    for f in (broken / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "d" in f.parent.name:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises((CheckpointError, FileNotFoundError), match="checkpoints"):
        train_and_evaluate({**config, "train": {**config["train"], "steps": 6}}, broken)


@pytest.mark.parametrize(("section", "field", "value", "message"), [
    ("algorithm", "estimator", "ppo2", "config.algorithm.estimator = 'ppo2'"),
    ("optimizer", "rank", 0, "config.optimizer.rank = 0"),
    ("rollout", "temperature", -1.0, "config.rollout.temperature = -1.0"),
    ("train", "microbatches", 3, "config.train.microbatches = 3"),
    ("optimizer", "rnk", 4, "unknown field"),
])
def test_bad_config_is_a_clear_error(tmp_path, section, field, value, message, tiny_config, read_metrics):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        train_and_evaluate(tiny_config(**{section: {field: value}}), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_defaults_validate():
    run = RunConfig.from_dict({})
    assert run == RunConfig()
    opt = run.optimizer  # the paper's settings (docs/method.md §4, §5)
    assert (opt.name, opt.variant, opt.update_ratio, opt.b2, opt.eps) == ("logra", "paper", 6e-5, 0.95, 1e-8)
    assert (opt.kl_budget, opt.kl_budget_final, opt.kl_schedule_steps, opt.alpha_max) == (2e-4, 2e-5, 300, 3.0)
    assert opt.round_bf16 is None and run.algorithm.tis_cap == 2.0


def _digit_fraction(response, problem):
    """Reward: the fraction of the 4 response characters that are digits (≈ 0.1 for a random policy)."""
    del problem
    return sum(c.isdigit() for c in response) / 4


@pytest.mark.slow
def test_rl_raises_the_reward(tmp_path, tiny_config, read_metrics):
    """20 LoGRA steps (non-targets with AdamW) on a random-init model: the digit-fraction reward must rise.

    Measured (4 seeds, this config): mean reward of the first 5 steps 0.11-0.14, of the last 5 steps 0.94-1.0,
    a rise of 0.80-0.86 (spread 0.06); the margin 0.5 is far outside that seed noise. About 15 s here.
    """
    config = tiny_config(rollout={"prompts_per_step": 4, "num_samples": 4, "max_new_tokens": 4},
                         optimizer={"rank": 8, "update_ratio": 5e-2, "non_targets": "adamw", "learning_rate": 1e-2},
                         train={"steps": 20, "microbatches": 1, "seed": 1}, model={"init_seed": 1})
    train_and_evaluate(config, tmp_path, reward_fn=_digit_fraction)
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path) if "reward_mean" in r]
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first > 0.5, rewards


@pytest.mark.slow
def test_bf16_weights_train_and_a_worker_engine_follows_bit_for_bit(tmp_path, monkeypatch, tiny_config,
                                                                     read_metrics):
    """optimizer.weight_dtype=bfloat16: the trainer stores its matrices in bfloat16 (checkpointed so); each of three
    steps' stochastic merges moves every target matrix, and a rollout worker fed only the low-rank payloads
    (rollout.workers=1) holds the trainer's weights bit for bit after each (fetched back; never resynced), so the
    run reproduces the colocated engine's run (rollout.workers=0) for the same seed: same rollouts, rewards, losses
    and KL. (The float32 loop's worker == colocated: tests/sync/test_sync_worker.py.)"""
    config = tiny_config(optimizer={"weight_dtype": "bfloat16", "kl_control": True, "probe_responses": 2},
                         train={"steps": 3, "checkpoint_every": 3}, rollout={"workers": 0})
    train_and_evaluate(config, tmp_path / "colocated", reward_fn=_digit_fraction)
    config["rollout"] = {**config["rollout"], "workers": 1}
    colocated = [{k: v for k, v in r.items() if k != "sync_bytes"} for r in read_metrics(tmp_path / "colocated")]
    real, held = train_mod.rollout_engine, []  # per publication: (the trainer's weights, the worker's)
    host = lambda params: jax.device_get(flat_params(params))

    def fetched_after_every_publish(*args, **kwargs):
        engine = real(*args, **kwargs)
        held.append((host(args[4]), engine.transport.fetch()[1]))
        publish = engine.publish

        def publish_and_fetch(updates, params):
            report = publish(updates, params)
            held.append((host(params), engine.transport.fetch()[1]))
            return report

        engine.publish = publish_and_fetch
        return engine

    monkeypatch.setattr(train_mod, "rollout_engine", fetched_after_every_publish)
    worker_dir = tmp_path / "worker"
    train_and_evaluate(config, worker_dir, reward_fn=_digit_fraction)
    assert [{k: v for k, v in r.items() if k != "sync_bytes"} for r in read_metrics(worker_dir)] == colocated
    steps = [r for r in read_metrics(worker_dir) if "loss" in r]
    assert len(steps) == 3 and all(r["sync_resyncs"] == 0 and r["kl_refused"] == 0 and math.isfinite(r["loss"])
                                   for r in steps), steps
    assert len(held) == 4  # the bootstrap snapshot and three deltas
    for trainer, worker in held:
        assert trainer.keys() == worker.keys()
        for path, w in trainer.items():
            assert w.dtype == worker[path].dtype and w.tobytes() == worker[path].tobytes(), path
    targets = {p for p in held[0][0] if p.endswith("_proj.kernel")}
    assert targets and {str(held[0][0][p].dtype) for p in targets} == {"bfloat16"}
    for (before, _), (after, _) in itertools.pairwise(held):
        assert {p for p in before if np.any(before[p] != after[p])} == targets  # the merges, and nothing else
    meta = ocp.PyTreeCheckpointer().metadata(worker_dir / "checkpoints" / "3" / "state")
    meta = getattr(meta, "item_metadata", meta)
    dtypes = {leaf.name: str(leaf.dtype) for leaf in jax.tree.leaves(meta) if ".params." in f".{leaf.name}"}
    kernels = {p: d for p, d in dtypes.items() if p.endswith(("kernel.value", "embedding.value"))}
    norms = {p: d for p, d in dtypes.items() if p.endswith("scale.value")}
    assert kernels and set(kernels.values()) == {"bfloat16"}, dtypes
    assert norms and set(norms.values()) == {"float32"}, dtypes

