"""Every shipped config loads, validates, and names what a user must still provide."""

import runpy
from pathlib import Path

import pytest

from logra_jax.run_config import RunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name, arg=None):
    get_config = runpy.run_path(str(CONFIGS / name))["get_config"]
    return get_config() if arg is None else get_config(arg)


@pytest.mark.parametrize(("name", "arg"), [("demo.py", None), ("demo.py", "runlocal"),
                                           ("smollm2_arithmetic.py", None), ("smollm2_arithmetic.py", "runlocal")])
def test_config_validates(name, arg):
    run = RunConfig.from_dict(load(name, arg))
    assert run.train.steps >= 1


@pytest.mark.parametrize("arg", ["1.5b", "7b", "1.5b,runlocal"])
def test_paper_recipe_needs_a_checkpoint_and_data(arg):
    config = load("paper_qwen2.5_math.py", arg)
    with pytest.raises(ValueError, match=r"config\.model\.tokenizer"):
        RunConfig.from_dict(config)
    config.model.checkpoint = "/data/qwen"
    with pytest.raises(ValueError, match=r"config\.task\.jsonl_train"):
        RunConfig.from_dict(config)
    config.task.jsonl_train, config.task.jsonl_eval = "/data/train.jsonl", "/data/eval.jsonl"
    run = RunConfig.from_dict(config)
    assert (run.optimizer.rank, run.optimizer.update_ratio, run.algorithm.tis_cap) == (256, 6e-5, 2.0)
    assert (run.algorithm.estimator, run.rollout.num_samples, run.algorithm.reward_incorrect) == ("reinforce", 1, -0.01)
    with pytest.raises(ValueError, match="size must be"):
        load("paper_qwen2.5_math.py", "3b")
