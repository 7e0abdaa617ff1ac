"""The whole job's memory, phase by phase, compile-only for a named target: run it before renting accelerators.

  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=v5e:2x4
  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=cpu:8 --hbm_gib=16

Every phase of `logra_jax.job.train` is built by the same code the job runs (logra_jax.job.phases, logra_jax.job.sft,
logra_jax.rollout), lowered from abstract sharded inputs (nothing is allocated) and compiled for the target's
devices (logra_jax.planner.aot: the TPU compiler for v4/v5e/v5p/v6e, XLA:GPU for h100/h200/a100, each in its own venv;
fake XLA:CPU devices for cpu:N). A phase's per-device bytes are its program's (argument + output + temp − alias,
`compiled.memory_analysis()`) plus what the job keeps alive beside it and the program does not take:
  start         the weights created (or read) into their shards
  warm start    the SFT step: weights, AdamW moments, batch (only with sft.steps > 0)
  trainer init  the optimizer state created from the donated weights
  rollout       the colocated engine's largest program (its prefill into slots, or a decode chunk over the whole
                cache; compute-dtype weights in the decode layout, KV cache of rollout.slots rows) + the train
                state and any reference beside it
  KL reference  the reference policy's log-probs (only with algorithm.kl_beta > 0)
  train step    the RL step with its KL probe + the engine's weights and any reference
  policy sync   the engine's publish: the trainer's weights cast and resharded into the decode layout, beside the
                train state and the reference (the engine drops its previous copy first)
  evaluation    the engine's greedy decoding of prompts_per_step × num_samples held-out prompts
With rollout.engine_devices = k (the engine on the last k of the n devices, `placement_meshes`) the trainer's
phases (start, warm start, trainer init, KL reference, train step) are planned on the other n − k and the engine's
(rollout, evaluation) on a decode mesh of the k, as the engine there holds the weights (`SplitEngine`: the
trainer's masters in its weight dtype, decoded from as they are), with no train state beside them and no engine
copy beside the train step; the policy sync is then the low-rank payload moved to the engine and merged into its
masters there (`rl_step_time`: the sequential and the pipelined step).
The largest is named. Exit status 0 when every phase fits the HBM (`--hbm_gib`, default the target's per-device
HBM), 3 when one does not (naming it and what to change), 2 for bad flags, 1 for other errors. A phase that the
TPU compiler refuses for memory is reported with the bytes the compiler asked for.
Not counted: the host (a checkpoint is read one layer's slice of one parameter at a time), the rollout
worker process of rollout.workers = 1 (its own devices), the framework's own reservations on the device; on the
split placement the payload's JSON header and the weight fingerprints both ends take per update (one read of the
weights each).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.core.tree_paths import flat_params
from logra_jax.parallel.sharding import device_bytes

GIB = 2**30
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# libtpu's out-of-HBM reports (XLA:GPU and XLA:CPU compile whatever the size).
_OOM = (re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm"),
        re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"))


def parse_oom(message: str) -> tuple[int, int] | None:
    """(required, available) bytes from the TPU compiler's out-of-HBM error, or None if it is not one.

    Example:
      >>> parse_oom("Ran out of memory in memory space hbm. Used 32.78G of 15.75G hbm. Exceeded hbm capacity")
      (35197256991, 16911433728)
    """
    for pattern in _OOM:
        found = pattern.search(message)
        if found:
            return (round(float(found[1]) * _UNITS[found[2]]), round(float(found[3]) * _UNITS[found[4]]))
    return None


@dataclasses.dataclass
class PhaseBytes:
    """One phase's per-device bytes: its program's (`program`: argument/output/temp/alias/total, or the bytes the
    TPU compiler asked for when it refused) and what stays alive beside it (`others`)."""

    name: str
    program: dict[str, int]
    others: int
    note: str = ""
    refused: str = ""  # the compiler's out-of-memory message, when it refused the program
    # Time on paper (`PhaseTime.of`): the program's cost per device and its estimated seconds per run; None when
    # the compiler refused it.
    time: dict[str, Any] | None = None
    per_decode_step: dict[str, Any] | None = None  # the engine's phases: one decode step over every slot
    devices: int = 0  # the devices its programs run on (the trainer's mesh, or the engine's)

    @property
    def total(self) -> int:
        return self.program["total"] + self.others


def program_time(compiled: Any, info: Any, floor_bytes: float, runs: float = 1.0,
                 loop_iterations: int | None = None) -> dict[str, Any]:
    """One program's cost per device from its optimized HLO (`logra_jax.planner.hlo_cost`: every loop iteration
    counted),
    and its estimated seconds on `info`'s chip (`logra_jax.planner.aot.roofline`: max(flops / peak, HBM bytes /
    bandwidth)
    + collective bytes / link bandwidth), times `runs`; est_seconds None for a CPU target (no published figures).
    floor_bytes: the HBM bytes the program cannot do without (its bandwidth floor; a count below it is clamped at
    it, the count kept as counted_hbm_bytes). loop_iterations = k: the cost
    of one iteration of the program's loop whose trip count only the run knows (a decode chunk's steps), with the
    work outside it spread over k iterations."""
    from logra_jax.planner import aot
    from logra_jax.planner.hlo_cost import hlo_cost

    cost = hlo_cost(compiled.as_text())
    flops, hbm, coll = cost.flops, cost.bytes_accessed, cost.collective_bytes
    if loop_iterations:
        loop = cost.unknown_loop_iteration
        flops, hbm, coll = (part + (whole - part) / loop_iterations
                            for part, whole in zip(loop, (flops, hbm, coll)))
    # A count below the floor (libtpu keeps small loop-invariant weight stacks in VMEM across a decode chunk's
    # steps: read once per chunk) is clamped at the floor; both are kept.
    out = {"flops": flops, "hbm_bytes": max(hbm, float(floor_bytes)), "counted_hbm_bytes": hbm,
           "collective_bytes": coll, "floor_bytes": float(floor_bytes), "runs": runs, "est_seconds": None,
           "floor_seconds": None}
    if info is not None and info.hbm_bandwidth is not None and info.peak_bf16_flops is not None:
        roof = aot.roofline(flops, out["hbm_bytes"], coll, info)
        out.update(est_seconds=runs * roof.seconds, floor_seconds=runs * floor_bytes / info.hbm_bandwidth,
                   bound=roof.bound)
    return out


# The parts of `program_time`'s result that add up over the programs (and runs) of a phase.
_SUMMED = ("flops", "hbm_bytes", "counted_hbm_bytes", "collective_bytes", "floor_bytes", "est_seconds",
           "floor_seconds")


def _summed_times(parts: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """Σ runs · time[k] over (time, runs) pairs for each summed part k; None where a part's is unknown."""
    return {k: None if any(t[k] is None for t, _ in parts) else sum(t[k] * n for t, n in parts) for k in _SUMMED}


