"""The like-for-like contenders as the loop builds them: AdamW on exactly LoGRA's targets, and dense RowAdam."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.core.tree_paths import path_str
from logra_jax.job.optimizer_plan import build_optimizer
from logra_jax.job.run_config import OptimizerSection, RunConfig
from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.optim.targets import DEFAULT_TARGET_RULES, find_targets


def _one_step(section):
    model = init_model(preset("tiny"))
    plan = build_optimizer(section, model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = make_train_step(graphdef, next_token_loss, plan.tx, mode=plan.mode, trainable=plan.trainable)
    toks = jax.random.randint(jax.random.key(0), (4, 10), 1, 128)
    batch = {"tokens": toks, "attention_mask": jnp.ones_like(toks, bool), "loss_mask": jnp.ones_like(toks, bool)}
    new, _ = jax.jit(step)(TrainState(params, plan.tx.init(params), jnp.zeros((), jnp.int32)), rest, batch)
    before = {path_str(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    after = {path_str(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(new.params)}
    targets = find_targets(params, DEFAULT_TARGET_RULES)
    return before, after, targets


@pytest.mark.parametrize("section", [OptimizerSection(name="adamw", targets_only=True, learning_rate=1e-3),
                                     OptimizerSection(name="row_adam", update_ratio=1e-2)],
                         ids=["adamw_targets_only", "row_adam"])
def test_contender_trains_exactly_the_targets(section):
    before, after, targets = _one_step(section)
    assert len(targets) == 7
    for path in before:
        moved = not np.array_equal(before[path], after[path])
        assert moved == (path in targets), path
    if section.name == "row_adam":  # the whole step has norm update_ratio relative to the targets' weights
        delta = np.sqrt(sum(np.sum((after[p] - before[p]) ** 2) for p in targets))
        norm = np.sqrt(sum(np.sum(before[p] ** 2) for p in targets))
        assert abs(delta / norm / 1e-2 - 1) < 1e-4


def test_targets_only_is_an_adamw_option():
    with pytest.raises(ValueError, match=r"config\.optimizer\.targets_only = True"):
        RunConfig.from_dict({"optimizer": {"name": "logra", "targets_only": True}})


def test_adam_b1_zero_drops_adamws_first_moment():
    """optimizer.adam_b1 = 0: the second update is g₂ / (sqrt(v̂₂) + ε) alone (numpy reference), not a momentum."""
    model = init_model(preset("tiny"))
    lr = 1e-3
    tx = build_optimizer(OptimizerSection(name="adamw", learning_rate=lr, adam_b1=0.0), model).tx
    params = nnx.state(model, nnx.Param)
    g1, g2 = (jax.tree.map(lambda p, k=k: jax.random.normal(jax.random.key(k), p.shape), params) for k in (1, 2))
    state = tx.init(params)
    _, state = tx.update(g1, state, params)
    u2, _ = tx.update(g2, state, params)
    for a, b, u in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), jax.tree.leaves(u2), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        v2 = 0.999 * 0.001 * a**2 + 0.001 * b**2
        np.testing.assert_allclose(np.asarray(u), -lr * b / (np.sqrt(v2 / (1 - 0.999**2)) + 1e-8), rtol=2e-5,
                                   atol=1e-9)
    for field in ("adam_b1", "b2"):  # both must be < 1 (the shared range check, open at the top)
        with pytest.raises(ValueError, match=rf"config\.optimizer\.{field} = 1\.0: must be < 1"):
            RunConfig.from_dict({"optimizer": {"name": "adamw", field: 1.0}})
