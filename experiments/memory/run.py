"""Per-device memory of one sharded train step at real shapes, compile-only (nothing is allocated).

The paper's setting: one 4096-token sequence per device per microbatch, activation checkpointing per block,
bfloat16 compute, float32 weights, FSDP over the paper's 4 training GPUs and over 8 devices. Every train step is
lowered with abstract inputs (ShapeDtypeStructs carrying their shardings) and compiled for fake CPU devices;
XLA's memory analysis gives per-device bytes = arguments + outputs + temporaries − aliased (donated) buffers.

  python experiments/memory/run.py          # all models × meshes × optimizers → results.json, memory.png, table

Optimizers (one step of each, the same RL loss):
  adamw                 optax.adamw on every parameter (dense gradients, two dense moments).
  galore                optax.contrib.galore (rank 256, Adam inside) on the attention/MLP kernels, one layer at a
                        time (GaLore projects 2-D matrices; our kernels are stacked [L, in, out]); AdamW elsewhere.
  adafactor             optax.adafactor on every parameter (factored second moments).
  logra_dense_grad      logra_jax.optim.logra in dense-gradient mode: targets only, everything else frozen.
  logra_sketch_native   sketch-native LoGRA (no dense gradient): `build_logra_sketch_native`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from logra_jax import sharding as shd
from logra_jax.models.config import ModelConfig, preset
from logra_jax.models.decoder import Decoder, init_model
from logra_jax.optim import find_targets, logra
from logra_jax.optim.sketch_native import SketchSpec, attach_sketch_probes
from logra_jax.optimizers import per_layer
from logra_jax.rl.logprobs import token_logprobs
from logra_jax.train_step import TrainState, make_train_step

MODELS = {  # results key → preset
    "SmolLM2-135M": "smollm2-135m",
    "Qwen2.5-Math-1.5B": "qwen2.5-1.5b",
    "Qwen2.5-Math-7B": "qwen2.5-7b",
    "Dense-27B": "dense-27b",
}
DEVICE_COUNTS = (4, 8)
OPTIMIZERS = ("adamw", "galore", "adafactor", "logra_dense_grad", "logra_sketch_native")
SEQ_LEN = 4096
RANK = 256
LOGPROB_CHUNK = 512
TARGET_PATTERN = re.compile(r"blocks\.(attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.kernel$")
GIB = 2.0 ** 30

def bench_config(name: str) -> ModelConfig:
    """The preset at the paper's numerics: bf16 compute, fp32 weights, full remat per block, chunked attention."""
    return preset(name, dtype="bfloat16", remat="full", attention_impl="chunked", attention_chunk=512,
                  max_seq_len=max(SEQ_LEN, preset(name).max_seq_len))


def rl_loss(model: Decoder, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """REINFORCE: −Σ A_b · log π(y_bt) · m_bt / Σ m, log-probs in chunks (no [T, V] logits)."""
    hidden = model.features(batch["tokens"])
    logp = token_logprobs(hidden, model.head_weight(), batch["targets"], chunk=LOGPROB_CHUNK)
    mask = batch["mask"].astype(jnp.float32)
    loss = -jnp.sum(batch["advantages"][:, None] * logp * mask) / jnp.maximum(mask.sum(), 1.0)
    return loss, {}


def abstract_batch(global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    tokens = jax.ShapeDtypeStruct((global_batch, SEQ_LEN), jnp.int32)
    return {"tokens": tokens, "targets": tokens, "mask": jax.ShapeDtypeStruct((global_batch, SEQ_LEN), jnp.bool_),
            "advantages": jax.ShapeDtypeStruct((global_batch,), jnp.float32)}


def is_target(path: tuple, _: Any) -> bool:
    return TARGET_PATTERN.search(".".join(str(p) for p in path)) is not None


@dataclasses.dataclass(frozen=True)
class Bench:
    """What one optimizer contributes: state initialisation and a pure train step over it."""

    init: Callable[[], tuple[TrainState, nnx.State]]
    step: Callable[..., tuple[TrainState, dict[str, jax.Array]]]


def dense_bench(config: ModelConfig, tx: optax.GradientTransformation, trainable=None) -> Bench:
    def init():
        _, params, rest = nnx.split(init_model(config), nnx.Param, ...)
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32)), rest

    graphdef = nnx.split(nnx.eval_shape(lambda: init_model(config)), nnx.Param, ...)[0]
    return Bench(init, make_train_step(graphdef, rl_loss, tx, trainable=trainable))


def labels(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "galore" if is_target(tuple(getattr(k, "key", k) for k in path[:-1]), None) else "adamw",
        params)


def build_adamw(config: ModelConfig) -> Bench:
    return dense_bench(config, optax.adamw(1e-6))


def build_galore(config: ModelConfig) -> Bench:
    galore = per_layer(optax.contrib.scale_by_galore(rank=RANK, base_optimizer=optax.scale_by_adam()))
    tx = optax.partition({"galore": optax.chain(galore, optax.scale(-1e-6)), "adamw": optax.adamw(1e-6)}, labels)
    return dense_bench(config, tx)


def build_adafactor(config: ModelConfig) -> Bench:
    return dense_bench(config, optax.adafactor(1e-6))


def build_logra_dense_grad(config: ModelConfig) -> Bench:
    return dense_bench(config, logra(rank=RANK), trainable=is_target)


