"""Supervised warm start: teach a model the answer format (and some skill) on easier problems before RL."""

from __future__ import annotations

import collections
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
from jax.sharding import Mesh

from logra_jax.job.run_config import SFTSection
from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.parallel import multihost
from logra_jax.parallel.sharding import (
    MeshConfig,
    batch_shardings,
    jit_train_step,
    make_mesh,
    param_shardings,
    replicated,
    to_global,
    train_state_shardings,
)
from logra_jax.rl.prompts import PromptFormat, TextTokenizer, encode_sft
from logra_jax.rl.tasks import Problem

SFT_BATCH = {"tokens": jnp.int32, "attention_mask": jnp.bool_, "loss_mask": jnp.bool_}  # `encode_sft`'s arrays


def sft_optimizer(cfg: SFTSection) -> optax.GradientTransformation:
    """The warm start's AdamW with a 5% warm-up and cosine decay to 10% of cfg.learning_rate."""
    return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.steps // 20, 1),
                                                          cfg.steps, cfg.learning_rate * 0.1))


def sft_step(graphdef: nnx.GraphDef, abstract_params: Any, abstract_rest: Any, cfg: SFTSection, mesh: Mesh,
             length: int) -> tuple[Callable[..., Any], Callable[[Any], TrainState], dict[str, Any], Any]:
    """The warm start's jitted pieces on `mesh`: (step, init, batch shapes, state shardings).

    init(params) -> TrainState creates the AdamW moments directly in their shards (jit with out_shardings,
    params donated); step(state, rest, batch) -> (state, metrics) is the sharded `make_train_step` (batch rows
    over the batch axes). `logra_jax.plan` compiles the same step for its SFT phase.
    """
    tx = sft_optimizer(cfg)
    abstract_state = jax.eval_shape(lambda p: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32)), abstract_params)
    state_sh = train_state_shardings(abstract_state, mesh)
    rest_sh = param_shardings(abstract_rest, mesh)
    batch = {name: jax.ShapeDtypeStruct((cfg.batch_size, length), dtype) for name, dtype in SFT_BATCH.items()}
    batch_sh = batch_shardings(batch, mesh)
    step = jit_train_step(make_train_step(graphdef, next_token_loss, tx), mesh,
                          in_shardings=(state_sh, rest_sh, batch_sh), out_shardings=(state_sh, replicated(mesh)))
    init = jax.jit(lambda p: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32)), out_shardings=state_sh,
                   donate_argnums=0)
    return step, init, batch, state_sh


def supervised_warm_start(model: nnx.Module, tokenizer: TextTokenizer, fmt: PromptFormat,
                          problems: Sequence[Problem], cfg: SFTSection, length: int, *, seed: int = 0,
                          on_step: Callable[[int, dict[str, float]], None] | None = None,
                          mesh: Mesh | None = None) -> dict[str, float]:
    """Train `model` in place for cfg.steps AdamW steps of next-token cross-entropy on prompt → target.

    Batches of cfg.batch_size problems are drawn uniformly (seeded) from `problems`; only target tokens
    (answer + EOS) carry loss. The step runs on `mesh` (default: one device) with the weights, AdamW moments and
    batch rows sharded by the rules (`sft_step`); every process draws the same batches.

    Returns:
      sft_loss (the last step's loss), sft_final_loss (the mean loss of the last `final_window(cfg.steps)`
      steps: what `check_warm_start` judges) and step_time (the last step's seconds).
    """
    if cfg.steps < 1:
        raise ValueError(f"supervised_warm_start: cfg.steps must be >= 1, got {cfg.steps}")
    if mesh is None:
        mesh = make_mesh(MeshConfig(fsdp=1), jax.local_devices()[:1])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step_fn, init, batch_shapes, _ = sft_step(graphdef, params, rest, cfg, mesh, length)
    batch_sh = batch_shardings(batch_shapes, mesh)
    state = init(params)
    rng = np.random.default_rng(seed)
    metrics: dict[str, float] = {}
    final = collections.deque(maxlen=final_window(cfg.steps))
    for i in range(cfg.steps):
        start = time.perf_counter()
        picks = rng.integers(0, len(problems), cfg.batch_size)
        batch = encode_sft([problems[j] for j in picks], tokenizer, fmt, length)
        state, out = step_fn(state, rest, to_global({k: np.asarray(v) for k, v in batch.items()}, batch_sh))
        loss = float(out["loss"])
        if not np.isfinite(loss):
            raise FloatingPointError(f"supervised_warm_start: loss is {loss} at SFT step {i}")
        final.append(loss)
        metrics = {"sft_loss": loss, "sft_final_loss": float(np.mean(final)), "step_time": time.perf_counter() - start}
        if on_step is not None:
            on_step(i, metrics)
    nnx.update(model, state.params)
    return metrics


