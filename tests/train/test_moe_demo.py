"""The CPU demo's mixture-of-experts variant (configs/demo.py:moe): the dense demo's task and recipe on a Qwen3-MoE
decoder whose active MLP matches the dense demo's; and a 2-step `python -m logra_jax.main` run on the tiny MoE preset
that finishes (15 s on 2 cores; the demo-size variant's SFT and model make it ~3× longer, so the config tests cover
it and experiments/moe/learning.py runs it)."""

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from logra_jax.job.builders import build_model
from logra_jax.job.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.py"


def demo(arg):
    return runpy.run_path(str(DEMO))["get_config"](arg).to_dict()


@pytest.mark.parametrize(("moe", "dense"), [("moe", ""), ("moe,runlocal", "runlocal")])
def test_moe_variant_is_the_dense_demo_but_for_the_model(moe, dense):
    config, reference = demo(moe), demo(dense)
    assert {k: v for k, v in config.items() if k != "model"} == {k: v for k, v in reference.items() if k != "model"}
    run, dense_run = RunConfig.from_dict(config), RunConfig.from_dict(reference)
    shared = {k: v for k, v in dense_run.model.overrides.items()}
    assert {k: run.model.overrides[k] for k in shared} == shared  # same width, depth, attention, sequence length
    model_config = build_model(run.model)[0].config
    assert model_config.architecture == "qwen3_moe" and model_config.moe_layers() == (True,) * 4
    assert run.optimizer.rank <= model_config.expert_intermediate_size  # rank 64 fits every expert's down_proj


def test_moe_demo_activates_as_many_mlp_parameters_per_token_as_the_dense_demo():
    moe_run, dense_run = RunConfig.from_dict(demo("moe")), RunConfig.from_dict(demo(""))
    moe_model, _ = build_model(moe_run.model)
    dense_model, _ = build_model(dense_run.model)
    cfg = moe_model.config

    def mlp_kernels(model):
        leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
        return [x for path, x in leaves if "['mlp']" in (key := jax.tree_util.keystr(path)) and "_proj" in key]

    experts, dense = mlp_kernels(moe_model), mlp_kernels(dense_model)
    assert len(experts) == len(dense) == 3
    assert all(x.shape[:2] == (cfg.num_layers, cfg.num_experts) for x in experts)  # [layers, experts, in, out]
    expert_elements, dense_elements = sum(x.size for x in experts), sum(x.size for x in dense)
    assert expert_elements * cfg.experts_per_token == dense_elements * cfg.num_experts  # active = the dense MLP
    assert cfg.experts_per_token < cfg.num_experts  # and a token leaves the other experts idle


@pytest.mark.slow
def test_two_step_main_run_on_the_tiny_moe_preset_finishes(tmp_path, tiny_config):
    """`python -m logra_jax.main` end to end on tiny-qwen3-moe (LoGRA on every expert, sketch-native): 2 RL steps,
    no SFT (the shared tiny config), then the stop line and two finite losses."""
    config = tiny_config(model={"preset": "tiny-qwen3-moe", "overrides": {"max_seq_len": 16}},
                         optimizer={"sketch_native": True}, train={"steps": 2})
    path = tmp_path / "config.py"
    path.write_text(f"import ml_collections\n\n\ndef get_config():\n    return ml_collections.ConfigDict({config!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=os.environ["LOGRA_TEST_XLA_FLAGS"])
    workdir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "logra_jax.main", f"--config={path}", f"--workdir={workdir}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (workdir / "log.txt").read_text().strip().splitlines()[-1].endswith("stopped: finished 2 steps")
    steps = [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) for r in steps)
