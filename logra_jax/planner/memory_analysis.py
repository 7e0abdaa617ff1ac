"""Per-device memory of one RL train step at real model sizes, compile-only (nothing is allocated).

The model and optimizer state exist only as shapes (`jax.eval_shape`); the step — the same `make_train_step`
the training loop runs, with the REINFORCE + TIS objective of `logra_jax.rl.objective` — is lowered from abstract
sharded inputs and compiled for the mesh, and XLA's analysis gives per-device bytes
  total = argument + output + temp − alias        (`step_memory`, for any step and init function).
`build_rl_step` gives the same step — built as the job builds its own (`logra_jax.job.phases.init_train_state`,
`rl_train_step`) — with real arrays (experiments/device/step_check.py runs it on a GPU).
Used by experiments/memory/run.py and colab/memory_analysis.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from logra_jax.job.phases import init_train_state, rl_train_step
from logra_jax.job.run_config import OptimizerSection
from logra_jax.job.train_step import TrainState, step_shardings
from logra_jax.models.config import ModelConfig
from logra_jax.models.decoder import init_model
from logra_jax.parallel import sharding as shd
from logra_jax.planner.hlo_cost import hlo_cost
from logra_jax.rl.losses import LossConfig
from logra_jax.rl.objective import probe_batch_shapes, rl_batch_shapes


def options_for(platform: str, compiler_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`compiler_options` for a compile on `platform`: off CPU, without the XLA:CPU options of
    `sharding.FAST_CPU_COMPILE` (found by name, in any mapping); None when nothing is left.

    >>> options_for("tpu", {**shd.FAST_CPU_COMPILE, "xla_dump_to": "/tmp/d"})
    {'xla_dump_to': '/tmp/d'}
    """
    if not compiler_options:
        return None
    if platform == "cpu":
        return dict(compiler_options)
    return {k: v for k, v in compiler_options.items() if k not in shd.FAST_CPU_COMPILE} or None


def step_memory(step: Callable[..., Any], init_fn: Callable[[], tuple[Any, Any]], abstract_batch: Any,
                mesh: jax.sharding.Mesh, rules: shd.LogicalRules = shd.DEFAULT_RULES, *,
                compiler_options: Mapping[str, Any] | None = None, with_cost: bool = False) -> dict[str, int]:
    """Per-device bytes of one sharded train step, compile-only: nothing is allocated.

    The mesh may hold compile-only TPU or GPU devices (`logra_jax.planner.aot.mesh`): then that chip's compiler
    plans the
    step (and the Pallas kernels are chosen for it), and a step that does not fit its memory raises the
    compiler's error.

    The state and `rest` get `logra_jax.job.train_step.step_shardings` (parameters by their logical axes; optimizer
    state and sketch probes follow their kernels, LoGRA's by the targets' declared dims), the batch
    `batch_shardings`; the step is jitted with `jit_train_step`
    (state donated), lowered from `abstract_sharded` inputs and compiled, and XLA's memory analysis is read:
      total = argument + output + temp − alias        (alias: donated buffers the outputs reuse, counted once)

    Args:
      step: step(state, rest, batch) -> (state, metrics), e.g. from `logra_jax.job.train_step.make_train_step`.
      init_fn: () -> (TrainState, rest); only traced (`jax.eval_shape`).
      abstract_batch: the global batch as ShapeDtypeStructs.
      mesh, rules: the mesh and logical rules the step is sharded with.
      compiler_options: XLA options for the compilation (e.g. `FAST_CPU_COMPILE`; its XLA:CPU options, found by
        name in any mapping, are dropped when the mesh is not CPU; other options are kept).
      with_cost: also return the step's cost per device from its compiled HLO, every loop iteration counted
        (`logra_jax.planner.hlo_cost`): "flops", "matmul_flops", "bytes_accessed", "collective_bytes",
        "unknown_trip_counts" and "uncounted_custom_calls" (how many loops counted once, how many kernels
        without a declared cost); and the compiler's own `cost_analysis()` as "xla_flops" /
        "xla_bytes_accessed" (loop bodies counted once; None where the compiler gives none, e.g. XLA:GPU).

    Returns:
      {"argument", "output", "temp", "alias", "total"} in bytes per device (and the cost entries).

    Example:
      >>> from collections import namedtuple
      >>> State = namedtuple("State", "params opt_state step")
      >>> mesh = shd.make_mesh(shd.MeshConfig(fsdp=1), jax.devices()[:1])
      >>> init = lambda: (State({"w": jax.numpy.zeros(256)}, (), jax.numpy.zeros((), "int32")), {})
      >>> step = lambda s, rest, b: (s._replace(step=s.step + 1), b.sum())
      >>> mem = step_memory(step, init, jax.ShapeDtypeStruct((4, 2), jax.numpy.float32), mesh)
      >>> mem["total"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"], mem["argument"] >= 1024
      (True, True)
    """
    compiler_options = options_for(mesh.devices.flat[0].platform, compiler_options)
    abstract_state, abstract_rest = jax.eval_shape(init_fn)
    state_sh, rest_sh = step_shardings(abstract_state, abstract_rest, mesh, rules)
    batch_sh = shd.batch_shardings(abstract_batch, mesh, rules)
    jitted = shd.jit_train_step(step, mesh, rules, in_shardings=(state_sh, rest_sh, batch_sh),
                                out_shardings=(state_sh, shd.replicated(mesh)), compiler_options=compiler_options)
    args = (shd.abstract_sharded(abstract_state, state_sh), shd.abstract_sharded(abstract_rest, rest_sh),
            shd.abstract_sharded(abstract_batch, batch_sh))
    compiled = jitted.lower(*args).compile()
    m = compiled.memory_analysis()
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes,
           "alias": m.alias_size_in_bytes}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    if with_cost:
        walked = hlo_cost(compiled.as_text())
        out.update(flops=int(walked.flops), matmul_flops=int(walked.matmul_flops),
                   bytes_accessed=int(walked.bytes_accessed), collective_bytes=int(walked.collective_bytes),
                   unknown_trip_counts=len(walked.unknown_trip_counts),
                   uncounted_custom_calls=len(walked.uncounted_custom_calls))
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        out["xla_flops"] = None if not cost or "flops" not in cost else int(cost["flops"])
        out["xla_bytes_accessed"] = None if not cost or "bytes accessed" not in cost else int(cost["bytes accessed"])
    return out