def _global_bytes(tree: Any) -> int:
    """Bytes of a tree's arrays over all devices together (`device_bytes` of the unsharded shapes)."""
    return device_bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree))


def _io_bytes(program: dict[str, int]) -> int:
    """A program's arguments and outputs, each touched once: the floor of its HBM traffic."""
    return program.get("argument", 0) + program.get("output", 0) - program.get("alias", 0)


def compiled_bytes(jitted: Any, *args: Any, **kwargs: Any) -> tuple[dict[str, int], str, Any]:
    """Lower and compile `jitted` from abstract `args`: (its per-device bytes, "", the compiled program) — or, when
    the TPU compiler refuses it for memory, ({"total": required bytes}, the compiler's message, None); where the
    compiler reports only the temporaries it needs, the arguments' bytes are added."""
    try:
        compiled = jitted.lower(*args, **kwargs).compile()
        m = compiled.memory_analysis()
    except Exception as err:  # the compiler's refusal is the measurement
        oom = parse_oom(str(err))
        if oom is None:
            raise
        arguments = device_bytes(args) if "temporaries" in str(err) else 0
        return ({"temp": oom[0], "argument": arguments, "total": oom[0] + arguments},
                next(line for line in str(err).splitlines() if "hbm" in line.lower()), None)
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes,
           "alias": m.alias_size_in_bytes}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out, "", compiled


def planning_config(config: Mapping[str, Any]) -> Any:
    """The RunConfig to plan: a config whose checkpoint or data files are not given yet (the paper's recipe before
    downloading) is planned with random weights of its preset and a placeholder task (memory depends on shapes,
    lengths and batch sizes, not on the data)."""
    from logra_jax.job.run_config import RunConfig

    d = json.loads(json.dumps(dict(config.to_dict() if hasattr(config, "to_dict") else config)))
    if not d["model"].get("checkpoint"):
        d["model"]["tokenizer"] = "char"
    if d["task"].get("kind") == "jsonl" and not (d["task"].get("jsonl_train") and d["task"].get("jsonl_eval")):
        d["task"].update(kind="arithmetic", jsonl_train="", jsonl_eval="")
    return RunConfig.from_dict(d)


def placement_meshes(run: Any, devices: Collection[Any]) -> tuple[Any, Any]:
    """(the trainer's mesh, the engine's devices as a mesh, or None) of `run` over `devices`: colocated
    (rollout.engine_devices = 0) the job's mesh over all of them (`phases.job_mesh`); with engine_devices = k the
    trainer's mesh over the first n − k (train.mesh_* as the job reads them, a -1 axis taking what is left) and the
    last k for the engine (its decode mesh is `SplitEngine`'s).

    Raises:
      ValueError: k ≥ n (no device left for the trainer), or train.mesh_* that do not fit the n − k (named).
    """
    from logra_jax.job.phases import job_mesh
    from logra_jax.parallel.sharding import MeshConfig, make_mesh

    devices, k = list(devices), run.rollout.engine_devices
    if not k:
        return job_mesh(run.train, devices), None
    if k >= len(devices):
        raise ValueError(f"config.rollout.engine_devices = {k} leaves none of the {len(devices)} devices to the "
                         f"trainer: it must be below {len(devices)}")
    return job_mesh(run.train, devices[:len(devices) - k]), make_mesh(MeshConfig(fsdp=k), devices[len(devices) - k:])


class SplitEngine:
    """The engine on devices of its own (rollout.engine_devices = k), as `logra_jax.rollout.worker`'s
    `InProcessTransport` holds it: its `RolloutWeights` are the trainer's model state in the trainer's dtypes (the
    matrices in optimizer.weight_dtype: masters kept bitwise equal to the trainer's by the low-rank payloads),
    sharded in the decode layout (data = k / t, fsdp = 1, tensor = t) over the k devices, and its sampler decodes
    from them as they are (the decoder casts each matrix to the compute dtype at its use): no compute-dtype copy.
    With `decode_copy` (what the job's `logra_jax.rollout.engine.DeviceEngine` does; the CLI's default) it also
    keeps the matrices in the compute dtype (`rollout.engine.decode_config`, layers stacked), rebuilt from the
    masters after each merge, and decodes from those. The attributes `_engine_phase` reads of a `DecodeLayout`
    (mesh, graphdef, tensor, config), the state it decodes from (`abstract`), the masters and the bytes per device
    the masters add beside the copy (`beside`).

    Args:
      model_config: the trainer's model config (its param_dtype is the trainer's weight dtype).
      devices_mesh: a mesh over the engine's k devices (`placement_meshes`).
      tensor: t (rollout.decode_tensor; 0: `default_decode_tensor` of the k devices).
      decode_copy: also keep a compute-dtype copy to decode from.
    """

    def __init__(self, model_config: Any, devices_mesh: Any, tensor: int = 0, decode_copy: bool = False):
        from logra_jax.models.decoder import abstract_model
        from logra_jax.parallel.sharding import abstract_sharded, param_shardings
        from logra_jax.rollout.engine import decode_config, decode_mesh, default_decode_tensor

        self.tensor = tensor or default_decode_tensor(model_config, devices_mesh)
        self.mesh = decode_mesh(devices_mesh, self.tensor)
        self.decode_copy = decode_copy
        self.config = decode_config(model_config, per_layer=False) if decode_copy else model_config

        def sharded(config: Any) -> tuple[Any, Any]:
            graphdef, state = nnx.split(abstract_model(config))
            return graphdef, abstract_sharded(state, param_shardings(state, self.mesh))

        _, self.masters = sharded(model_config)
        self.graphdef, self.abstract = sharded(self.config)
        copy = flat_params(self.abstract)
        self.beside = sum(device_bytes(x) for p, x in flat_params(self.masters).items()
                          if copy[p].dtype != x.dtype) if decode_copy else 0


