"""One optimizer step over microbatches, for any optax transformation and any model loss.

`make_train_step` returns a pure function `step(state, rest, batch, *, probe=None, **extra) -> (state, metrics)`
for the caller to jit (with shardings and donation, see logra_jax.parallel.sharding). Two ways to get the gradient
signal:
  - "dense": float32 gradients of the trainable parameters, accumulated over microbatches with `lax.scan`;
  - "sketch_native": target layers hand over S = Hᵀ(X Aᵀ) through their sketch probes (no dense target
    gradient); targets enter the optax chain as LowRankUpdate leaves, which `scale_by_sketch` passes through.
    Which parameters are targets and how their updates are drawn and merged is the optimizer's SketchSpec, read
    from its state (`logra_jax.optim.sketch_spec`), not given to the step again.
Under GSPMD a batch sharded over the data axes gives the data-parallel mean without explicit collectives.
With a `KLProbeConfig`, the step builds the predicted-KL probe on `probe` (a few responses) for
`scale_by_predicted_kl` and measures the realised KL on the same responses after the update; a step the
controller refuses (non-finite or negative q) changes nothing but the controller's refusal count and reports
kl_refused = 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from logra_jax.core.tree_paths import flat_params, path_keys, path_str
from logra_jax.native.kl_probe import make_kl_probe, realised_kl
from logra_jax.native.sketch_probes import SketchProbe, check_probes_match, sketching
from logra_jax.optim.lowrank import LowRankUpdate
from logra_jax.optim.lowrank import apply_updates as apply_lowrank_updates
from logra_jax.optim.predicted_kl import hold_if_skipped, hold_where
from logra_jax.optim.spec import SketchSpec, sketch_spec, state_targets
from logra_jax.optim.targets import find_targets
from logra_jax.parallel.sharding import DEFAULT_RULES, LogicalRules, param_shardings, train_state_shardings
from logra_jax.rl.losses import LOSS_DENOMINATOR

LossFn = Callable[[nnx.Module, Mapping[str, jax.Array]], tuple[jax.Array, Mapping[str, jax.Array]]]
Trainable = Callable[[tuple, Any], bool]

# Fields of the optimizer state reported as metrics of the same name when present (scale_by_predicted_kl's).
_KL_STATE_METRICS = ("kl_q", "kl_alpha", "kl_budget", "kl_skipped", "kl_mismatch")


class TrainState(NamedTuple):
    """params: trainable + frozen nnx.Param state; opt_state: the optax state; step: completed updates."""

    params: nnx.State
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class KLProbeConfig:
    """Predicted-KL probing inside the step: sampling temperature and positions per chunk. undo_above: when > 0,
    a step whose realised KL on the probe exceeds undo_above × the controller's budget is undone (params back,
    no state advanced, reported as kl_undone = 1): the guard against a prediction that underestimates. Its
    cost: the old weights stay alive until the realised KL is known (one more copy of the parameters)."""

    temperature: float = 1.0
    chunk: int = 256
    undo_above: float = 0.0
    passes: int | None = None  # probe rows in this many sequential slices; None: one row per batch shard at a time


def densely_trained(mode: str, trainable: Trainable | None) -> Callable[[tuple[str, ...]], bool]:
    """Whether the parameter at a path gets a dense update in a step of `mode` with `trainable` (as
    `make_train_step` takes them): `trainable(path, None)`, or, without it, every parameter in "dense" mode and
    none in "sketch_native" mode (whose targets get LowRankUpdates instead)."""
    if trainable is None:
        return lambda path: mode == "dense"
    return lambda path: bool(trainable(path, None))


def split_microbatches(batch: Mapping[str, jax.Array], microbatches: int) -> dict[str, jax.Array]:
    """[B, ...] leaves → [M, B/M, ...] with rows interleaved (microbatch m holds rows m, m + M, ...), so each
    microbatch spreads evenly over the data-parallel shards of a batch sharded on its rows; B % M == 0."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    out = {}
    for name, x in batch.items():
        if x.shape[0] % microbatches:
            raise ValueError(f"batch[{name!r}] has leading size {x.shape[0]}, not divisible by "
                             f"microbatches={microbatches}")
        out[name] = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
    return out


