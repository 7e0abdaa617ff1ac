"""The train step reads the sketch settings from the optimizer it is given, and the config sections translate
themselves into the library's settings (one declaration each)."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from logra_jax.job.run_config import RunConfig, TaskSection
from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec, logra
from logra_jax.rl.tasks import TaskSpec


def _batch():
    tokens = jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8) % 50
    return {"tokens": tokens, "attention_mask": jnp.ones_like(tokens), "loss_mask": jnp.ones_like(tokens)}


def _step(model, tx):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = make_train_step(graphdef, next_token_loss, tx, mode="sketch_native")
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    return jax.eval_shape(step, state, rest, _batch())


def test_sketch_native_step_takes_the_optimizers_spec_and_checks_the_probes():
    spec = SketchSpec(rank=4, base_seed=3)
    model = init_model(preset("tiny"))
    attach_sketch_probes(model, spec)
    _, metrics = _step(model, logra(spec=spec, update_ratio=1e-3))  # traces: targets and spec from the tx
    assert "sketch_norm" in metrics
    with pytest.raises(ValueError, match=r"sketch probes of .*attached with.*base_seed=3.*optimizer sketches"):
        _step(model, logra(spec=dataclasses.replace(spec, base_seed=4), update_ratio=1e-3))
    with pytest.raises(ValueError, match="needs an optimizer that sketches"):
        _step(model, optax.adam(1e-3))


def test_task_section_takes_task_spec_defaults_and_builds_it():
    section = TaskSection()
    spec = section.spec()
    assert spec == dataclasses.replace(TaskSpec(), seed=section.seed)  # the generator's defaults, declared once
    assert section.spec(seed=9).seed == 9
    with pytest.raises(ValueError, match=r"config\.task\.count = 9"):
        TaskSection(kind="countdown", count=9).validate()
    with pytest.raises(ValueError, match="no generator spec"):
        TaskSection(kind="jsonl", jsonl_train="a", jsonl_eval="b").spec()


def test_sections_translate_into_the_librarys_settings():
    run = RunConfig.from_dict({"rollout": {"num_samples": 3, "temperature": 0.7, "top_k": 5, "max_new_tokens": 9},
                               "algorithm": {"estimator": "reinforce", "baseline_momentum": 0.2, "tis_cap": 0.0},
                               "train": {"mesh_fsdp": 2}})
    sampling = run.rollout.sampling(eos_id=1, pad_id=0)
    assert (sampling.num_samples, sampling.temperature, sampling.top_k, sampling.max_new_tokens) == (3, 0.7, 5, 9)
    greedy = run.rollout.sampling(eos_id=1, pad_id=0, greedy=True)
    assert (greedy.num_samples, greedy.temperature) == (1, 0.0)
    loss = run.algorithm.loss(max_len=9)
    assert loss.tis_cap is None and loss.max_len == 9 and loss.eps_high == run.algorithm.eps_high
    assert run.algorithm.estimator_options() == {"momentum": 0.2}
    assert (run.train.mesh().data, run.train.mesh().fsdp, run.train.mesh().tensor) == (1, 2, 1)
