"""Supervised warm start: teach a model the answer format (and some skill) on easier problems before RL."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from logra_jax.rl.prompts import PromptFormat, TextTokenizer, encode_sft
from logra_jax.rl.tasks import Problem
from logra_jax.run_config import SFTSection
from logra_jax.train_step import TrainState, make_train_step, next_token_loss


def supervised_warm_start(model: nnx.Module, tokenizer: TextTokenizer, fmt: PromptFormat,
                          problems: Sequence[Problem], cfg: SFTSection, length: int, *, seed: int = 0,
                          on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, float]:
    """Train `model` in place for cfg.steps AdamW steps of next-token cross-entropy on prompt → target.

    Batches of cfg.batch_size problems are drawn uniformly (seeded) from `problems`; only target tokens
    (answer + EOS) carry loss. Returns the last step's metrics (loss, seconds).
    """
    if cfg.steps < 1:
        raise ValueError(f"supervised_warm_start: cfg.steps must be >= 1, got {cfg.steps}")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.steps // 20, 1),
                                                        cfg.steps, cfg.learning_rate * 0.1))
    step_fn = jax.jit(make_train_step(graphdef, next_token_loss, tx), donate_argnums=0)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    rng = np.random.default_rng(seed)
    metrics: dict[str, float] = {}
    for i in range(cfg.steps):
        start = time.perf_counter()
        picks = rng.integers(0, len(problems), cfg.batch_size)
        batch = encode_sft([problems[j] for j in picks], tokenizer, fmt, length)
        state, out = step_fn(state, rest, {k: jnp.asarray(v) for k, v in batch.items()})
        loss = float(out["loss"])
        if not np.isfinite(loss):
            raise FloatingPointError(f"supervised_warm_start: loss is {loss} at SFT step {i}")
        metrics = {"sft_loss": loss, "step_time": time.perf_counter() - start}
        if on_step is not None:
            on_step(i, metrics)
    nnx.update(model, state.params)
    return metrics