def accumulate_grads(value_and_grad: Callable[[Mapping[str, jax.Array]], tuple[tuple[jax.Array, Any], Any]],
                     batch: Mapping[str, jax.Array], microbatches: int) -> tuple[jax.Array, Any, Any]:
    """Loss, float32 gradients and mean aux metrics over `microbatches` slices of `batch`, normalised once.

    value_and_grad(microbatch) -> ((loss, aux), grads). Gradients are summed in float32 inside a lax.scan (only
    one microbatch's activations are alive at a time). The normalisation:
      - a loss whose aux holds LOSS_DENOMINATOR (its normaliser, independent of the parameters: a token count,
        a sequence count, ...) is a ratio num_m / den_m; the step returns Σ_m num_m / max(Σ_m den_m, 1) and the
        gradient of that, with num_m = loss_m · max(den_m, 1). This is the whole batch's loss whatever the split
        (the authors divide by the global count of valid tokens), and under GSPMD the sums run over every
        data-parallel replica's rows;
      - any other loss is a mean per microbatch, and microbatches are weighted equally (exact when they hold
        equal shares of its normaliser).
    Aux metrics are averaged over microbatches; LOSS_DENOMINATOR is reported summed.
    """
    if microbatches == 1:  # no loop, so no float32 accumulator beside the gradient itself (same arithmetic)
        (loss, aux), grads = value_and_grad(batch)
        weighted = isinstance(aux, Mapping) and LOSS_DENOMINATOR in aux
        den = aux[LOSS_DENOMINATOR].astype(jnp.float32) if weighted else jnp.float32(1.0)
        weight, norm = jnp.maximum(den, 1.0), jnp.maximum(den, 1.0)
        aux = jax.tree.map(lambda x: x.astype(jnp.float32), aux)
        if weighted:
            aux = {**aux, LOSS_DENOMINATOR: den}
        return (weight * loss.astype(jnp.float32) / norm,
                jax.tree.map(lambda g: weight * g.astype(jnp.float32) / norm, grads), aux)
    mbs = split_microbatches(batch, microbatches)
    first = jax.tree.map(lambda x: x[0], mbs)
    (_, aux_shape), grad_shape = jax.eval_shape(value_and_grad, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), grad_shape)
    weighted = isinstance(aux_shape, Mapping) and LOSS_DENOMINATOR in aux_shape

    def body(carry, mb):
        acc, loss_sum, den_sum = carry
        (loss, aux), grads = value_and_grad(mb)
        den = aux[LOSS_DENOMINATOR].astype(jnp.float32) if weighted else jnp.float32(1.0)
        weight = jnp.maximum(den, 1.0)  # num_m = loss_m · max(den_m, 1); 1 for an unweighted mean loss
        acc = jax.tree.map(lambda a, g: a + weight * g.astype(jnp.float32), acc, grads)
        return (acc, loss_sum + weight * loss.astype(jnp.float32), den_sum + den), aux

    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (acc, loss_sum, den_sum), auxs = jax.lax.scan(body, init, mbs)
    norm = jnp.maximum(den_sum, 1.0)
    aux = jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0), auxs)
    if weighted:
        aux = {**aux, LOSS_DENOMINATOR: den_sum}
    return loss_sum / norm, jax.tree.map(lambda a: a / norm, acc), aux


def step_shardings(abstract_state: TrainState, abstract_rest: Any, mesh: Mesh,
                   rules: LogicalRules = DEFAULT_RULES) -> tuple[TrainState, Any]:
    """The shardings of a train step's state and `rest` (the model's non-Param state: sketch probes) on `mesh`.

    Parameters from their logical-axis metadata; the optimizer state and the sketch probes follow their
    parameters, the optimizer's LoGRA targets (`state_targets`, read from the state's SketchSpec) by their
    declared dims — the same `Target.state_spec` an eager `init` on sharded parameters places row moments by —
    and every other leaf by size (`logra_jax.parallel.sharding.opt_state_shardings`).

    Args:
      abstract_state: the TrainState (arrays or ShapeDtypeStructs, e.g. from `jax.eval_shape(init_fn)`).
      abstract_rest: the non-Param model state.
      mesh, rules: the mesh and the logical-axis rules.

    Returns:
      (state shardings, rest shardings), trees of NamedShardings for `jit_train_step`'s in/out shardings.
    """
    targets = state_targets(abstract_state.opt_state, abstract_state.params)
    return (train_state_shardings(abstract_state, mesh, rules, targets=targets),
            param_shardings(abstract_rest, mesh, rules, sources=abstract_state.params, targets=targets))


