"""Sketch-native LoGRA against dense AdamW: per-device memory at real shapes, and CPU step time side by side.

  python experiments/sketch_native/bench.py                  # both parts → results.json, bench.png, tables
  python experiments/sketch_native/bench.py --skip-memory --layers 8 --repeats 5     # a quicker timing run

Memory (compile-only, nothing allocated; experiments/memory/run.py's setting and optimizers): one 4096-token
sequence per device, bf16 compute, fp32 weights, full remat, FSDP over 4 and 8 fake CPU devices, rank 256;
per-device bytes = argument + output + temp − alias (`logra_jax.parallel.sharding.step_memory`) for SmolLM2-135M and
Qwen2.5-Math-1.5B shapes:
  adamw                 optax.adamw on every parameter (dense gradients, two dense moments)
  logra_dense_grad      logra(rank=256) fed by dense gradients of the targets (non-targets frozen)
  logra_sketch_native   the same chain fed by sketch probes: no dense target gradient exists
Step time (this CPU, one device, float32 compute, no remat): SmolLM2-135M widths (d = 576, mlp 1536, 9/3 heads,
vocab 49152; `--layers` of its 30 blocks), a batch of `--batch` sequences of `--seq` tokens, next-token loss:
  adamw                 optax.adamw(1e-4) on every parameter, dense gradients (make_train_step mode "dense")
  adamw_targets         optax.adamw on the 7 target kernels only, the rest frozen: the same trainable set as LoGRA
  logra_sketch_native   logra(rank=--rank) with sketch probes (mode "sketch_native"), non-targets frozen
Each step is jitted with the train state donated. After two warm-up steps of each, `--repeats` rounds run the
optimizers interleaved (every optimizer sees the same machine load); medians and ratios to adamw are reported, of
wall seconds and of this process's CPU seconds (all threads; less sensitive to other jobs on a shared machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import NON_TARGET_LABEL, TARGET_LABEL, SketchSpec, find_targets, logra, target_labels

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # experiments/memory/run.py is imported (in worker processes) as a module

MEMORY_MODELS = ("SmolLM2-135M", "Qwen2.5-Math-1.5B")
MEMORY_DEVICES = (4, 8)
MEMORY_OPTIMIZERS = ("adamw", "logra_dense_grad", "logra_sketch_native")
TIMED = ("adamw", "adamw_targets", "logra_sketch_native")
GIB = 2.0**30


def memory_cell(model: str, devices: int, optimizer: str) -> dict[str, int]:
    """One compile-only memory cell, run in a fresh worker process (its own 8 fake CPU devices)."""
    from experiments.memory import run as memory  # sets the fake-device flag before this process starts JAX

    return memory.measure(model, devices, optimizer, fast=True)


def memory_table(jobs: int) -> dict[str, dict[str, dict[str, int]]]:
    cells = [(m, n, o) for m in MEMORY_MODELS for n in MEMORY_DEVICES for o in MEMORY_OPTIMIZERS]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {cell: pool.submit(memory_cell, *cell) for cell in cells}
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (model, n, opt), future in futures.items():
            out.setdefault(f"{model}@{n}dev", {})[opt] = future.result()
    return out


def build_step(name: str, config: Any, rank: int) -> tuple[Callable, TrainState, nnx.State]:
    """(jitted step with the state donated, initial state, rest) for one timed optimizer."""
    model = init_model(config, seed=0)
    if name == "logra_sketch_native":
        spec = SketchSpec(rank=rank)
        targets = attach_sketch_probes(model, spec)
        tx = logra(rank=rank)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        step = make_train_step(graphdef, next_token_loss, tx, mode="sketch_native")
    else:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        trainable = None
        tx = optax.adamw(1e-4)
        if name == "adamw_targets":
            targets = find_targets(params)
            trainable = lambda path, _: ".".join(map(str, path)) in targets
            tx = optax.partition({TARGET_LABEL: tx, NON_TARGET_LABEL: optax.set_to_zero()}, target_labels)
        step = make_train_step(graphdef, next_token_loss, tx, trainable=trainable)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    return jax.jit(step, donate_argnums=0), state, rest


def step_times(layers: int, batch: int, seq: int, rank: int, repeats: int) -> dict[str, Any]:
    config = preset("smollm2-135m", num_layers=layers)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, config.vocab_size)
    data = {"tokens": tokens, "attention_mask": jnp.ones_like(tokens), "loss_mask": jnp.ones_like(tokens)}
    runs = {name: build_step(name, config, rank) for name in TIMED}
    states = {name: state for name, (_, state, _) in runs.items()}
    losses: dict[str, list[float]] = {name: [] for name in TIMED}

    def one(name: str) -> tuple[float, float]:
        step, _, rest = runs[name]
        start, cpu = time.perf_counter(), time.process_time()
        states[name], metrics = step(states[name], rest, data)
        jax.block_until_ready((states[name], metrics))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        losses[name].append(float(metrics["loss"]))
        return wall, cpu

    compile_s = {}
    for name in TIMED:
        compile_s[name] = one(name)[0]
        one(name)
    seconds: dict[str, list[float]] = {name: [] for name in TIMED}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in TIMED}
    for _ in range(repeats):
        for name in TIMED:
            wall, cpu = one(name)
            seconds[name].append(wall)
            cpu_seconds[name].append(cpu)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    median_cpu = {name: statistics.median(s) for name, s in cpu_seconds.items()}
    return {"config": {"preset": "smollm2-135m", "num_layers": layers, "batch": batch, "seq": seq, "rank": rank,
                       "repeats": repeats, "dtype": config.dtype, "remat": config.remat},
            "first_call_seconds": compile_s, "seconds": seconds, "median_seconds": median,
            "ratio_to_adamw": {name: median[name] / median["adamw"] for name in TIMED},
            "cpu_seconds": cpu_seconds, "median_cpu_seconds": median_cpu,
            "cpu_ratio_to_adamw": {name: median_cpu[name] / median_cpu["adamw"] for name in TIMED},
            "losses": losses}


def plot(memory: dict[str, Any] | None, timing: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if memory else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    if memory:
        keys = list(memory)
        width = 0.8 / len(MEMORY_OPTIMIZERS)
        for i, opt in enumerate(MEMORY_OPTIMIZERS):
            xs = [j + (i - (len(MEMORY_OPTIMIZERS) - 1) / 2) * width for j in range(len(keys))]
            ax.bar(xs, [memory[k][opt]["total"] / GIB for k in keys], width, label=opt)
        ax.set_xticks(range(len(keys)), [k.replace("@", "\n") for k in keys], fontsize=8)
        ax.set_ylabel("GiB per device (argument + output + temp − alias)")
        ax.set_title("compile-only memory, FSDP, one 4096-token sequence per device", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax = axes[0][1]
    c = timing["config"]
    for j, (kind, ratio, color) in enumerate((("seconds", "ratio_to_adamw", "C0"),
                                              ("cpu_seconds", "cpu_ratio_to_adamw", "C1"))):
        runs = [timing[kind][n] for n in TIMED]
        med = [statistics.median(r) for r in runs]
        err = [[m - min(r) for m, r in zip(med, runs)], [max(r) - m for m, r in zip(med, runs)]]
        xs = [i + (j - 0.5) * 0.38 for i in range(len(TIMED))]
        ax.bar(xs, med, 0.38, yerr=err, capsize=3, color=color,
               label="wall s" if kind == "seconds" else "process CPU s (all threads)")
        for x, m, n in zip(xs, med, TIMED):
            ax.text(x, m, f"{timing[ratio][n]:.2f}×", ha="center", va="bottom", fontsize=8)
    ax.legend(fontsize=8)
    ax.set_xticks(range(len(TIMED)), TIMED, fontsize=8)
    ax.set_ylabel("seconds per step (median, min–max)")
    ax.set_title(f"CPU step time: SmolLM2-135M widths, {c['num_layers']} layers, {c['batch']}×{c['seq']} tokens, "
                 f"r = {c['rank']}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2-135M blocks in the timed model (30 = all)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=2, help="memory compiles in parallel (worker processes)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error(f"--repeats must be >= 5 for a median, got {args.repeats}")
    start = time.perf_counter()
    memory = None if args.skip_memory else memory_table(args.jobs)
    timing = step_times(args.layers, args.batch, args.seq, args.rank, args.repeats)
    result = {"command": " ".join(["python experiments/sketch_native/bench.py", *sys.argv[1:]]),
              "machine": {"platform": platform.platform(), "cpus": multiprocessing.cpu_count(),
                          "jax": jax.__version__},
              "memory": memory, "step_time": timing, "wall_seconds": time.perf_counter() - start}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(memory, timing, args.out_dir / "bench.png")
    if memory:
        print("\nPer-device GiB (fraction of dense AdamW's):\n")
        print("| model @ devices | " + " | ".join(MEMORY_OPTIMIZERS) + " |")
        print("|---" * (len(MEMORY_OPTIMIZERS) + 1) + "|")
        for key, row in memory.items():
            cells = [f"{row[o]['total'] / GIB:.2f}" + ("" if o == "adamw" else
                                                       f" ({row[o]['total'] / row['adamw']['total']:.0%})")
                     for o in MEMORY_OPTIMIZERS]
            print(f"| {key} | " + " | ".join(cells) + " |")
    c = timing["config"]
    print(f"\nCPU step time, SmolLM2-135M widths, {c['num_layers']} layers, batch {c['batch']}×{c['seq']}, "
          f"r = {c['rank']}, median of {c['repeats']} interleaved rounds:\n")
    print("| optimizer | median s | min s | max s | ratio to adamw | median CPU s | CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in TIMED:
        s = timing["seconds"][name]
        print(f"| {name} | {statistics.median(s):.3f} | {min(s):.3f} | {max(s):.3f} | "
              f"{timing['ratio_to_adamw'][name]:.2f} | {timing['median_cpu_seconds'][name]:.3f} | "
              f"{timing['cpu_ratio_to_adamw'][name]:.2f} |")
    print(f"\n{result['wall_seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
