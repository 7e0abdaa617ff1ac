"""One optimizer step over microbatches, for any optax transformation and any model loss.

`make_train_step` returns a pure function `step(state, batch, extra) -> (state, metrics)` for the caller to jit
(with shardings and donation, see logra_jax.sharding). Gradients of the trainable parameters are accumulated in
float32 over microbatches with `lax.scan` and averaged; under GSPMD a batch sharded over the data axes gives the
data-parallel mean without explicit collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from logra_jax.optim.lowrank import LowRankUpdate
from logra_jax.optim.lowrank import apply_updates as apply_lowrank_updates
from logra_jax.optim.sketch_native import SketchProbe, SketchSpec, sketching
from logra_jax.optim.targets import Target, path_str

LossFn = Callable[[nnx.Module, Mapping[str, jax.Array]], tuple[jax.Array, Mapping[str, jax.Array]]]


class TrainState(NamedTuple):
    """params: trainable + frozen nnx.Param state; opt_state: the optax state; step: completed updates."""

    params: nnx.State
    opt_state: Any
    step: jax.Array


def split_microbatches(batch: Mapping[str, jax.Array], microbatches: int) -> dict[str, jax.Array]:
    """[B, ...] leaves → [M, B/M, ...]; B must be divisible by M."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    out = {}
    for name, x in batch.items():
        if x.shape[0] % microbatches:
            raise ValueError(f"batch[{name!r}] has leading size {x.shape[0]}, not divisible by "
                             f"microbatches={microbatches}")
        out[name] = x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])
    return out


def accumulate_grads(value_and_grad: Callable[[Mapping[str, jax.Array]], tuple[tuple[jax.Array, Any], Any]],
                     batch: Mapping[str, jax.Array], microbatches: int) -> tuple[jax.Array, Any, Any]:
    """Mean loss, float32 mean gradients and the last microbatch's aux over `microbatches` slices of `batch`.

    value_and_grad(microbatch) -> ((loss, aux), grads). Gradients are summed in float32 inside a lax.scan (only
    one microbatch's activations are alive at a time) and divided by the number of microbatches.
    """
    mbs = split_microbatches(batch, microbatches)
    first = jax.tree.map(lambda x: x[0], mbs)
    (_, aux_shape), grad_shape = jax.eval_shape(value_and_grad, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), grad_shape)

    def body(carry, mb):
        acc, loss_sum = carry
        (loss, aux), grads = value_and_grad(mb)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return (acc, loss_sum + loss.astype(jnp.float32)), aux

    del aux_shape
    (acc, loss_sum), auxs = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), mbs)
    grads = jax.tree.map(lambda a: a / microbatches, acc)
    return loss_sum / microbatches, grads, jax.tree.map(lambda x: x[-1], auxs)


def make_dense_train_step(graphdef: nnx.GraphDef, loss_fn: LossFn, tx: optax.GradientTransformation, *,
                          microbatches: int = 1, trainable: Callable[[tuple, Any], bool] | None = None,
                          apply_updates: Callable[[Any, Any], Any] = optax.apply_updates):
    """Train step with dense gradients of the trainable parameters (all nnx.Params by default).

    Args:
      graphdef: the model's graph definition (from `nnx.split(model, nnx.Param, ...)`).
      loss_fn: (model, microbatch) -> (scalar loss, aux metrics).
      tx: any optax transformation over the parameter state (frozen leaves get zero gradients).
      microbatches: number of gradient-accumulation slices of the batch.
      trainable: nnx filter predicate (path, variable) -> bool selecting the trained params; None = all.
      apply_updates: how updates merge into params (logra_jax.optim.apply_updates for low-rank updates).

    Returns:
      step(state: TrainState, rest: nnx.State, batch, **extra) -> (TrainState, metrics dict).
    """
    def step(state: TrainState, rest: nnx.State, batch: Mapping[str, jax.Array], **extra: Any):
        params = state.params
        if trainable is None:
            train, frozen = params, None
        else:
            train, frozen = nnx.split_state(params, trainable, ...)

        def value_and_grad(mb):
            def loss_of(train_params):
                full = train_params if frozen is None else nnx.merge_state(train_params, frozen)
                return loss_fn(nnx.merge(graphdef, full, rest), mb)
            return jax.value_and_grad(loss_of, has_aux=True)(train)

        loss, grads, aux = accumulate_grads(value_and_grad, batch, microbatches)
        if frozen is not None:
            grads = nnx.merge_state(grads, jax.tree.map(jnp.zeros_like, frozen))
        updates, opt_state = tx.update(grads, state.opt_state, params, **extra)
        new_params = apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}
        return TrainState(new_params, opt_state, state.step + 1), metrics

    return step