GradientFn = Callable[[TrainState, nnx.State, Mapping[str, jax.Array]], tuple[jax.Array, Any, dict[str, jax.Array]]]


def _dense_gradients(graphdef: nnx.GraphDef, loss_fn: LossFn, microbatches: int,
                     trainable: Trainable | None) -> GradientFn:
    """(state, rest, batch) -> (loss, float32 gradients, metrics) for mode "dense": the trainable parameters are
    differentiated, the frozen ones get zeros (so the tree matches the parameters')."""

    def gradients(state: TrainState, rest: nnx.State, batch: Mapping[str, jax.Array]
                  ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
        params = state.params
        train, frozen = (params, None) if trainable is None else nnx.split_state(params, trainable, ...)

        def value_and_grad(mb: Mapping[str, jax.Array]) -> tuple[tuple[jax.Array, Any], Any]:
            def loss_of(train_params: nnx.State) -> tuple[jax.Array, Any]:
                full = train_params if frozen is None else nnx.merge_state(train_params, frozen)
                return loss_fn(nnx.merge(graphdef, full, rest), mb)
            return jax.value_and_grad(loss_of, has_aux=True)(train)

        loss, grads, aux = accumulate_grads(value_and_grad, batch, microbatches)
        metrics = {"grad_norm": optax.tree.norm(grads)}
        if frozen is not None:
            grads = nnx.merge_state(grads, jax.tree.map(jnp.zeros_like, frozen))
        return loss, grads, {**aux, **metrics}

    return gradients


def _sketch_gradients(graphdef: nnx.GraphDef, loss_fn: LossFn, microbatches: int,
                      trainable: Trainable | None) -> GradientFn:
    """(state, rest, batch) -> (loss, update tree, metrics) for mode "sketch_native": the loss is differentiated
    with respect to the sketch probes (S = Hᵀ(X Aᵀ) per target) and the densely trained parameters, never the
    target kernels (`_sketch_updates` makes the tree)."""

    def gradients(state: TrainState, rest: nnx.State, batch: Mapping[str, jax.Array]
                  ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
        params = state.params
        spec = sketch_spec(state.opt_state)
        if spec is None:
            raise ValueError("make_train_step: mode='sketch_native' needs an optimizer that sketches (logra or "
                             "scale_by_sketch); its state holds no SketchSpec")
        check_probes_match(nnx.merge(graphdef, params, rest), spec)  # trace time only: no arrays are computed
        probes, others = nnx.split_state(rest, SketchProbe, ...)
        train, frozen = (None, params) if trainable is None else nnx.split_state(params, trainable, ...)

        def value_and_grad(mb: Mapping[str, jax.Array]) -> tuple[tuple[jax.Array, Any], Any]:
            def loss_of(diff: tuple[nnx.State, nnx.State | None]) -> tuple[jax.Array, Any]:
                probe_values, train_params = diff
                full = frozen if train_params is None else nnx.merge_state(train_params, frozen)
                with sketching(state.step):
                    return loss_fn(nnx.merge(graphdef, full, nnx.merge_state(probe_values, others)), mb)
            return jax.value_and_grad(loss_of, has_aux=True)((probes, train))

        loss, (sketch_tree, train_grads), aux = accumulate_grads(value_and_grad, batch, microbatches)
        dense = {} if train_grads is None else flat_params(train_grads)
        metrics = {"sketch_norm": optax.tree.norm(list(flat_params(sketch_tree).values()))}
        if dense:
            metrics["grad_norm"] = optax.tree.norm(list(dense.values()))
        return loss, _sketch_updates(state, spec, sketch_tree, dense), {**aux, **metrics}

    return gradients


def _sketch_updates(state: TrainState, spec: SketchSpec, sketch_tree: nnx.State,
                    dense: Mapping[str, jax.Array]) -> Any:
    """The parameters' tree of a sketch-native step's gradient signal: a LowRankUpdate of S for each target, the
    dense gradient of each densely trained parameter, zeros elsewhere. A target's S is the gradient of the probe
    that `attach_sketch_probes` installed on the module owning its kernel, so both are found by that module."""
    targets = find_targets(state.params, spec.rules)
    by_module = {path_keys(keypath)[:-1]: s for keypath, s in jax.tree_util.tree_leaves_with_path(sketch_tree)}

    def leaf(keypath: tuple[Any, ...], p: jax.Array) -> Any:
        path = path_str(keypath)
        if path in targets:
            return LowRankUpdate(by_module[path_keys(keypath)[:-1]], state.step, target=targets[path], spec=spec)
        return dense[path] if path in dense else jnp.zeros_like(p)

    return jax.tree_util.tree_map_with_path(leaf, state.params)


def _sync_view(updates: Any, trained: Callable[[tuple[str, ...]], bool]) -> Any:
    """`updates` with None where a parameter is not trained: LowRankUpdates and the dense updates of `trained`
    paths stay, so neither the merge nor the policy sync touches a frozen parameter."""
    def keep(keypath: tuple[Any, ...], u: Any) -> Any:
        return u if isinstance(u, LowRankUpdate) or trained(path_keys(keypath)) else None
    return jax.tree_util.tree_map_with_path(keep, updates, is_leaf=lambda x: isinstance(x, LowRankUpdate))


def _apply_or_hold(tx: optax.GradientTransformation, state: TrainState, grads: Any, extra: Mapping[str, Any],
                   trained: Callable[[tuple[str, ...]], bool]) -> tuple[TrainState, Any, jax.Array | None]:
    """The optimizer's update merged into the trained parameters: (new state, updates, refused), refused None
    unless the optimizer holds a KL controller."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
    # A step the KL controller refused advances no state: its updates are zeros (params stay bit for bit),
    # moments, counters and the projection step stay where they were; only the refusal count moves.
    updates, opt_state, refused = hold_if_skipped(updates, state.opt_state, opt_state)
    # Only what is trained is merged: a frozen parameter keeps its (donated) buffer instead of being rewritten
    # as W + 0·s (a full-size copy XLA cannot fold away once the KL controller scales the updates).
    params = apply_lowrank_updates(state.params, _sync_view(updates, trained))
    step = state.step + 1 if refused is None else jnp.where(refused, state.step, state.step + 1)
    return TrainState(params, opt_state, step), updates, refused


def _controller_metrics(opt_state: Any, refused: jax.Array | None) -> dict[str, jax.Array]:
    """kl_refused, the KL controller's state fields (`_KL_STATE_METRICS`) and the predicted KL of the step
    actually applied, α²q; empty without a controller."""
    metrics = {} if refused is None else {"kl_refused": refused.astype(jnp.float32)}
    for name in _KL_STATE_METRICS:
        value = optax.tree_utils.tree_get(opt_state, name)
        if value is not None:
            metrics[name] = value
    if "kl_q" in metrics:
        metrics["kl_predicted"] = metrics["kl_alpha"] ** 2 * metrics["kl_q"]
    return metrics


def _with_kl_probe(config: KLProbeConfig, graphdef: nnx.GraphDef, state: TrainState, rest: nnx.State,
                   probe: Mapping[str, jax.Array] | None, metrics: Mapping[str, jax.Array],
                   extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` for `scale_by_predicted_kl`: the step's KL probe built on the `probe` responses, and the rollout
    mismatch the RL objective measured (feeds the controller's EMA) unless the caller gave one."""
    if probe is None:
        raise ValueError("train step built with kl_probe needs probe={'tokens', 'attention_mask', 'kl_mask'}")
    kl_probe = make_kl_probe(graphdef, state.params, rest, state.step, probe, config.temperature, config.chunk,
                             passes=config.passes)
    mismatch = {"rollout_mismatch": metrics["rollout_mismatch"]} if "rollout_mismatch" in metrics else {}
    return {**mismatch, **extra, "kl_probe": kl_probe}


def _check_realised_kl(config: KLProbeConfig, graphdef: nnx.GraphDef, old: TrainState, new: TrainState,
                       updates: Any, rest: nnx.State, probe: Mapping[str, jax.Array], kl_probe: Any,
                       budget: jax.Array | None) -> tuple[TrainState, Any, dict[str, jax.Array]]:
    """The realised KL on the probe responses between `old` and `new` parameters; with `config.undo_above`, a
    step above undo_above × budget is undone (parameters back, every state held). Returns (state, updates,
    metrics: kl_realised[, kl_undone])."""
    kl_sum, count = realised_kl(graphdef, old.params, new.params, rest, probe, config.temperature, config.chunk,
                                hidden_before=getattr(kl_probe, "hidden_before", None), passes=config.passes)
    metrics = {"kl_realised": kl_sum / jnp.maximum(count, 1.0)}
    if config.undo_above <= 0:
        return new, updates, metrics
    undone = metrics["kl_realised"] > config.undo_above * budget
    updates, opt_state = hold_where(undone, updates, old.opt_state, new.opt_state)
    params = jax.tree.map(lambda before, after: jnp.where(undone, before, after), old.params, new.params)
    metrics["kl_undone"] = undone.astype(jnp.float32)
    return TrainState(params, opt_state, jnp.where(undone, old.step, new.step)), updates, metrics


def make_train_step(graphdef: nnx.GraphDef, loss_fn: LossFn, tx: optax.GradientTransformation, *,
                    mode: Literal["dense", "sketch_native"] = "dense", microbatches: int = 1,
                    trainable: Trainable | None = None, kl_probe: KLProbeConfig | None = None,
                    return_updates: bool = False) -> Callable[..., tuple[Any, ...]]:
    """Build the train step.

    Args:
      graphdef: the model's graph definition from `nnx.split(model, nnx.Param, ...)` (with sketch probes attached
        for mode "sketch_native" or for predicted-KL probing).
      loss_fn: (model, microbatch) -> (scalar loss, aux metrics).
      tx: any optax transformation over the parameter state (apply with logra_jax.optim.apply_updates, which
        also merges low-rank updates).
      mode: "dense" (dense gradients of the trainable params) or "sketch_native" (sketches for targets; tx must
        sketch: its SketchSpec, read from the optimizer state at trace time (`logra_jax.optim.sketch_spec`),
        says which parameters are targets and how their LowRankUpdates are drawn and merged; the model's probes
        must have been attached with the same spec).
      microbatches: gradient-accumulation slices of the batch.
      trainable: nnx filter predicate (path, variable) -> bool. Dense mode: the params that get gradients (None =
        all; the rest are frozen: never differentiated nor rewritten). Sketch-native mode: the non-target params
        trained densely (None = none).
      kl_probe: probe the predicted KL of each update (tx must contain scale_by_predicted_kl); the step then
        takes `probe={'tokens', 'attention_mask', 'kl_mask'}` and reports the realised KL.
      return_updates: also return the merged update tree for policy sync: LowRankUpdate leaves for targets, dense
        updates for densely trained params, None for frozen ones (so no full-size zeros leave the step).

    Returns:
      step(state: TrainState, rest: nnx.State, batch, *, probe=None, **extra) -> (TrainState, metrics dict)
      [, updates].

    Raises:
      ValueError: an unknown mode; at trace time, sketch-native mode with an optimizer that does not sketch.
    """
    if mode not in ("dense", "sketch_native"):
        raise ValueError(f"make_train_step: mode must be 'dense' or 'sketch_native', got {mode!r}")
    gradients = (_sketch_gradients if mode == "sketch_native" else _dense_gradients)(
        graphdef, loss_fn, microbatches, trainable)
    trained = densely_trained(mode, trainable)

    def step(state: TrainState, rest: nnx.State, batch: Mapping[str, jax.Array], *,
             probe: Mapping[str, jax.Array] | None = None, **extra: Any) -> tuple[Any, ...]:
        loss, grads, metrics = gradients(state, rest, batch)
        if kl_probe is not None:
            extra = _with_kl_probe(kl_probe, graphdef, state, rest, probe, metrics, extra)
        new_state, updates, refused = _apply_or_hold(tx, state, grads, extra, trained)
        metrics = {"loss": loss, **metrics, **_controller_metrics(new_state.opt_state, refused)}
        if kl_probe is not None:
            new_state, updates, realised = _check_realised_kl(kl_probe, graphdef, state, new_state, updates, rest,
                                                              probe, extra["kl_probe"], metrics.get("kl_budget"))
            metrics.update(realised)
        return (new_state, metrics, _sync_view(updates, trained)) if return_updates else (new_state, metrics)

    return step


def next_token_loss(model: nnx.Module, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over positions where batch['loss_mask'][:, 1:] is set (their count is the
    LOSS_DENOMINATOR, so a microbatched step gives the whole batch's token mean).

    batch: 'tokens' int32 [B, T], 'attention_mask' [B, T] and 'loss_mask' [B, T] (1 where the token is a target).
    """
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    loss = jnp.sum(nll * mask) / jnp.maximum(mask.sum(), 1.0)
    return loss, {"tokens": mask.sum(), LOSS_DENOMINATOR: mask.sum()}