def build_rl_step(config: ModelConfig, optimizer: OptimizerSection, data_parallel: int, *, seq_len: int = 4096,
                  prompt_len: int = 512, rows_per_device: int = 1, logprob_chunk: int = 512,
                  return_updates: bool = False
                  ) -> tuple[Callable[[], tuple[TrainState, nnx.State]], Callable[..., Any], dict[str, Any]]:
    """The training loop's RL step for `optimizer` on `config`: (init, step, abstract batch).

    init() -> (TrainState, rest) builds the model and optimizer state (trace it with `jax.eval_shape` for shapes
    only, or jit and call it for real arrays); step(state, rest, batch) -> (state, metrics) is `make_train_step`
    with the REINFORCE + TIS objective; batch holds `rows_per_device · data_parallel` sequences of `seq_len`
    tokens (`prompt_len` of them prompt) and, with optimizer.kl_control, the predicted-KL probe under "probe"
    (`optimizer.probe_responses` sequences, rounded up to a multiple of `data_parallel`) beside "main".
    With `return_updates` the step also returns the update tree the loop syncs to the rollout engine.
    """
    built: dict[str, Any] = {}

    def init() -> tuple[TrainState, nnx.State]:
        built["plan"], built["graphdef"], state, rest = init_train_state(optimizer, init_model(config))
        return state, rest

    jax.eval_shape(init)  # traced once: the plan and graph definition exist, no array is allocated
    plan = built["plan"]
    step = rl_train_step(built["graphdef"], plan, LossConfig(policy="reinforce", tis_cap=2.0), prompt_len,
                         logprob_chunk=logprob_chunk, return_updates=return_updates)
    batch = rl_batch_shapes(rows_per_device * data_parallel, prompt_len, seq_len - prompt_len)
    if plan.kl_probe is None:
        return init, step, batch
    # predicted-KL control: the step also reads the probe responses (as the loop's `_probe_batch` builds them)
    probe = probe_batch_shapes(-(-optimizer.probe_responses // data_parallel) * data_parallel, seq_len)
    return (init, lambda state, rest, b: step(state, rest, b["main"], probe=b["probe"]),
            {"main": batch, "probe": probe})


def rl_step_memory(config: ModelConfig, optimizer: OptimizerSection, mesh: jax.sharding.Mesh, *,
                   seq_len: int = 4096, prompt_len: int = 512, rows_per_device: int = 1, logprob_chunk: int = 512,
                   compiler_options: Mapping[str, Any] | None = shd.FAST_CPU_COMPILE,
                   with_cost: bool = False) -> dict[str, int]:
    """Per-device bytes of one train step of `optimizer` on `config` over `mesh`.

    Args:
      config: the model (e.g. `preset("qwen2.5-7b", dtype="bfloat16", remat="full")`).
      optimizer: as in a run config (adamw, galore, adafactor, logra dense-gradient or sketch-native).
      mesh: the device mesh (fake CPU devices are fine: only compilation happens).
      seq_len, prompt_len: tokens per sequence, of which the prompt; the rest is the scored response.
      rows_per_device: sequences per device in the (single-microbatch) step.
      logprob_chunk: token rows per chunk of the log-probs (no [T, V] logits).
        With optimizer.kl_control the step also probes the predicted KL on `optimizer.probe_responses`
        sequences (rounded up to a multiple of the mesh size).
      compiler_options: XLA options (default: cheap CPU code generation; buffer assignment is unaffected).
      with_cost: also return the step's per-device cost, loops counted (`step_memory`).

    Returns:
      {"argument", "output", "temp", "alias", "total"} in bytes per device.
    """
    init, step, batch = build_rl_step(config, optimizer, mesh.size, seq_len=seq_len, prompt_len=prompt_len,
                                      rows_per_device=rows_per_device, logprob_chunk=logprob_chunk)
    return step_memory(step, init, batch, mesh, compiler_options=compiler_options, with_cost=with_cost)