def make_sketch_native_train_step(graphdef: nnx.GraphDef, loss_fn: LossFn, tx: optax.GradientTransformation,
                                  targets: Mapping[str, Target], spec: SketchSpec, *, microbatches: int = 1,
                                  round_bf16: bool = False, trainable: Callable[[tuple, Any], bool] | None = None):
    """Train step whose target layers deliver sketches S = Hᵀ(X Aᵀ) directly (no dense target gradient).

    The model must carry sketch probes (`logra_jax.optim.attach_sketch_probes(model, spec)`) and be split as
    `graphdef, params, rest = nnx.split(model, nnx.Param, ...)` (probes and digests live in `rest`). Per
    microbatch, `jax.grad` with respect to the zero probes (and the trainable non-target params, if any) runs
    inside `sketching(state.step)`; sketches accumulate in float32. Target updates enter `tx` as LowRankUpdate
    leaves (factor = S, step = state.step), which `scale_by_sketch` passes through, so the chain from RowAdam
    on is the same code as in dense-gradient mode. Frozen non-targets get zero updates.

    Args:
      graphdef, loss_fn, tx, microbatches: as in `make_dense_train_step`.
      targets: the targets `attach_sketch_probes` returned.
      spec: the sketch settings `attach_sketch_probes` used (must match tx's scale_by_sketch settings).
      round_bf16: the round_bf16 flag of the produced LowRankUpdates (must match tx's).
      trainable: predicate (path, variable) -> bool for non-target params trained densely; None = none.

    Returns:
      step(state: TrainState, rest: nnx.State, batch, **extra) -> (TrainState, metrics dict).
    """
    probe_path = {t: t.rsplit(".", 1)[0] + ".sketch_probe" for t in targets}

    def step(state: TrainState, rest: nnx.State, batch: Mapping[str, jax.Array], **extra: Any):
        params = state.params
        probes, others = nnx.split_state(rest, SketchProbe, ...)
        if trainable is None:
            train, frozen = None, params
        else:
            train, frozen = nnx.split_state(params, trainable, ...)

        def value_and_grad(mb):
            def loss_of(diff):
                probe_values, train_params = diff
                full = frozen if train_params is None else nnx.merge_state(train_params, frozen)
                with sketching(state.step):
                    model = nnx.merge(graphdef, full, nnx.merge_state(probe_values, others))
                    return loss_fn(model, mb)
            return jax.value_and_grad(loss_of, has_aux=True)((probes, train))

        loss, (sketch_grads, train_grads), aux = accumulate_grads(value_and_grad, batch, microbatches)
        sketches = {path_str(k): v for k, v in jax.tree_util.tree_leaves_with_path(sketch_grads)}
        dense = {} if train_grads is None else {
            path_str(k): v for k, v in jax.tree_util.tree_leaves_with_path(train_grads)}

        def update_leaf(keypath, p):
            path = path_str(keypath)
            if path in targets:
                return LowRankUpdate(sketches[probe_path[path]], state.step, target=targets[path],
                                     base_seed=spec.base_seed, rank=spec.rank, distribution=spec.distribution,
                                     refresh=spec.refresh, round_bf16=round_bf16)
            return dense[path] if path in dense else jnp.zeros_like(p)

        grads = jax.tree_util.tree_map_with_path(update_leaf, params)
        updates, opt_state = tx.update(grads, state.opt_state, params, **extra)
        new_params = apply_lowrank_updates(params, updates)
        metrics = {"loss": loss, "sketch_norm": optax.global_norm(list(sketches.values())), **aux}
        if dense:
            metrics["grad_norm"] = optax.global_norm(list(dense.values()))
        return TrainState(new_params, opt_state, state.step + 1), metrics

    return step


def next_token_loss(model: nnx.Module, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over positions where batch['loss_mask'][:, 1:] is set.

    batch: 'tokens' int32 [B, T], 'attention_mask' [B, T] and 'loss_mask' [B, T] (1 where the token is a target).
    """
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    loss = jnp.sum(nll * mask) / jnp.maximum(mask.sum(), 1.0)
    return loss, {"tokens": mask.sum()}
