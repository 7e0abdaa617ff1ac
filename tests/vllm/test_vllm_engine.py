"""End to end with vLLM (its CPU build in .venv-vllm, `make venv-vllm`): 2 RL steps on vLLM rollouts, each
published by low-rank sync; the engine's masters follow the trainer's weights, and vLLM itself serves them (its
greedy log-probs equal the trainer's teacher-forced ones). Skipped without .venv-vllm."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import ModelConfig
from logra_jax.models.decoder import init_model
from logra_jax.models.hf import export
from logra_jax.optim import apply_updates, logra
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.sync import flat_params
from logra_jax.rollout.vllm.engine import VLLMEngine
from logra_jax.rollout.vllm.settings import VLLMSettings

PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
# `make venv-vllm` writes its stamp after `import vllm` worked there (importing vllm to ask takes 6 s per
# module and xdist worker)
if not (PYTHON.is_file() and (PYTHON.parents[1] / ".installed-vllm").is_file()):
    pytest.skip("vLLM is not installed: run `make venv-vllm`", allow_module_level=True)

# vLLM's CPU build rejects head_dim 16 (the tiny preset's): a tiny model with head_dim 64.
CONFIG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=64, max_seq_len=64)
SAMPLING = SamplingConfig(max_new_tokens=8, eos_id=1, pad_id=0, num_samples=2)
PROMPTS = np.array([[0, 5, 6, 7], [9, 10, 11, 12]], np.int32)
MASK = PROMPTS != 0
P = PROMPTS.shape[1]
GRAPHDEF, PARAMS0 = nnx.split(init_model(CONFIG, seed=0))
TX = logra(rank=8, rank_rules="mlp=4", update_ratio=2e-2)  # per-target ranks: the MLP at 4, attention at 8


def _logprobs(params, tokens, attention_mask):
    logits = nnx.merge(GRAPHDEF, params)(tokens[:, :-1], attention_mask=attention_mask[:, :-1])
    return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]


@jax.jit
def _train_step(params, opt_state, tokens, attention_mask, response_mask):
    reward = jnp.sum((tokens[:, P:] % 2 == 0) & response_mask, axis=1) / jnp.maximum(response_mask.sum(1), 1)
    advantage = reward - reward.mean()
    mask = jnp.concatenate([jnp.zeros((tokens.shape[0], P - 1), bool), response_mask], axis=1)
    loss_fn = lambda p: -jnp.mean(advantage * jnp.sum(_logprobs(p, tokens, attention_mask) * mask, axis=1))
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state, updates


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = export(nnx.merge(GRAPHDEF, PARAMS0), None, tmp_path_factory.mktemp("hf") / "model")
    settings = VLLMSettings(python=str(PYTHON), dtype="float32", kv_cache_gib=1, max_seqs=8)
    with VLLMEngine(CONFIG, SAMPLING, PARAMS0, model_dir=folder, settings=settings) as engine:
        yield engine


def test_two_rl_steps_with_vllm_rollouts_and_low_rank_sync(engine):
    params, opt_state = PARAMS0, TX.init(PARAMS0)
    assert engine.sync.bootstrap.reply.status == "loaded"
    for step in range(2):
        rollout = engine.generate(PROMPTS, MASK, jax.random.key(step))
        assert rollout.tokens.shape == (4, P + SAMPLING.max_new_tokens)
        np.testing.assert_array_equal(rollout.tokens[:, :P], np.repeat(PROMPTS, 2, axis=0))
        # rows end at the job's eos (1) or the budget, never at vLLM's own default eos (2, a Llama config's)
        short = np.asarray(rollout.lengths) < SAMPLING.max_new_tokens
        last = np.asarray(rollout.tokens)[np.arange(4), P + np.asarray(rollout.lengths) - 1]
        assert np.all(last[short] == SAMPLING.eos_id), (rollout.lengths, last)
        # vLLM's log-probs are the sampling policy's: the trainer's teacher-forced ones at the same weights
        want = _logprobs(params, rollout.tokens, rollout.attention_mask())[:, P - 1:]
        np.testing.assert_allclose(np.where(rollout.response_mask, rollout.logprobs, 0),
                                   np.where(rollout.response_mask, want, 0), atol=2e-4)
        params, opt_state, updates = _train_step(params, opt_state, rollout.tokens, rollout.attention_mask(),
                                                 rollout.response_mask)
        report = engine.publish(updates, params)
        assert (report.reply.status, report.reply.version, report.resync_reason) == ("applied", step + 1, "")
        assert report.nbytes < 0.2 * sum(a.nbytes for a in jax.tree.leaves(params))  # U and seeds, not weights
    version, masters = engine.fetch()
    assert version == 2 and engine.resyncs == 0
    for path, w in jax.device_get(flat_params(params)).items():
        np.testing.assert_allclose(masters[path], w, rtol=0, atol=1e-6 * max(np.abs(w).max(), 1), err_msg=path)
    moved = jax.device_get(flat_params(params))["blocks.attn.q_proj.kernel"]
    assert not np.array_equal(moved, jax.device_get(flat_params(PARAMS0))["blocks.attn.q_proj.kernel"])
    # vLLM serves the synced weights: greedy log-probs equal the trainer's after the two updates
    greedy = engine.generate(PROMPTS, MASK, jax.random.key(9), SamplingConfig(max_new_tokens=8, eos_id=1, pad_id=0,
                                                                              temperature=0.0))
    want = _logprobs(params, greedy.tokens, greedy.attention_mask())[:, P - 1:]
    np.testing.assert_allclose(np.where(greedy.response_mask, greedy.logprobs, 0),
                               np.where(greedy.response_mask, want, 0), atol=2e-4)