@dataclasses.dataclass
class _Job:
    """The objects the job builds, abstract and sharded, that every phase's plan reads: the model and trainer, the
    train state, the KL reference, the engine's decode layout and the leaves the engine holds beside the trainer's,
    and the compile function."""

    run: Any
    mesh: Any
    prompt_len: int
    jit: Callable[..., Any]
    model: Any
    params: Any
    rest: Any
    trainer: Any
    state: Any
    trainer_rest: Any
    ref: Any
    layout: Any
    engine: Any
    engine_copied: int
    engine_shared: int
    info: Any = None  # the target's TargetInfo (chip figures for the time on paper)

    @property
    def split(self) -> bool:
        """The engine on devices of its own (rollout.engine_devices > 0): nothing of the trainer's beside it."""
        return isinstance(self.layout, SplitEngine)

    def alive(self, *names: str) -> int:
        """Per-device bytes of what the job keeps: "state" (train state + the model's other state), "ref" (the KL
        reference), "engine" (the engine's own copies, not the trainer leaves it shares)."""
        sizes = {"state": device_bytes((self.state, self.trainer_rest)),
                 "ref": 0 if self.ref is None else device_bytes(self.ref), "engine": self.engine_copied}
        return sum(sizes[n] for n in names)


def _job(run: Any, mesh: Any, prompt_len: int, compiler_options: Mapping[str, Any] | None, info: Any,
         engine_mesh: Any = None, decode_copy: bool = False) -> _Job:
    from logra_jax.job.builders import build_model
    from logra_jax.job.phases import Trainer
    from logra_jax.parallel.sharding import abstract_sharded, param_shardings
    from logra_jax.rollout.engine import DecodeLayout

    options = None if compiler_options is None else dict(compiler_options)
    jit = lambda f, **kw: jax.jit(f, compiler_options=options, **kw)
    model, _ = build_model(run.model, mesh, weights=False)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params = abstract_sharded(params, param_shardings(params, mesh))
    rest = abstract_sharded(rest, param_shardings(rest, mesh))
    trainer = Trainer.build(run, model, mesh)
    state = abstract_sharded(trainer.abstract_state, trainer.state_sh)
    trainer_rest = abstract_sharded(trainer.abstract_rest, trainer.rest_sh)
    # The reference is stored as the trainer stores its weights (train.py), so it is the state's params' shapes.
    ref = state.params if run.algorithm.kl_beta > 0 else None
    layout = engine = None
    copied = shared_bytes = 0
    if engine_mesh is not None:  # the engine on devices of its own: the trainer's masters there, nothing shared
        layout = SplitEngine(trainer.model().config, engine_mesh, run.rollout.decode_tensor, decode_copy)
        engine = layout.abstract
    elif run.rollout.workers == 0:  # the colocated engine, in its decode layout, built from the trainer's model
        layout = DecodeLayout(trainer.model().config, mesh, run.rollout.decode_tensor, run.rollout.per_layer)
        shared, to_copy = layout.split({**flat_params(trainer_rest), **flat_params(state.params)})
        engine = layout.abstract
        copied, shared_bytes = layout.device_bytes(to_copy), layout.device_bytes(shared)
    return _Job(run, mesh, prompt_len, jit, model, params, rest, trainer, state, trainer_rest, ref, layout, engine,
                copied, shared_bytes, info)


def _prompts(job: _Job, rows: int, mesh: Any) -> tuple[Any, Any]:
    from logra_jax.parallel.sharding import abstract_sharded, batch_shardings

    prompts = jax.ShapeDtypeStruct((rows, job.prompt_len), jnp.int32)
    prompts = abstract_sharded(prompts, batch_shardings(prompts, mesh))
    return prompts, _mask(prompts)


def _timed(job: _Job, name: str, compiled_result: tuple[dict[str, int], str, Any], others: int, note: str,
           runs: float = 1.0, mesh: Any = None) -> PhaseBytes:
    """A phase of one program (`compiled_bytes`' result) with its time on paper (floor: its arguments and outputs
    touched once), `runs` times per run of the phase."""
    program, refused, compiled = compiled_result
    time = None if compiled is None else program_time(compiled, job.info, _io_bytes(program), runs)
    return PhaseBytes(name, program, others, note, refused, time, devices=(mesh or job.mesh).devices.size)


