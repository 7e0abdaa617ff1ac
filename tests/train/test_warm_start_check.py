"""The SFT warm start cannot fail silently: its final loss is recorded (summary.json, checkpoints, a resumed run's
summary) and a loss above `sft.max_final_loss` stops the run before RL, naming the seed and the loss."""

import json

import numpy as np
import pytest

from logra_jax.job.builders import build_model, build_tasks
from logra_jax.job.run_config import RunConfig, SFTSection
from logra_jax.job.sft import WarmStartError, check_warm_start, final_window, supervised_warm_start
from logra_jax.job.train import train_and_evaluate
from logra_jax.rl.prompts import PromptFormat, max_prompt_length


def test_check_warm_start_names_the_seed_and_the_loss():
    cfg = SFTSection(steps=1000, max_final_loss=0.2)
    assert check_warm_start({"sft_loss": 0.9, "sft_final_loss": 0.15}, cfg, seed=4) == 0.15
    with pytest.raises(WarmStartError, match=r"seed 4 \(config\.train\.seed\) ended at loss 0\.5870 \(mean of its "
                                             r"last 50 of 1000 steps\), above config\.sft\.max_final_loss = 0\.2"):
        check_warm_start({"sft_loss": 0.01, "sft_final_loss": 0.587}, cfg, seed=4)
    with pytest.raises(WarmStartError, match="ended at loss nan"):
        check_warm_start({"sft_loss": 0.01, "sft_final_loss": float("nan")}, cfg, seed=0)
    # 0 = not checked; a cache file without the final loss is judged by its last step's
    assert check_warm_start({"sft_loss": 3.0, "sft_final_loss": 3.0}, SFTSection(steps=10), seed=0) == 3.0
    with pytest.raises(WarmStartError, match=r"ended at loss 0\.3000"):
        check_warm_start({"sft_loss": 0.3}, cfg, seed=1)


@pytest.mark.parametrize("value", [-0.1, float("inf")])
def test_max_final_loss_is_validated(value):
    with pytest.raises(ValueError, match=rf"config\.sft\.max_final_loss = {value}"):
        SFTSection(max_final_loss=value).validate()


def test_final_loss_is_the_mean_of_the_last_steps(tmp_path, tiny_config):
    run = RunConfig.from_dict(tiny_config(sft={"steps": 60, "batch_size": 4}))
    model, tokenizer = build_model(run.model)
    fmt = PromptFormat(run.task.prompt_style)
    tasks = build_tasks(run.task, run.sft, tmp_path)
    length = max_prompt_length([*tasks.eval_problems, *tasks.sft_problems], tokenizer, fmt) + 3
    losses = []
    metrics = supervised_warm_start(model, tokenizer, fmt, tasks.sft_problems, run.sft, length, seed=2,
                                    on_step=lambda i, m: losses.append(m["sft_loss"]))
    assert final_window(60) == 3 and len(losses) == 60
    np.testing.assert_allclose(metrics["sft_final_loss"], np.mean(losses[-3:]), rtol=1e-12)
    assert metrics["sft_loss"] == losses[-1]


def test_a_warm_start_above_max_final_loss_stops_the_run_before_rl(tmp_path, tiny_config):
    config = tiny_config(sft={"steps": 3, "batch_size": 4, "max_final_loss": 1e-4}, train={"seed": 7})
    with pytest.raises(WarmStartError, match=r"seed 7 \(config\.train\.seed\) ended at loss \d+\.\d{4} \(mean of "
                                             r"its last 1 of 3 steps\), above config\.sft\.max_final_loss = 0\.0001"):
        train_and_evaluate(config, tmp_path)
    log = (tmp_path / "log.txt").read_text()
    assert "stopped: error: WarmStartError: the SFT warm start of seed 7" in log.splitlines()[-1]
    assert "held-out accuracy before RL" not in log and not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_the_record_reaches_the_summary_and_a_resumed_run_through_the_checkpoint(tmp_path, tiny_config):
    config = tiny_config(sft={"steps": 3, "batch_size": 4, "max_final_loss": 100.0},
                         train={"steps": 1, "checkpoint_every": 1})
    first = train_and_evaluate(config, tmp_path)
    record = first["sft"]
    assert record["steps"] == 3 and record["cached"] is False
    assert record["final_loss"] == record["last_loss"] > 0  # a window of 1 step
    assert f"SFT done: final loss {record['final_loss']:.4f}" in (tmp_path / "log.txt").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["sft"] == record
    config["train"]["steps"] = 2  # resumed without the KL penalty: the warm start is not repeated
    resumed = train_and_evaluate(config, tmp_path)
    assert resumed["steps"] == 2 and resumed["sft"] == record
    assert (tmp_path / "log.txt").read_text().count("SFT warm start:") == 1
