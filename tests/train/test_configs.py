"""Every shipped config loads, validates, and names what a user must still provide."""

import runpy
from pathlib import Path

import pytest

from logra_jax.job.run_config import RunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name, arg=None):
    get_config = runpy.run_path(str(CONFIGS / name))["get_config"]
    return get_config() if arg is None else get_config(arg)


@pytest.mark.parametrize(("name", "arg"), [("demo.py", None), ("demo.py", "runlocal"),
                                           ("smollm2_arithmetic.py", None), ("smollm2_arithmetic.py", "runlocal")])
def test_config_validates(name, arg):
    run = RunConfig.from_dict(load(name, arg))
    assert run.train.steps >= 1


@pytest.mark.parametrize("arg", ["1.5b", "7b", "1.5b,runlocal", "27b", "qwen3-8b"])
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
    assert run.model.preset == {"27b": "gemma3-27b", "qwen3-8b": "qwen3-8b"}.get(arg, run.model.preset)
    with pytest.raises(ValueError, match="unknown variant '3b'"):
        load("paper_qwen2.5_math.py", "3b")


@pytest.mark.parametrize(("section", "field", "value", "match"), [
    ("task", "carries", "few", r"config\.task\.carries = 'few'"),
    ("task", "carries", "some", r"config\.task\.carries = 'some'.*operations"),  # with operations "+-"
    ("sft", "carries", "some", r"config\.sft\.carries = 'some'.*difficulty"),  # with difficulty 1
    ("sft", "task_examples", -1, r"config\.sft\.task_examples = -1"),
])
def test_carry_and_demonstration_fields_are_validated(section, field, value, match):
    config = load("demo.py")
    config.task.operations = "+-" if (section, value) == ("task", "some") else config.task.operations
    config.sft.difficulty = 1 if section == "sft" and field == "carries" else config.sft.difficulty
    config[section][field] = value
    with pytest.raises(ValueError, match=match):
        RunConfig.from_dict(config)


def test_the_engines_per_layer_layout_is_refused_for_the_trained_model():
    config = load("demo.py")
    config.model.overrides = {**config.model.overrides, "decode_unroll": True}
    with pytest.raises(ValueError, match=r"config\.model\.overrides = .*decode_unroll is the rollout engine's own"):
        RunConfig.from_dict(config)


def test_held_out_problems_are_never_trained_on(tmp_path):
    from logra_jax.job.builders import build_tasks

    # one-digit additions: 100 distinct questions, so draws with replacement collide with the held-out set
    config = load("demo.py")
    config.task.update(difficulty=1, carries="any", train_size=300, eval_size=40)
    config.sft.update(steps=1, difficulty=1, carries="any", train_size=300, task_examples=50)
    run = RunConfig.from_dict(config)
    tasks = build_tasks(run.task, run.sft, tmp_path)
    held_out = {p.question for p in tasks.eval_problems}
    assert len(tasks.eval_problems) == 40 and len(held_out) > 30
    assert not held_out & {p.question for p in tasks.train_problems}
    assert not held_out & {p.question for p in tasks.sft_problems}
    assert 100 < len(tasks.train_problems) < 300 and len(tasks.sft_problems) < 350
    batch = next(iter(tasks.train_batches(16, seed=0)))
    assert len(batch) == 16 and not held_out & {p.question for p in batch}
    # the demo's split: SFT without carries (plus a few RL-task examples), RL and evaluation with carries
    demo = RunConfig.from_dict(load("demo.py"))
    demo_tasks = build_tasks(demo.task, demo.sft, tmp_path / "demo")
    assert all("+" in p.question for p in demo_tasks.eval_problems)
    import re

    from logra_jax.rl.tasks import inner_carries

    def carried(problem):
        a, b = map(int, re.search(r"(\d+) \+ (\d+)", problem.question).groups())
        return inner_carries(a, b, 2) > 0

    assert all(carried(p) for p in demo_tasks.eval_problems + list(demo_tasks.train_problems))
    easy, task_like = demo_tasks.sft_problems[:1000], demo_tasks.sft_problems[-10:]
    assert not any(carried(p) for p in easy) and all(carried(p) for p in task_like)


@pytest.mark.parametrize(("variant", "round_bf16", "expected"), [
    ("paper", None, True), ("nemo", None, False), ("sgd", None, True), ("nemo", True, True), ("paper", False, False),
])
def test_round_bf16_defaults_to_the_variants_convention(variant, round_bf16, expected):
    import jax
    from flax import nnx

    from logra_jax.job.optimizer_plan import build_optimizer
    from logra_jax.models.config import preset
    from logra_jax.models.decoder import init_model
    from logra_jax.optim import sketch_spec

    run = RunConfig.from_dict({"optimizer": {"variant": variant, "round_bf16": round_bf16, "rank": 4}})
    assert run.optimizer.round_bf16 is round_bf16
    model = init_model(preset("tiny"))
    plan = build_optimizer(run.optimizer, model)
    # what the sketch-native step and the merge use: the optimizer's SketchSpec, read from its state
    assert sketch_spec(jax.eval_shape(plan.tx.init, nnx.state(model, nnx.Param))).round_bf16 is expected