def _engine_phase(job: _Job, name: str, sampling: Any, prompts: int, others: int, note: str) -> PhaseBytes:
    """A phase run by the engine (logra_jax.rollout.slots) for `prompts` prompts under `sampling`: its programs
    start, refill (the prefill of K prompts into slots) and one decode chunk attending over the whole cache; the
    phase's bytes are the largest program's. Time on paper: every response at its budget N (an upper bound), so
    the rows run in ⌈R / S⌉ waves of one refill and N decode steps; per decode step the decode program's cost (one
    iteration of its while loop, whose trip count the compiler cannot know, and the chunk's work outside the loop
    spread over its decode_steps) against the bandwidth floor (`decode_floor`: the weights an S-row step reads +
    the KV cache read, over the devices)."""
    from logra_jax.parallel.sharding import abstract_sharded
    from logra_jax.rollout import slots as slots_lib

    mesh, graphdef, state = job.layout.mesh, job.layout.graphdef, job.engine
    prompt_arr, mask = _prompts(job, prompts, mesh)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rows = prompts * sampling.num_samples
    S, K = slots_lib.num_slots(sampling, rows), slots_lib.prefill_lanes(sampling, prompts, rows)
    held = f"engine weights (decode layout, tensor {job.layout.tensor})"
    if job.split:
        what = ("its copy in " if job.layout.decode_copy else "the trainer's masters in ")
        held = (f"{what}{job.layout.config.param_dtype} (decode layout over the engine's {mesh.devices.size} "
                f"devices, tensor {job.layout.tensor})" + (", the masters beside it" if job.layout.decode_copy else ""))
    note = f"{note}, {S} slots; {held} + KV cache"
    largest, refused, compiled = compiled_bytes(slots_lib.start, graphdef, state, prompt_arr, mask, config=sampling,
                                                num_slots=S, mesh=mesh)
    if compiled is None:
        return PhaseBytes(name, largest, others, note, refused, devices=mesh.devices.size)
    out = jax.eval_shape(lambda s, p, m: slots_lib.start(graphdef, s, p, m, config=sampling, num_slots=S, mesh=mesh),
                         state, prompt_arr, mask)
    slots, packed, packed_mask = abstract_sharded(out, compiled.output_shardings)
    lane = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)
    refill_bytes, refused, refill = compiled_bytes(slots_lib.refill, graphdef, state, slots, packed, packed_mask,
                                                   lane(K), lane(S), lane(S), lane(S), config=sampling, mesh=mesh)
    largest = max(largest, refill_bytes, key=lambda b: b["total"])
    if refused:
        return PhaseBytes(name, largest, others, note, refused, devices=mesh.devices.size)
    decode_bytes, refused, decode = compiled_bytes(slots_lib.decode_program(slots), graphdef, state, slots, key,
                                                   config=sampling, bucket=job.prompt_len + sampling.max_new_tokens,
                                                   mesh=mesh)
    largest = max(largest, decode_bytes, key=lambda b: b["total"])
    if refused:
        return PhaseBytes(name, largest, others, note, refused, devices=mesh.devices.size)
    floor = decode_floor(graphdef, state, _global_bytes((slots.cache.k, slots.cache.v)), S, mesh.devices.size)
    step = {**program_time(decode, job.info, floor["floor_bytes"], loop_iterations=sampling.decode_steps), **floor}
    waves = -(-rows // S)
    prefill = program_time(refill, job.info, _io_bytes(refill_bytes), runs=waves)
    decode_steps = waves * sampling.max_new_tokens
    time = {**_summed_times([(step, decode_steps), (prefill, 1)]), "runs": 1, "decode_steps": decode_steps,
            "refills": waves}
    return PhaseBytes(name, largest, others, note, "", time, step, mesh.devices.size)


def expected_experts(num_experts: int, k: int, tokens: int) -> float:
    """The expected number of distinct experts `tokens` tokens choose in one MoE layer when each token picks k of
    the E experts uniformly at random (k distinct ones), independently of the others: E · (1 − (1 − k/E)^S), an
    expert being left out by one token with probability 1 − k/E.

    Uniform routing is an assumption (a trained router balanced by its auxiliary loss is close to it over many
    tokens; tokens of one sequence that share experts make fewer distinct ones, so the real count is at most this
    for a given marginal load, and a skewed load also lowers it).

    Example:
      >>> expected_experts(4, 2, 1), expected_experts(128, 8, 32) > 111
      (2.0, True)
    """
    if not (1 <= k <= num_experts) or tokens < 0:
        raise ValueError(f"expected_experts: need 1 <= k <= num_experts and tokens >= 0, got num_experts="
                         f"{num_experts}, k={k}, tokens={tokens}")
    return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


def expert_kernel_paths(model: nnx.Module) -> set[str]:
    """The paths (as `flat_params` names them) of `model`'s stacked expert kernels ([..., E, in, out],
    `logra_jax.models.moe.ExpertLinear`); empty for a dense model."""
    from logra_jax.models.moe import ExpertLinear

    return {".".join(map(str, (*path, "kernel"))) for path, node in nnx.iter_graph(model)
            if isinstance(node, ExpertLinear)}


def decode_floor(graphdef: Any, state: Any, kv_bytes: float, slots: int, devices: int) -> dict[str, Any]:
    """The HBM bytes per device one decode step of `slots` rows cannot do without: the weights it reads and the
    KV cache (`kv_bytes` over all devices), over the devices.

    A step reads every weight once, except two. The input embedding of an untied model ([V, D]; the head has a
    kernel of its own): a step gathers its S = `slots` tokens' rows, S·D elements, not the table. The experts of
    a mixture of experts: in each MoE layer a step reads only the experts its S tokens chose, whose expected
    number under uniform routing is `expected_experts`(E, k, S) of E, so it reads that share of the expert
    kernels' bytes; the all-experts bound (every expert read) is given beside it.

    Args:
      graphdef, state: the engine's model (`nnx.split`; abstract leaves will do).
      kv_bytes: the KV cache's bytes over all devices.
      slots: rows per decode step (S).
      devices: the devices the weights and cache are spread over.

    Returns:
      {"floor_bytes": the floor, "floor_all_experts_bytes": the floor with every expert read, and for an MoE
      "experts_per_layer": E, "expected_experts_per_layer": the expected distinct experts of one step}.
    """
    model = nnx.merge(graphdef, state)
    leaves = flat_params(state)
    weights = _global_bytes(leaves)
    if not model.config.tie_embeddings:
        table = leaves["embed.embedding"]
        weights -= _global_bytes(table) - min(slots, table.shape[0]) * table.shape[1] * table.dtype.itemsize
    out = {"floor_all_experts_bytes": (weights + kv_bytes) / devices}
    experts = expert_kernel_paths(model)
    if not experts:
        return {"floor_bytes": out["floor_all_experts_bytes"], **out}
    E, k = model.config.num_experts, model.config.experts_per_token
    chosen = expected_experts(E, k, slots)
    expert_bytes = _global_bytes({p: leaves[p] for p in experts})
    read = weights - expert_bytes + expert_bytes * chosen / E
    return {"floor_bytes": (read + kv_bytes) / devices, **out, "experts_per_layer": E,
            "expected_experts_per_layer": chosen}


def _phase_start(job: _Job) -> PhaseBytes:
    from logra_jax.models.decoder import abstract_model, init_model
    from logra_jax.parallel.sharding import param_shardings

    config = job.model.config
    init_sh = param_shardings(nnx.split(abstract_model(config))[1], job.mesh)
    result = compiled_bytes(job.jit(lambda: nnx.split(init_model(config, job.run.model.init_seed))[1],
                                    out_shardings=init_sh))
    return _timed(job, "start", result, 0, "weights created in their shards (a checkpoint: read slice by slice, one "
                  "layer's slice of one parameter on the host)")


def _phase_warm_start(job: _Job) -> PhaseBytes:
    from logra_jax.job.sft import sft_step
    from logra_jax.parallel.sharding import abstract_sharded, batch_shardings

    run = job.run
    length = job.prompt_len + run.rollout.max_new_tokens
    graphdef = nnx.split(job.model, nnx.Param, ...)[0]
    step, sft_init, batch, sft_state_sh = sft_step(graphdef, job.params, job.rest, run.sft, job.mesh, length)
    sft_state = jax.eval_shape(sft_init, job.params)  # the warm start's own TrainState, shapes only
    result = compiled_bytes(step, abstract_sharded(sft_state, sft_state_sh), job.rest,
                            abstract_sharded(batch, batch_shardings(batch, job.mesh)))
    return _timed(job, "warm start", result, 0, f"SFT: AdamW on every weight, {run.sft.batch_size} sequences of "
                  f"{length} tokens, {run.sft.steps} steps", runs=run.sft.steps)


def _phase_trainer_init(job: _Job) -> PhaseBytes:
    return _timed(job, "trainer init", compiled_bytes(job.trainer.init, job.params, job.rest), 0,
                  f"{job.run.optimizer.name} state from the donated weights")


def _beside_engine(job: _Job) -> int:
    """What the job keeps beside the engine's programs on their devices: colocated, the train state and the
    reference less the leaves the engine shares; on devices of its own, nothing of the trainer's (the masters
    beside a decode copy: `SplitEngine.beside`)."""
    return job.layout.beside if job.split else job.alive("state", "ref") - job.engine_shared


def _engine_away(job: _Job) -> str:
    return "the engine on devices of its own" if job.split else "the engine has released its copy"


def _phase_rollout(job: _Job) -> PhaseBytes:
    run = job.run
    sampling = run.rollout.sampling(eos_id=0, pad_id=0)
    rows = run.rollout.prompts_per_step * sampling.num_samples
    return _engine_phase(job, "rollout", sampling, run.rollout.prompts_per_step, _beside_engine(job),
                         f"{rows} responses of ≤ {run.rollout.max_new_tokens} tokens")


def _phase_kl_reference(job: _Job) -> PhaseBytes:
    from logra_jax.job.phases import reference_logprobs
    from logra_jax.parallel.sharding import abstract_sharded, batch_shardings

    run, mesh = job.run, job.mesh
    ref_fn = reference_logprobs(job.trainer, run, mesh, job.prompt_len)
    rows = {k: v for k, v in job.trainer.rl_step(run, mesh, job.prompt_len).batch.items()
            if k in ("tokens", "attention_mask")}
    result = compiled_bytes(ref_fn, job.ref, job.trainer_rest, abstract_sharded(rows, batch_shardings(rows, mesh)))
    return _timed(job, "KL reference", result, job.alive("state"),
                  f"the reference policy's log-probs ({_engine_away(job)})")


def _train_step(job: _Job) -> tuple[Any, tuple[Any, ...], Any]:
    """(the job's jitted RL step, its abstract sharded arguments, the KL probe's shapes or None)."""
    from logra_jax.parallel.sharding import abstract_sharded, batch_shardings

    step_fn, batch, probe = job.trainer.rl_step(job.run, job.mesh, job.prompt_len)
    sharded = lambda tree: None if tree is None else abstract_sharded(tree, batch_shardings(tree, job.mesh))
    return step_fn, (job.state, job.trainer_rest, sharded(batch), sharded(probe)), probe


def _phase_train_step(job: _Job) -> PhaseBytes:
    run = job.run
    step_fn, args, probe = _train_step(job)
    result = compiled_bytes(step_fn, *args)
    probe_note = f", KL probe of {run.optimizer.probe_responses} responses" if probe is not None else ""
    rows = run.rollout.prompts_per_step * run.rollout.num_samples
    return _timed(job, "train step", result, job.alive("ref"),
                  f"{rows} sequences in {run.train.microbatches} microbatches{probe_note} ({_engine_away(job)})")


def _flat_updates(updates: Any) -> dict[str, Any]:
    """{path: leaf} of an update tree, a LowRankUpdate (or None, optax.MaskedNode) one leaf."""
    import optax

    from logra_jax.core.tree_paths import path_str
    from logra_jax.optim.lowrank import is_lowrank

    leaves = jax.tree_util.tree_leaves_with_path(
        updates, is_leaf=lambda x: x is None or is_lowrank(x) or isinstance(x, optax.MaskedNode))
    return {path_str(k): v for k, v in leaves}


def payload_bytes(updates: Any, dense: Collection[str] = ()) -> int:
    """Bytes of the arrays of one update's delta payload (`logra_jax.rollout.sync.delta_payload`): each low-rank
    factor as it ships (bfloat16 when its spec rounds to bf16, else float32) and its decay scalar, and the dense
    update of each path in `dense` (the trained non-targets); the JSON header (targets' metadata, fingerprints)
    is not counted.

    Args:
      updates: the update tree the train step returns (arrays or ShapeDtypeStructs; LowRankUpdate leaves).
      dense: paths of the non-targets trained densely (`OptimizerPlan.dense_paths`).
    """
    from logra_jax.optim.lowrank import is_lowrank

    total = 0
    for path, u in _flat_updates(updates).items():
        if is_lowrank(u):
            total += u.factor.size * (2 if u.spec.round_bf16 else 4) + (0 if u.decay is None else 4)
        elif path in dense:
            total += u.size * jnp.dtype(u.dtype).itemsize
    return total


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def _phase_split_sync(job: _Job) -> PhaseBytes:
    """The policy sync of the engine on devices of its own: the update's low-rank payload (`payload_bytes`) moved
    from the trainer's devices to the engine's, then merged into the engine's masters by the receiver's own
    program (`RolloutWeights`: `optim.apply_updates` jitted into the masters' shardings, masters donated; the
    factors as they arrive, whole on every engine device). Its bytes are the merge program's on an engine device
    (nothing else is alive there between two rollouts); its time the merge's on paper + the transfer's, payload
    bytes / the target's per-device link bandwidth (`aot.TargetInfo.link_bandwidth`: the whole payload over one
    device's links, an upper bound where it is spread over several). With a decode copy, the cast that rebuilds
    it from the masters follows the merge (its bytes the larger program's, its time added to the merge's)."""
    from logra_jax.core.tree_paths import path_str
    from logra_jax.optim.lowrank import apply_updates, is_lowrank
    from logra_jax.parallel.sharding import replicated

    step_fn, args, _ = _train_step(job)
    updates = _flat_updates(jax.eval_shape(step_fn, *args)[2])
    dense = set(job.trainer.plan.dense_paths(job.state.params))
    whole = replicated(job.layout.mesh)
    arrived = lambda u: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), u)
    shipped = {p: arrived(u) for p, u in updates.items() if is_lowrank(u) or p in dense}
    masters = job.layout.masters
    tree = jax.tree_util.tree_map_with_path(lambda k, _: shipped.get(path_str(k)), masters)
    result = compiled_bytes(job.jit(apply_updates, donate_argnums=0, out_shardings=_shardings(masters)), masters,
                            tree)
    nbytes = payload_bytes(updates, dense)
    lowrank = sum(map(is_lowrank, shipped.values()))
    note = (f"the low-rank payload ({nbytes / 2**20:.1f} MiB: {lowrank} factors, {len(shipped) - lowrank} dense "
            "updates) to the engine's devices, merged into its masters there")
    phase = _timed(job, "policy sync", result, 0, note, mesh=job.layout.mesh)
    if job.layout.decode_copy and not phase.refused:  # then the copy rebuilt from the masters (the old one dropped)
        copy = job.layout.abstract
        cast = job.jit(lambda m: jax.tree.map(lambda x, c: x.astype(c.dtype), m, copy), out_shardings=_shardings(copy))
        recast = _timed(job, "policy sync", compiled_bytes(cast, masters), 0, f"{note}, then cast into its "
                        f"{job.layout.config.param_dtype} copy", mesh=job.layout.mesh)
        if recast.time is not None and phase.time is not None:
            recast.time = {**recast.time, **_summed_times([(phase.time, 1), (recast.time, 1)])}
        phase = recast if recast.total >= phase.total or recast.refused else dataclasses.replace(
            phase, note=recast.note, time=recast.time)
    if phase.time is not None:
        link = None if job.info is None else job.info.link_bandwidth
        transfer = None if link is None else nbytes / link
        apply = phase.time["est_seconds"]
        phase.time.update(payload_bytes=nbytes, transfer_seconds=transfer, apply_seconds=apply,
                          est_seconds=None if apply is None or transfer is None else apply + transfer)
    return phase


