"""`optimizer.rank_rules` as a run configures it: validated at load and against the model's targets (the error
names the field, the rule and the target), and a sketch-native train step on the tiny MoE with experts at a
smaller rank than attention."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.core.tree_paths import path_str
from logra_jax.job.optimizer_plan import build_optimizer, check_optimizer_fits
from logra_jax.job.run_config import OptimizerSection, RunConfig
from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.optim import sketch_spec

EXPERTS = [f"blocks.mlp.{n}_proj.kernel" for n in ("gate", "up", "down")]


@pytest.mark.parametrize("fields, message", [
    ({"rank_rules": "mlp=0"}, "config.optimizer.rank_rules = 'mlp=0': RankRule 'mlp': rank must be a positive int"),
    ({"rank_rules": "mlp"}, "config.optimizer.rank_rules = 'mlp': rank rule 'mlp' is not 'pattern=rank'"),
    ({"rank_rules": "mlp=8, (=2"}, "config.optimizer.rank_rules = 'mlp=8, (=2': RankRule.pattern '(' is not a valid"),
    ({"rank_rules": "mlp=8", "name": "adamw"}, "config.optimizer.rank_rules = 'mlp=8': per-target ranks are LoGRA's"),
])
def test_rank_rules_are_validated_at_load(fields, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        RunConfig.from_dict({"optimizer": fields})
    assert RunConfig.from_dict({"optimizer": {"rank_rules": "mlp=8, attn=16"}}).optimizer.rank_rules == \
        "mlp=8, attn=16"


def test_rank_rules_are_checked_against_the_models_targets():
    model = init_model(preset("tiny-qwen3-moe", num_layers=1))  # attention k 64, experts' down_proj k 32
    with pytest.raises(ValueError, match=r"^config\.optimizer\.rank = 64: rank 64 exceeds the width k = 32 of target "
                                         r"'blocks\.mlp\.down_proj\.kernel'"):
        check_optimizer_fits(OptimizerSection(rank=64), model)
    check_optimizer_fits(OptimizerSection(rank=64, rank_rules="mlp=32"), model)
    with pytest.raises(ValueError, match=r"^config\.optimizer\.rank_rules = 'mlp=48': rank rule 'mlp=48': rank 48 "
                                         r"exceeds the width k = 32 of target 'blocks\.mlp\.down_proj\.kernel'"):
        check_optimizer_fits(OptimizerSection(rank=16, rank_rules="mlp=48"), model)
    with pytest.raises(ValueError, match=r"^config\.optimizer\.rank_rules = 'mlp=8, router=4': rank rule "
                                         r"'router=4' gives no target its rank"):
        check_optimizer_fits(OptimizerSection(rank=16, rank_rules="mlp=8, router=4"), model)


def test_sketch_native_step_on_the_tiny_moe_with_smaller_expert_ranks():
    model = init_model(preset("tiny-qwen3-moe", num_layers=1))
    plan = build_optimizer(OptimizerSection(rank=16, rank_rules="mlp=8", update_ratio=1e-3), model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = plan.tx.init(params)
    spec = sketch_spec(opt_state)
    assert {p: spec.rank_for(p) for p in plan.targets} == {p: 8 if p in EXPERTS else 16 for p in plan.targets}
    step = make_train_step(graphdef, next_token_loss, plan.tx, mode=plan.mode, trainable=plan.trainable)
    toks = jax.random.randint(jax.random.key(0), (4, 10), 1, 128)
    batch = {"tokens": toks, "attention_mask": jnp.ones_like(toks, bool), "loss_mask": jnp.ones_like(toks, bool)}
    new, _ = jax.jit(step)(TrainState(params, opt_state, jnp.zeros((), jnp.int32)), rest, batch)
    before = {path_str(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    after = {path_str(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(new.params)}
    for path in before:
        assert (not np.array_equal(before[path], after[path])) == (path in plan.targets), path
