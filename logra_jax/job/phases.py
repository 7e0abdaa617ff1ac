"""The main job's phases, built once for the job (logra_jax.job.train) and for its compile-only plan (logra_jax.plan).

  start        the mesh (`job_mesh`) and the model created or read straight into its shards (builders.build_model)
  warm start   the SFT step on the mesh (logra_jax.job.sft.sft_step)
  trainer      the optimizer state created in its shards from the weights (`Trainer`: init under jit with
               out_shardings, weights donated), or only its abstract shapes for a restore
  RL step      rollout (the engine of logra_jax.rollout.engine), KL reference log-probs (`reference_logprobs`),
               the train step (`Trainer.rl_step`, built by `rl_train_step`), policy sync, held-out evaluation
Each piece is a jitted function with explicit shardings, so that the job runs it and the plan lowers it from
abstract inputs: what the plan measures is what the job runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from logra_jax.job.optimizer_plan import OptimizerPlan, build_optimizer
from logra_jax.job.run_config import OptimizerSection, RunConfig, TrainSection
from logra_jax.job.train_step import TrainState, make_train_step, step_shardings
from logra_jax.models.config import ModelConfig
from logra_jax.models.moe import expert_id_dtype
from logra_jax.parallel.sharding import batch_shardings, jit_train_step, make_mesh, replicated
from logra_jax.rl.losses import LossConfig
from logra_jax.rl.objective import make_policy_loss_fn, probe_batch_shapes, response_logprobs, rl_batch_shapes


def job_mesh(train: TrainSection, devices: list[jax.Device] | None = None) -> Mesh:
    """The run's (data, fsdp, tensor) mesh: with a -1 axis over all `devices` (default `jax.devices()`), else over
    the first data × fsdp × tensor of them.

    Raises:
      ValueError: the sizes do not fit the devices (names the config fields, the sizes and the device count).
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = (train.mesh_data, train.mesh_fsdp, train.mesh_tensor)
    fixed = abs(sizes[0] * sizes[1] * sizes[2])
    names = (f"config.train.mesh_data × mesh_fsdp × mesh_tensor = {sizes[0]} × {sizes[1]} × {sizes[2]}")
    if -1 in sizes:
        if len(devices) % fixed:
            raise ValueError(f"{names}: the -1 axis takes the devices the others leave, but {len(devices)} devices "
                             f"are not a multiple of {fixed}")
    elif fixed > len(devices):
        raise ValueError(f"{names} = {fixed} devices, but this process sees {len(devices)} "
                         f"({jax.default_backend()})")
    else:
        devices = devices[:fixed]
    return make_mesh(train.mesh(), devices)


class RLStep(NamedTuple):
    """`Trainer.rl_step`'s product: fn(state, rest, batch, probe) -> (state, metrics, updates), jitted with its
    shardings; the batch's shapes (ShapeDtypeStructs); the KL probe's shapes, None without the predicted-KL probe."""

    fn: Callable[..., tuple[TrainState, dict[str, jax.Array], Any]]
    batch: dict[str, jax.ShapeDtypeStruct]
    probe: dict[str, jax.ShapeDtypeStruct] | None


def rollout_experts(config: ModelConfig, engine: str) -> tuple[int, int, Any] | None:
    """(MoE layers, k, dtype) of the expert ids the rollouts of `engine` carry for a model of `config`
    (`Rollout.experts`: the JAX engine records them for an MoE model), None when they carry none."""
    if not config.moe or engine != "jax":
        return None
    return config.num_layers // config.moe_layer_step, config.experts_per_token, expert_id_dtype(config.num_experts)


def init_train_state(optimizer: OptimizerSection, model: nnx.Module, *, temperature: float = 1.0
                     ) -> tuple[OptimizerPlan, nnx.GraphDef, TrainState, nnx.State]:
    """The optimizer for `model` (`build_optimizer`, which attaches LoGRA's sketch probes when it needs them) and
    the train state it starts from: (plan, graph definition, TrainState at step 0, the non-Param state)."""
    plan = build_optimizer(optimizer, model, temperature=temperature)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return plan, graphdef, TrainState(params, plan.tx.init(params), jnp.zeros((), jnp.int32)), rest


def rl_train_step(graphdef: nnx.GraphDef, plan: OptimizerPlan, loss: LossConfig, prompt_len: int, *,
                  microbatches: int = 1, temperature: float = 1.0, logprob_chunk: int | None = None,
                  return_updates: bool = True, routing_replay: bool = False) -> Callable[..., tuple[Any, ...]]:
    """The RL train step, not jitted: `make_train_step` with the policy loss `loss` on the responses after
    `prompt_len` prompt tokens (log-probs at `temperature`, `logprob_chunk` token rows at a time; None:
    `make_policy_loss_fn`'s default; routing_replay: route by the batch's `experts`) and the plan's gradient mode,
    trainable parameters and KL probe. A batch with `experts` (an MoE rollout) also reports the routing metrics."""
    chunk = {} if logprob_chunk is None else {"chunk": logprob_chunk}
    loss_fn = make_policy_loss_fn(loss, prompt_len, temperature=temperature, routing_replay=routing_replay, **chunk)
    return make_train_step(graphdef, loss_fn, plan.tx, mode=plan.mode, microbatches=microbatches,
                           trainable=plan.trainable, kl_probe=plan.kl_probe, return_updates=return_updates)