def _phase_policy_sync(job: _Job) -> PhaseBytes:
    """The engine's publish: the trainer's weights cast and resharded into the decode layout, group by group (the
    job's own programs, `DecodeLayout.groups` and `.cast`; the engine drops its previous copy first). Its bytes are
    those of the group whose program peaks highest beside the trainer's state, the reference and the engine
    weights the groups before it built; its time, all the groups'. The engine on devices of its own:
    `_phase_split_sync`."""
    if job.split:
        return _phase_split_sync(job)
    shared, to_copy = job.layout.split({**flat_params(job.trainer_rest), **flat_params(job.state.params)})
    groups = job.layout.groups(to_copy) or [{}]  # every leaf shared (one device, trainer's dtype): an empty program
    alive, built, worst, times = job.alive("state", "ref"), 0, None, []
    for group in groups:
        result = compiled_bytes(job.layout.cast(group), group)
        phase = _timed(job, "policy sync", result, alive - device_bytes(group) + built,
                       f"the trainer's weights cast to {job.layout.config.param_dtype} and resharded into the decode "
                       f"layout ({len(to_copy)} leaves in {len(groups)} programs; {len(shared)} shared as they are)")
        if worst is None or phase.total > worst.total:
            worst = phase
        if result[1]:  # refused for memory
            return phase
        times.append(phase.time)
        built += result[0]["output"]
    if len(times) > 1:  # the phase's time: every group's program once
        worst.time = {**worst.time, **_summed_times([(t, 1) for t in times])}
    return worst


