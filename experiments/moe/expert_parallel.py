"""Expert parallelism (issue 60, item 4): the collective bytes per device of the train step, FSDP on the experts'
model width (today's default) against experts split over fsdp (`config.model.expert_parallel`), and of the rollout
engine's decode step, measured by the compiler.

  JAX_PLATFORMS=cpu nice -n 10 .venv-tpu/bin/python -m experiments.moe.expert_parallel            # v5e:2x4
  JAX_PLATFORMS=cpu nice -n 10 .venv-tpu/bin/python -m experiments.moe.expert_parallel --target=v5p:2x2x1

The paper's recipe on Qwen3-30B-A3B (`configs/paper_qwen2.5_math.py:30b-a3b`: bfloat16 weights, LoGRA rank 256
sketch-native, full remat, FSDP over every device) cut to `--layers` layers (the real widths: D 2048, 128 experts
of width 768, top-8, vocabulary 151936), to one 3584-token response per device (`rollout.prompts_per_step` = the
device count, one microbatch) and without the predicted-KL probe. Each program is the job's own (`phases.Trainer`'s
`rl_step`; the colocated engine's `DecodeLayout` and `rollout.slots` decode chunk), lowered from abstract inputs and
compiled for the target's compile-only devices. Collective bytes per device are `planner.hlo_cost`'s (ring
algorithms, every loop iteration counted; the decode chunk's while loop, whose trip count only the run knows, is
counted as one decode step with the chunk's other work spread over its steps, as the planner does). Beside the
totals, every distinct collective whose result is shaped like an expert kernel (its last two dims D and F, or F and
D, whole or split) is listed: a weight (or its gradient) moving. Writes experiments/moe/expert_parallel.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.job.builders import build_model
from logra_jax.job.phases import Trainer
from logra_jax.models.expert_parallel import expert_kernel_bytes
from logra_jax.parallel.sharding import abstract_sharded, batch_shardings
from logra_jax.planner import aot
from logra_jax.planner.hlo_cost import hlo_cost, shape_bytes
from logra_jax.planner.plan import planning_config
from logra_jax.rollout import slots as slots_lib
from logra_jax.rollout.engine import DecodeLayout

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROMPT_LEN = 512
_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def recipe(target: str, layers: int, expert_parallel: bool) -> Any:
    """The RunConfig: the paper's `:30b-a3b` placement cut to `layers` layers and one response per device."""
    spec = importlib.util.spec_from_file_location("paper_config", REPO / "configs" / "paper_qwen2.5_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("30b-a3b")
    devices = aot.target_info(target).num_devices
    c.model.overrides.num_layers = layers
    c.model.expert_parallel = expert_parallel
    c.rollout.prompts_per_step = devices
    c.optimizer.kl_control = False  # the predicted-KL probe's forward would add its own token moves
    c.train.microbatches = 1
    return planning_config(c)


def expert_collectives(text: str, hidden: int, width: int) -> list[dict[str, Any]]:
    """The distinct collectives of a compiled module whose result arrays end in an expert kernel's [D, F] or
    [F, D], each of D and F whole or split up to 8 ways: (op, result shape, bytes of the result), each listed once
    however often it runs."""
    splits = lambda n: {n // s for s in (1, 2, 4, 8) if n % s == 0}
    ds, fs = splits(hidden), splits(width)
    found = {}
    for m in _COLLECTIVE.finditer(text):
        for dtype, dims in _ARRAY.findall(m.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if len(shape) >= 2 and ((shape[-2] in ds and shape[-1] in fs) or (shape[-2] in fs and shape[-1] in ds)):
                found[(m.group(2), dtype, dims)] = {"op": m.group(2), "shape": f"{dtype}[{dims}]",
                                                    "bytes": shape_bytes(f"{dtype}[{dims}]")}
    return list(found.values())


def train_step(run: Any, mesh: Any) -> tuple[dict[str, Any], Any]:
    """The RL train step of `run` on `mesh`, compiled: its collective bytes and expert-kernel collectives; and the
    trainer (for the decode layout)."""
    model, _ = build_model(run.model, mesh, weights=False)
    trainer = Trainer.build(run, model, mesh)
    step_fn, batch, probe = trainer.rl_step(run, mesh, PROMPT_LEN)
    state = abstract_sharded(trainer.abstract_state, trainer.state_sh)
    rest = abstract_sharded(trainer.abstract_rest, trainer.rest_sh)
    args = (state, rest, abstract_sharded(batch, batch_shardings(batch, mesh)),
            None if probe is None else abstract_sharded(probe, batch_shardings(probe, mesh)))
    text = step_fn.lower(*args).compile().as_text()
    config = model.config
    cost = hlo_cost(text)
    return {"collective_bytes": cost.collective_bytes, "flops": cost.flops, "matmul_flops": cost.matmul_flops,
            "hbm_bytes": cost.bytes_accessed,
            "expert_kernel_collectives": expert_collectives(text, config.hidden_size, config.expert_intermediate_size),
            "expert_kernel_bytes_whole": expert_kernel_bytes(model)}, trainer


def decode_step(run: Any, trainer: Any, mesh: Any) -> dict[str, Any]:
    """One decode step of the colocated engine in its decode layout (the job's `DecodeLayout` and decode chunk):
    its collective bytes (`hlo_cost`, the chunk's loop counted as one step) and expert-kernel collectives."""
    layout = DecodeLayout(trainer.model().config, mesh, run.rollout.decode_tensor, run.rollout.per_layer)
    sampling = run.rollout.sampling(eos_id=0, pad_id=0)
    rows = run.rollout.prompts_per_step * sampling.num_samples
    S = slots_lib.num_slots(sampling, rows)
    prompts = jax.ShapeDtypeStruct((run.rollout.prompts_per_step, PROMPT_LEN), jnp.int32)
    prompts = abstract_sharded(prompts, batch_shardings(prompts, layout.mesh))
    mask = jax.ShapeDtypeStruct(prompts.shape, jnp.bool_, sharding=prompts.sharding)
    started = slots_lib.start.lower(layout.graphdef, layout.abstract, prompts, mask, config=sampling, num_slots=S,
                                    mesh=layout.mesh).compile()
    out = jax.eval_shape(lambda s, p, m: slots_lib.start(layout.graphdef, s, p, m, config=sampling, num_slots=S,
                                                         mesh=layout.mesh), layout.abstract, prompts, mask)
    slots = abstract_sharded(out, started.output_shardings)[0]
    key = jax.eval_shape(lambda: jax.random.key(0))
    text = slots_lib.decode_program(slots).lower(
        layout.graphdef, layout.abstract, slots, key, config=sampling, bucket=PROMPT_LEN + sampling.max_new_tokens,
        mesh=layout.mesh).compile().as_text()
    cost = hlo_cost(text)
    per_step = cost.unknown_loop_iteration[2] + (cost.collective_bytes - cost.unknown_loop_iteration[2]) / max(
        sampling.decode_steps, 1)
    config = layout.config
    kernels = [v for p, v in nnx.to_flat_state(nnx.state(nnx.merge(layout.graphdef, layout.abstract), nnx.Param))
               if "_proj" in str(p[-2]) and "mlp" in map(str, p) and config.moe]
    return {"decode_tensor": layout.tensor, "decode_mesh": dict(layout.mesh.shape), "slots": S,
            "collective_bytes_per_step": per_step,
            "expert_kernel_specs": sorted({str(v.get_value().sharding.spec) for v in kernels}),
            "expert_kernel_collectives": expert_collectives(text, config.hidden_size,
                                                            config.expert_intermediate_size)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e:2x4")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "expert_parallel.json"))
    parser.add_argument("--layouts", default="fsdp,expert_parallel",
                        help="the train-step layouts to measure (the others' entries of --out are kept)")
    args = parser.parse_args(argv)
    mesh = aot.mesh(args.target)
    out = Path(args.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.update(target=args.target, layers=args.layers, mesh=dict(mesh.shape), prompt_len=PROMPT_LEN)
    layouts = args.layouts.split(",")
    for name, ep in (("fsdp", False), ("expert_parallel", True)):
        if name not in layouts:
            continue
        start = time.time()
        run = recipe(args.target, args.layers, ep)
        step, trainer = train_step(run, mesh)
        results[f"train_step_{name}"] = step
        print(f"train step, {name}: {step['collective_bytes'] / 2**20:.1f} MiB of collectives per device, "
              f"{step['matmul_flops'] / 1e12:.2f} matmul TFLOP, {step['hbm_bytes'] / 2**30:.2f} GiB HBM, "
              f"{len(step['expert_kernel_collectives'])} distinct expert-kernel collectives "
              f"({time.time() - start:.0f} s)", flush=True)
        if not ep:  # the engine's layout does not depend on the trainer's
            start = time.time()
            results["decode_step"] = decode_step(run, trainer, mesh)
            d = results["decode_step"]
            print(f"decode step (tensor {d['decode_tensor']}, {d['slots']} slots): "
                  f"{d['collective_bytes_per_step'] / 2**20:.2f} MiB of collectives per device, expert kernels "
                  f"{d['expert_kernel_specs']}, {len(d['expert_kernel_collectives'])} expert-kernel collectives "
                  f"({time.time() - start:.0f} s)", flush=True)
    results["command"] = ("JAX_PLATFORMS=cpu .venv-tpu/bin/python -m experiments.moe.expert_parallel "
                          f"--target={args.target} --layers={args.layers}")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