def build_logra_sketch_native(config: ModelConfig) -> Bench:
    """Sketch probes on the targets; the step differentiates w.r.t. the probes only (no dense gradient)."""
    spec = SketchSpec(rank=RANK)
    tx = logra(rank=RANK)

    def make_model() -> Decoder:
        model = init_model(config)
        attach_sketch_probes(model, spec)
        return model

    def init():
        _, params, rest = nnx.split(make_model(), nnx.Param, ...)
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32)), rest

    abstract = nnx.eval_shape(make_model)
    graphdef, abstract_params, _ = nnx.split(abstract, nnx.Param, ...)
    return Bench(init, make_train_step(graphdef, rl_loss, tx, mode="sketch_native", spec=spec, round_bf16=True,
                                       targets=find_targets(abstract_params)))


BUILDERS = {"adamw": build_adamw, "galore": build_galore, "adafactor": build_adafactor,
            "logra_dense_grad": build_logra_dense_grad, "logra_sketch_native": build_logra_sketch_native}


def measure(model: str, devices: int, optimizer: str, fast: bool, tensor: int = 1) -> dict[str, int]:
    """One cell of the table (runs in a worker process): FSDP over `devices`, or fsdp × tensor."""
    start = time.perf_counter()
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=-1, tensor=tensor), jax.devices()[:devices])
    bench = BUILDERS[optimizer](bench_config(MODELS[model]))
    mem = shd.step_memory(bench.step, bench.init, abstract_batch(mesh.size), mesh,
                          compiler_options=shd.FAST_CPU_COMPILE if fast else None)
    parts = " ".join(f"{name} {mem[name] / GIB:.2f}" for name in ("argument", "output", "temp", "alias"))
    print(f"{cell_key(model, devices, tensor)} {optimizer:20s} {mem['total'] / GIB:7.2f} GiB  ({parts}) "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    return mem


def cell_key(model: str, devices: int, tensor: int) -> str:
    return f"{model}@{devices}dev" + (f"_tp{tensor}" if tensor > 1 else "")


def table(results: dict[str, dict[str, int]]) -> str:
    """Markdown: GiB per device, and each optimizer's fraction of dense AdamW's."""
    opts = [o for o in OPTIMIZERS if any(o in row for row in results.values())]
    lines = ["| model @ devices | " + " | ".join(opts) + " |", "|---" * (len(opts) + 1) + "|"]
    for key, row in results.items():
        cells = []
        for o in opts:
            if o not in row:
                cells.append("–")
                continue
            ratio = f" ({row[o] / row['adamw']:.0%})" if "adamw" in row and o != "adamw" else ""
            cells.append(f"{row[o] / GIB:.2f}{ratio}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, int]], path: Path) -> None:
    """Grouped bars per model, one panel per device count, log scale, with an 80 GiB (H100) line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meshes = list(dict.fromkeys(k.rsplit("@", 1)[1] for k in results))
    fig, axes = plt.subplots(1, len(meshes), figsize=(7 * len(meshes), 4.5), sharey=True, squeeze=False)
    for ax, mesh in zip(axes[0], meshes):
        keys = [k for k in results if k.endswith(f"@{mesh}")]
        width = 0.8 / len(OPTIMIZERS)
        for i, opt in enumerate(OPTIMIZERS):
            xs = [j + (i - (len(OPTIMIZERS) - 1) / 2) * width for j in range(len(keys))]
            ys = [results[k].get(opt, 0) / GIB for k in keys]
            ax.bar(xs, ys, width, label=opt)
        ax.axhline(80, color="k", linestyle="--", linewidth=1)
        ax.text(len(keys) - 0.5, 82, "80 GiB (H100)", ha="right", va="bottom", fontsize=8)
        ax.set_xticks(range(len(keys)), [k.rsplit("@", 1)[0] for k in keys])
        ax.set_yscale("log")
        ax.set_title(f"{mesh}: one 4096-token sequence per device (FSDP{', tensor-parallel' if 'tp' in mesh else ''})",
                     fontsize=10)
        ax.set_ylabel("per-device bytes (GiB): argument + output + temp − alias")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--devices", nargs="*", type=int, default=list(DEVICE_COUNTS))
    parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel axis size (fsdp = devices/tensor)")
    parser.add_argument("--jobs", type=int, default=2, help="compiles in parallel (worker processes)")
    parser.add_argument("--full-llvm-optimization", action="store_true",
                        help="compile with XLA's default CPU code generation (slower; same buffer assignment)")
    args = parser.parse_args()
    cells = [(m, n, o) for m in args.models for n in args.devices for o in args.optimizers]
    start = time.perf_counter()
    fast = not args.full_llvm_optimization
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {cell: pool.submit(measure, *cell, fast, args.tensor) for cell in cells}
        measured = {cell: future.result() for cell, future in futures.items()}
    results: dict[str, dict[str, int]] = {}
    breakdown: dict[str, dict[str, dict[str, int]]] = {}
    for (model, n, opt), mem in measured.items():
        results.setdefault(cell_key(model, n, args.tensor), {})[opt] = mem["total"]
        breakdown.setdefault(cell_key(model, n, args.tensor), {})[opt] = mem
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "breakdown.json").write_text(json.dumps(breakdown, indent=1) + "\n")
    plot(results, args.out / "memory.png")
    print(f"\nPer-device GiB (fraction of dense AdamW), {time.perf_counter() - start:.0f} s:\n")
    print(table(results))


if __name__ == "__main__":
    main()