def _phase_evaluation(job: _Job) -> PhaseBytes:
    run = job.run
    rows = run.rollout.prompts_per_step * run.rollout.num_samples
    return _engine_phase(job, "evaluation", run.rollout.sampling(eos_id=0, pad_id=0, greedy=True), rows,
                         _beside_engine(job),
                         f"greedy decoding of {rows} held-out prompts by the engine")


_PHASE_PLANS: dict[str, Callable[[_Job], PhaseBytes]] = {
    "start": _phase_start, "warm start": _phase_warm_start, "trainer init": _phase_trainer_init,
    "rollout": _phase_rollout, "KL reference": _phase_kl_reference, "train step": _phase_train_step,
    "policy sync": _phase_policy_sync, "evaluation": _phase_evaluation}


def plan_phases(run: Any, mesh: Any, prompt_len: int, *, compiler_options: Mapping[str, Any] | None = None,
                only: Collection[str] | None = None, info: Any = None, engine_mesh: Any = None,
                engine_decode_copy: bool = False, progress: Callable[[str], None] = lambda _: None
                ) -> list[PhaseBytes]:
    """Per-device bytes of every phase of `run`'s job on `mesh` (compile-only; see the module docstring).

    Args:
      run: the RunConfig.
      mesh: the trainer's mesh (`placement_meshes` over `aot.devices(target)`: colocated, the job's mesh).
      prompt_len: prompt tokens per sequence (the job measures it from its data; the paper's recipe: 512).
      compiler_options: XLA options for every compilation (e.g. `sharding.FAST_CPU_COMPILE` for XLA:CPU).
      only: the names of the phases to compile (default all; `PHASES`).
      info: the target's `aot.TargetInfo` (chip figures for each phase's time on paper; None: bytes only).
      engine_mesh: with rollout.engine_devices = k, a mesh over the engine's k devices (`placement_meshes`).
      engine_decode_copy: the engine on devices of its own also keeps a compute-dtype copy to decode from
        (as `DeviceEngine` does; `SplitEngine`).
      progress: called with each phase's name before it compiles.

    Raises:
      ValueError: an engine_mesh that is not rollout.engine_devices' (none for k > 0, one for k = 0, or another
        number of devices), or engine_decode_copy for k = 0.
    """
    k = run.rollout.engine_devices
    if (engine_mesh is None) != (k == 0) or (engine_mesh is not None and engine_mesh.devices.size != k):
        raise ValueError(f"plan_phases: config.rollout.engine_devices = {k} needs an engine_mesh of {k} devices "
                         f"(`placement_meshes`), got {None if engine_mesh is None else engine_mesh.devices.size}")
    if engine_decode_copy and not k:
        raise ValueError("plan_phases: engine_decode_copy is for an engine on devices of its own: it needs "
                         "config.rollout.engine_devices > 0")
    job = _job(run, mesh, prompt_len, compiler_options, info, engine_mesh, engine_decode_copy)
    applies = {"warm start": bool(run.sft.steps), "KL reference": job.ref is not None,
               "rollout": job.layout is not None, "policy sync": job.layout is not None,
               "evaluation": job.layout is not None}
    phases = []
    for name, plan in _PHASE_PLANS.items():
        if applies.get(name, True) and (only is None or name in only):
            progress(name)
            phases.append(plan(job))
    return phases