def final_window(steps: int) -> int:
    """How many of the warm start's last steps its final loss averages: the last 5% (at least one), the length of
    its warm-up, so that one lucky or unlucky batch does not decide it."""
    return max(steps // 20, 1)


class WarmStartError(RuntimeError):
    """The SFT warm start ended above `sft.max_final_loss`: RL from it would start from a model that has not
    learnt the demonstrations."""


def final_loss(metrics: Mapping[str, float]) -> float:
    """The warm start's final loss from its metrics (`supervised_warm_start`'s, or a cache file's); a cache file
    written before the final loss was recorded holds only the last step's loss, which stands in for it."""
    return float(metrics.get("sft_final_loss", metrics["sft_loss"]))


def check_warm_start(metrics: Mapping[str, float], cfg: SFTSection, seed: int) -> float:
    """The warm start's final loss, checked against cfg.max_final_loss (0: not checked).

    Raises:
      WarmStartError: the final loss is above cfg.max_final_loss (names the seed, the loss and the field).
    """
    loss = final_loss(metrics)
    if cfg.max_final_loss > 0 and not loss <= cfg.max_final_loss:
        raise WarmStartError(
            f"the SFT warm start of seed {seed} (config.train.seed) ended at loss {loss:.4f} (mean of its last "
            f"{final_window(cfg.steps)} of {cfg.steps} steps), above config.sft.max_final_loss = "
            f"{cfg.max_final_loss:g}, so RL does not start from it (a warm start left on a plateau of the SFT loss "
            "gives RL that learns little). Try another seed or more config.sft.steps, or raise "
            "config.sft.max_final_loss to go on from it")
    return loss


def cached_warm_start(model: nnx.Module, warm_start: Callable[[], dict[str, float]], cache_dir: str | Path,
                      key: Mapping[str, Any]) -> tuple[dict[str, float], bool]:
    """Run `warm_start()` (which trains `model` in place) once per `key` and reuse its weights afterwards.

    The weights land in cache_dir/sft-<digest of key>.npz (written by process 0 to a temporary file and renamed,
    so a crash never leaves a partial file); a later call with an equal key loads them into `model` bit for bit
    instead of training, each process placing only its own shards. The key must hold everything the warm start
    depends on (model, SFT and task settings, seed, length). Every process of a run calls this: the warm start
    is one computation on the global mesh, so all of them train, or all of them load.

    Returns:
      (the warm start's metrics, True when they came from the cache).

    Raises:
      ValueError: a cached file whose parameters do not match the model (names the file and the parameter).
    """
    blob = json.dumps(key, sort_keys=True, default=str).encode()
    path = Path(cache_dir) / f"sft-{hashlib.blake2b(blob, digest_size=10).hexdigest()}.npz"
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = [".".join(map(str, p)) for p, _ in flat]
    found = multihost.gather(np.int32(path.exists()))
    if found.min() != found.max():
        raise ValueError(f"SFT cache {path}: seen by processes {np.flatnonzero(found).tolist()} only; "
                         "config.sft.cache_dir must be a directory every process shares")
    if found[0]:
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
                old = variable.get_value()  # its sharding: each process places only its own shards
                value = value.astype(old.dtype, copy=False)
                loaded.append((keys, variable.replace(jax.make_array_from_callback(
                    value.shape, old.sharding, lambda index, value=value: value[index]))))
            metrics = json.loads(str(data["__metrics__"]))
        nnx.update(model, nnx.from_flat_state(loaded))
        return metrics, True
    metrics = warm_start()
    arrays = {name: multihost.host_array(v.get_value()) for name, (_, v) in
              zip(names, nnx.to_flat_state(nnx.state(model, nnx.Param)), strict=True)}
    if not multihost.is_primary():
        return metrics, False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, __key__=np.asarray(blob.decode()), __metrics__=np.asarray(json.dumps(metrics)), **arrays)
    os.replace(tmp, path)
    return metrics, False