@dataclasses.dataclass
class Trainer:
    """The optimizer of a run on its mesh: the plan, the split model, the train state's abstract shapes and
    shardings, and the jitted functions that create it and step it.

    Built from the model (real or abstract, `nnx.eval_shape`): `init(params, rest)` creates the TrainState and
    the non-Param state (LoGRA's sketch probes) directly in their shards, the weights donated; `rest_only()` the
    non-Param state alone; `abstract_state` with `state_sh` is what a checkpoint is restored into (nothing
    materialised first).
    """

    plan: OptimizerPlan
    graphdef: nnx.GraphDef
    abstract_state: TrainState
    abstract_rest: nnx.State
    state_sh: TrainState
    rest_sh: nnx.State
    init: Callable[[nnx.State, nnx.State], tuple[TrainState, nnx.State]]
    rest_only: Callable[[], nnx.State]

    @classmethod
    def build(cls, run: RunConfig, model: nnx.Module, mesh: Mesh) -> Trainer:
        model_graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        built: dict[str, Any] = {}

        def init(params: nnx.State, rest: nnx.State) -> tuple[TrainState, nnx.State]:
            built["plan"], built["graphdef"], state, r = init_train_state(
                run.optimizer, nnx.merge(model_graphdef, params, rest), temperature=run.rollout.temperature)
            return state, r

        abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
        abstract_state, abstract_rest = jax.eval_shape(init, abstract(params), abstract(rest))
        state_sh, rest_sh = step_shardings(abstract_state, abstract_rest, mesh)
        zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), t)
        return cls(plan=built["plan"], graphdef=built["graphdef"], abstract_state=abstract_state,
                   abstract_rest=abstract_rest, state_sh=state_sh, rest_sh=rest_sh,
                   init=jax.jit(init, out_shardings=(state_sh, rest_sh), donate_argnums=0),
                   # the probes and digests alone (a resumed run's weights come from its checkpoint)
                   rest_only=jax.jit(lambda: init(zeros(abstract(params)), zeros(abstract(rest)))[1],
                                     out_shardings=rest_sh))

    def model(self, params: nnx.State | None = None, rest: nnx.State | None = None) -> nnx.Module:
        """The model with the optimizer's hooks: on `params` / `rest`, or abstract (for a Sampler's graph)."""
        return nnx.merge(self.graphdef, self.abstract_state.params if params is None else params,
                         self.abstract_rest if rest is None else rest)

    def rl_step(self, run: RunConfig, mesh: Mesh, prompt_len: int) -> RLStep:
        """The RL train step with the run's objective, microbatches and KL probe, jitted and sharded on `mesh`,
        with the shapes of its inputs (`RLStep`): an MoE model's rollouts from the JAX engine bring their expert
        ids (`Rollout.experts`), replayed under rollout.routing_replay, measured always.

        Raises:
          ValueError: rollout.routing_replay with a dense model.
        """
        plan = self.plan
        experts = rollout_experts(self.model().config, run.rollout.engine)
        if run.rollout.routing_replay and experts is None:
            raise ValueError(f"config.rollout.routing_replay = True: the model "
                             f"({self.model().config.architecture!r}) has no experts to replay")
        train_step = rl_train_step(self.graphdef, plan, run.algorithm.loss(run.rollout.max_new_tokens), prompt_len,
                                   microbatches=run.train.microbatches, temperature=run.rollout.temperature,
                                   routing_replay=run.rollout.routing_replay)
        n_rows = run.rollout.prompts_per_step * run.rollout.num_samples
        batch = rl_batch_shapes(n_rows, prompt_len, run.rollout.max_new_tokens, with_ref=run.algorithm.kl_beta > 0,
                                experts=experts,
                                with_tis_cap=bool(run.rollout.max_stale_kl) and run.rollout.stale_action == "clip")
        probe = None if plan.kl_probe is None else probe_batch_shapes(
            run.optimizer.probe_responses, prompt_len + run.rollout.max_new_tokens)
        batch_sh = batch_shardings(batch, mesh)
        probe_sh = None if probe is None else batch_shardings(probe, mesh)
        step_fn = jit_train_step(
            lambda st, rs, b, pr: train_step(st, rs, b, **({} if pr is None else {"probe": pr})), mesh,
            in_shardings=(self.state_sh, self.rest_sh, batch_sh, probe_sh),
            out_shardings=(self.state_sh, replicated(mesh), None))
        return RLStep(step_fn, batch, probe)


def reference_logprobs(trainer: Trainer, run: RunConfig, mesh: Mesh, prompt_len: int
                       ) -> Callable[[nnx.State, nnx.State, Mapping[str, jax.Array]], jax.Array]:
    """jitted (reference params, rest, batch) -> per-token log-probs of the responses under the reference policy
    (the KL penalty's), sharded like the trainer's weights and the batch rows."""
    batch = rl_batch_shapes(run.rollout.prompts_per_step * run.rollout.num_samples, prompt_len,
                            run.rollout.max_new_tokens)
    batch_sh = batch_shardings({k: batch[k] for k in ("tokens", "attention_mask")}, mesh)
    return jit_train_step(
        lambda ref, rest, b: response_logprobs(trainer.model(ref, rest), b["tokens"], b["attention_mask"],
                                               prompt_len, temperature=run.rollout.temperature),
        mesh, in_shardings=(trainer.state_sh.params, trainer.rest_sh, batch_sh), out_shardings=None,
        donate_argnums=())