def job_prompt_length(run: Any, default: int = 512) -> int:
    """The prompt length the job would use: measured from the task's problems with the model's tokenizer (the
    task prepared in a temporary directory), or `default` for a JSONL task planned before its files exist."""
    import tempfile

    from logra_jax.job.builders import build_model, build_tasks
    from logra_jax.rl.prompts import PromptFormat, max_prompt_length

    if run.task.kind == "jsonl" and not run.task.jsonl_train:
        return default
    _, tokenizer = build_model(run.model, weights=False)
    fmt = PromptFormat(run.task.prompt_style)
    with tempfile.TemporaryDirectory() as data:
        tasks = build_tasks(run.task, run.sft, Path(data))
        return max_prompt_length([*tasks.train_problems, *tasks.eval_problems, *tasks.sft_problems], tokenizer,
                                 fmt)


def _mask(prompts: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(prompts.shape, jnp.bool_, sharding=prompts.sharding)


PHASES = tuple(_PHASE_PLANS)
# What to change when a phase does not fit.
ADVICE = {
    "start": "more devices (train.mesh_fsdp), or tensor parallelism (train.mesh_tensor)",
    "warm start": "a smaller sft.batch_size, sft.steps = 0 (a checkpoint that already answers in format), or more "
                  "devices",
    "trainer init": "more devices, or a leaner optimizer (LoGRA instead of AdamW)",
    "rollout": "fewer rollout.slots (the KV cache holds `slots` rows), a larger rollout.decode_tensor (the engine's "
               "weights split over more devices), rollout.workers = 1 on other devices, or more devices",
    "KL reference": "more devices, or algorithm.kl_beta = 0",
    "train step": "more train.microbatches (activations per microbatch), fewer optimizer.probe_responses, or more "
                  "devices",
    "policy sync": "a larger rollout.decode_tensor, or more devices",
    "evaluation": "fewer rollout.slots, a larger rollout.decode_tensor, or more devices",
}


def rl_step_time(phases: list[PhaseBytes], run: Any) -> dict[str, Any] | None:
    """An RL step's seconds on paper, and the hours for train.steps (+ the warm start); None when the rollout's or
    the train step's time is unknown (a CPU target, a refused program, a phase not compiled).

    Colocated (rollout.engine_devices = 0): rollout + KL reference + train step + policy sync (+ an evaluation
    every train.eval_every steps, spread over them), one after the other. With the engine on k devices of its own
    the step has two sides: the engine's (rollout + the evaluation's share + the policy sync's merge into its
    masters) and the trainer's (KL reference + train step + the payload's transfer). "sequential" is their sum
    (rollout.max_staleness = 0: the rollout, then the training); "pipelined" their max (max_staleness ≥ 1: the
    engine generates batch t + 1 while the trainer trains batch t); "seconds" is the one the config runs.

    Returns:
      {"seconds", "parts": {name: seconds}, "steps", "hours", "placement": "colocated" | "split",
      "sequential_seconds", "pipelined_seconds" (None colocated), and split: "engine_seconds", "trainer_seconds",
      "merge_seconds", "transfer_seconds" (the policy sync's two parts)}.
    """
    est = {p.name: p.time["est_seconds"] for p in phases if p.time and p.time.get("est_seconds") is not None}
    if "rollout" not in est or "train step" not in est:
        return None
    parts = {name: est[name] for name in ("rollout", "KL reference", "train step", "policy sync") if name in est}
    if run.train.eval_every and "evaluation" in est:
        parts["evaluation"] = est["evaluation"] / run.train.eval_every
    sequential = sum(parts.values())
    out = {"placement": "colocated", "parts": parts, "steps": run.train.steps, "sequential_seconds": sequential,
           "pipelined_seconds": None}
    if run.rollout.engine_devices:
        sync = next((p.time for p in phases if p.name == "policy sync" and "policy sync" in est), {})
        merge, transfer = sync.get("apply_seconds", 0.0), sync.get("transfer_seconds", 0.0)
        engine = parts["rollout"] + parts.get("evaluation", 0.0) + merge
        trainer = parts.get("KL reference", 0.0) + parts["train step"] + transfer
        out.update(placement="split", engine_seconds=engine, trainer_seconds=trainer, merge_seconds=merge,
                   transfer_seconds=transfer, pipelined_seconds=max(engine, trainer))
    out["seconds"] = out["pipelined_seconds"] if run.rollout.max_staleness else sequential
    out["hours"] = (run.train.steps * out["seconds"] + est.get("warm start", 0.0)) / 3600
    return out


def best_split(candidates: Mapping[int, tuple[bool, dict[str, Any] | None]]) -> int | None:
    """The engine's device count k whose pipelined RL step is the shortest among the candidates that fit (ties:
    the smaller k); None when none fits, or none of those that fit has a time on paper (a CPU target).

    Args:
      candidates: {k: (every phase of the placement fits, its `rl_step_time` or None)}.

    Example:
      >>> best_split({2: (True, {"pipelined_seconds": 9.0}), 4: (False, {"pipelined_seconds": 5.0}),
      ...             6: (True, {"pipelined_seconds": 7.0})})
      6
    """
    timed = [(step["pipelined_seconds"], k) for k, (fits, step) in candidates.items()
             if fits and step and step.get("pipelined_seconds") is not None]
    return min(timed)[1] if timed else None


def step_line(step: dict[str, Any], run: Any) -> str:
    """`rl_step_time`'s result as the plan prints it."""
    if step["placement"] == "colocated":
        parts = " + ".join(f"{name} {_seconds(sec)}" for name, sec in step["parts"].items())
        return (f"RL step on paper: {_seconds(step['seconds'])} ({parts}); {step['steps']} steps ≈ "
                f"{step['hours']:.1f} h")
    parts = step["parts"]
    sync = parts.get("policy sync")
    return (f"RL step on paper, the engine on {run.rollout.engine_devices} devices of its own: engine "
            f"{_seconds(step['engine_seconds'])} (rollout {_seconds(parts['rollout'])}"
            + (f" + evaluation {_seconds(parts['evaluation'])}" if "evaluation" in parts else "")
            + (f" + sync merge {_seconds(step['merge_seconds'])}" if sync is not None else "")
            + f"), trainer {_seconds(step['trainer_seconds'])}"
            + (f" (KL reference {_seconds(parts['KL reference'])} + " if "KL reference" in parts else " (")
            + f"train step {_seconds(parts['train step'])}"
            + (f" + payload transfer {_seconds(step['transfer_seconds'])}" if sync is not None else "")
            + f"); sequential {_seconds(step['sequential_seconds'])}, pipelined "
            f"{_seconds(step['pipelined_seconds'])}; rollout.max_staleness = {run.rollout.max_staleness}: "
            f"{step['steps']} steps ≈ {step['hours']:.1f} h")


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.1f} s" if value < 600 else f"{value / 60:.1f} min"