def test_round_bf16_is_none_a_bool_or_a_clear_error(monkeypatch):
    from absl import flags
    from ml_collections import config_flags

    for extra, expected in (([], None), (["--config.optimizer.round_bf16=false"], False)):
        argv = ["main", f"--config={CONFIGS / 'demo.py'}", *extra]
        monkeypatch.setattr("sys.argv", argv)  # config_flags reads the overrides from sys.argv
        flag_values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", flag_values=flag_values)
        flag_values(argv)
        assert RunConfig.from_dict(flag_values.config).optimizer.round_bf16 is expected
    with pytest.raises(ValueError, match=r"config\.optimizer\.round_bf16 = 'yes': must be a bool"):
        RunConfig.from_dict({"optimizer": {"round_bf16": "yes"}})


@pytest.mark.slow
def test_token_weighted_whitening_reaches_the_loop(tmp_path, monkeypatch):
    """algorithm.whiten='token' gives reinforce++ the rollout's response lengths; elsewhere it is an error."""
    import logra_jax.rl.advantages as advantages
    from logra_jax.job.train import train_and_evaluate

    with pytest.raises(ValueError, match=r"config\.algorithm\.whiten = 'token'"):
        RunConfig.from_dict({"algorithm": {"whiten": "token"}})
    seen = []
    real = advantages.reinforce_pp_advantages

    def spy(rewards, **kwargs):
        seen.append((kwargs["whiten"], kwargs["lengths"]))
        return real(rewards, **kwargs)

    monkeypatch.setattr(advantages, "reinforce_pp_advantages", spy)
    config = {"model": {"preset": "tiny", "overrides": {"max_seq_len": 16}},
              "task": {"kind": "arithmetic", "difficulty": 1, "train_size": 64, "eval_size": 4,
                       "prompt_style": "compact"},
              "algorithm": {"estimator": "reinforce++", "whiten": "token"},
              "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_new_tokens": 3},
              "optimizer": {"name": "adamw"}, "train": {"steps": 1}}
    train_and_evaluate(config, tmp_path)
    (whiten, lengths), = seen
    assert whiten == "token" and lengths.shape == (4,) and int(lengths.min()) >= 1


@pytest.mark.parametrize("arg", ["30b-a3b", "30b-a3b,4chip", "30b-a3b,v5e8", "235b-a22b", "235b-a22b,h200"])
def test_moe_placements_keep_the_paper_recipe(arg):
    """The Qwen3-MoE placements change where bytes sit, never the recipe: LoGRA r = 256 (experts at 64 only where
    the config says so), the update ratio, TIS, KL control, batch and lengths of `:1.5b`."""
    base, config = load("paper_qwen2.5_math.py", "1.5b"), load("paper_qwen2.5_math.py", arg)
    for c in (base, config):
        c.model.checkpoint = "/data/model"
        c.task.jsonl_train, c.task.jsonl_eval = "/data/train.jsonl", "/data/eval.jsonl"
    run, ref = RunConfig.from_dict(config), RunConfig.from_dict(base)
    assert run.model.preset == ("qwen3-235b-a22b" if arg.startswith("235b") else "qwen3-30b-a3b")
    assert run.optimizer.rank_rules == ("mlp=64" if arg == "235b-a22b,h200" else "")
    for section, fields in {"optimizer": ("rank", "update_ratio", "kl_control", "kl_budget", "sketch_native"),
                            "algorithm": ("estimator", "tis_cap"),
                            "rollout": ("prompts_per_step", "num_samples", "max_new_tokens")}.items():
        for name in fields:
            assert getattr(getattr(run, section), name) == getattr(getattr(ref, section), name), (section, name)
    assert run.optimizer.weight_dtype == run.model.overrides["param_dtype"] == "bfloat16"


@pytest.mark.parametrize("arg", ["72b", "72b,4chip", "qwen3-32b", "7b,1gpu", "1.5b,1chip"])
def test_paper_placements_store_bf16_weights_from_the_start_and_one_response_per_device_per_microbatch(arg):
    config = load("paper_qwen2.5_math.py", arg)
    config.model.checkpoint = "/data/model"
    config.task.jsonl_train, config.task.jsonl_eval = "/data/train.jsonl", "/data/eval.jsonl"
    run = RunConfig.from_dict(config)
    devices = {"72b": 8, "72b,4chip": 4, "qwen3-32b": 8, "7b,1gpu": 1, "1.5b,1chip": 1}[arg]
    assert run.optimizer.weight_dtype == run.model.overrides["param_dtype"] == "bfloat16"
    rows_split = devices // (4 if arg == "72b,4chip" else 1)  # that placement is tensor-parallel: rows are not split
    assert run.train.microbatches * rows_split == run.rollout.prompts_per_step * run.rollout.num_samples
    assert run.model.overrides["remat"] == "full" and run.rollout.slots == 32
    # AdamW cannot store bfloat16 weights: setting float32 back moves the model's storage with it
    config.optimizer.update(name="adamw", weight_dtype="float32", sketch_native=False, kl_control=False)
    assert RunConfig.from_dict(config).model.overrides["param_dtype"] == "float32"
