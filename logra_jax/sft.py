"""Supervised warm start: teach a model the answer format (and some skill) on easier problems before RL."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

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


def cached_warm_start(model: nnx.Module, warm_start: Callable[[], dict[str, float]], cache_dir: str | Path,
                      key: Mapping[str, Any]) -> tuple[dict[str, float], bool]:
    """Run `warm_start()` (which trains `model` in place) once per `key` and reuse its weights afterwards.

    The weights land in cache_dir/sft-<digest of key>.npz (written to a temporary file and renamed, so a crash never
    leaves a partial file); a later call with an equal key loads them into `model` bit for bit instead of
    training. The key must hold everything the warm start depends on (model, SFT and task settings, seed, length).

    Returns:
      (the warm start's metrics, True when they came from the cache).

    Raises:
      ValueError: a cached file whose parameters do not match the model (names the file and the parameter).
    """
    blob = json.dumps(key, sort_keys=True, default=str).encode()
    path = Path(cache_dir) / f"sft-{hashlib.blake2b(blob, digest_size=10).hexdigest()}.npz"
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = [".".join(map(str, p)) for p, _ in flat]
    if path.exists():
        with np.load(path) as data:
            missing = [n for n in names if n not in data.files]
            if missing or json.loads(str(data["__key__"])) != json.loads(blob):
                raise ValueError(f"SFT cache {path}: does not match this run (missing {missing[:3]} or another key)")
            loaded = []
            for name, (keys, variable) in zip(names, flat, strict=True):
                value = data[name]
                if value.shape != variable.get_value().shape:
                    raise ValueError(f"SFT cache {path}: parameter {name} has shape {value.shape}, the model's is "
                                     f"{variable.get_value().shape}")
                loaded.append((keys, variable.replace(jnp.asarray(value, variable.get_value().dtype))))
            metrics = json.loads(str(data["__metrics__"]))
        nnx.update(model, nnx.from_flat_state(loaded))
        return metrics, True
    metrics = warm_start()
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(v.get_value()) for name, (_, v) in
              zip(names, nnx.to_flat_state(nnx.state(model, nnx.Param)), strict=True)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, __key__=np.asarray(blob.decode()), __metrics__=np.asarray(json.dumps(metrics)), **arrays)
    os.replace(tmp, path)
    return metrics, False