def report(phases: list[PhaseBytes], hbm: int, run: Any = None) -> tuple[str, int]:
    """(the table as text, exit status: 0 every phase fits `hbm` bytes, 3 one does not). With `run`, each phase's
    time on paper, the engine's decode step against its floor, and the RL step's time."""
    lines = [f"{'phase':13s} {'program':>9s} {'beside it':>10s} {'total':>9s} {'on paper':>10s}  (GiB per device; "
             f"HBM {hbm / GIB:.2f})"]
    for p in phases:
        flag = "" if p.total <= hbm else "  DOES NOT FIT"
        refused = f" [compiler: {p.refused.strip()}]" if p.refused else ""
        est = _seconds(p.time.get("est_seconds")) if p.time else "–"
        lines.append(f"{p.name:13s} {p.program['total'] / GIB:9.2f} {p.others / GIB:10.2f} {p.total / GIB:9.2f} "
                     f"{est:>10s}{flag}  {p.note}{refused}")
    for p in phases:
        d = p.per_decode_step
        if d and d.get("est_seconds") is not None:
            read = "weights" if "experts_per_layer" not in d else (
                f"non-expert weights + the {d['expected_experts_per_layer']:.1f} of {d['experts_per_layer']} "
                f"experts per layer {p.name}'s slots choose under uniform routing")
            lines.append(f"{p.name} decode step: HBM {d['hbm_bytes'] / 1e9:.3f} GB + collectives "
                         f"{d['collective_bytes'] / 1e9:.3f} GB per device → {_seconds(d['est_seconds'])}; floor "
                         f"({read} + KV read, / devices) {d['floor_bytes'] / 1e9:.3f} GB → "
                         f"{_seconds(d['floor_seconds'])} ({d['est_seconds'] / d['floor_seconds']:.2f}× the floor)"
                         + ("" if "experts_per_layer" not in d else
                            f"; every expert read: {d['floor_all_experts_bytes'] / 1e9:.3f} GB")
                         + ("" if d.get("counted_hbm_bytes", d["hbm_bytes"]) >= d["hbm_bytes"] else
                            f"; counted {d['counted_hbm_bytes'] / 1e9:.3f} GB, below the floor: clamped"))
    step = None if run is None else rl_step_time(phases, run)
    if step:
        lines.append(step_line(step, run))
    peak = max(phases, key=lambda p: p.total)
    lines.append(f"largest: {peak.name} ({peak.total / GIB:.2f} GiB per device)")
    over = [p for p in phases if p.total > hbm]
    for p in over:
        lines.append(f"{p.name} needs {p.total / GIB:.2f} GiB > {hbm / GIB:.2f}: {ADVICE[p.name]}")
    lines.append("every phase fits" if not over else f"{len(over)} phase(s) do not fit")
    return "\n".join(lines), 3 if over else 0
