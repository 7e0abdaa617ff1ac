"""Per-device memory of LoGRA's two ways to apply an update: low-rank merge vs dense updates (drop-in), compile-only.

One optimizer step at real parameter shapes, the gradients given as inputs (same shapes and dtype as the
parameters), so the numbers isolate the optimizer and the merge (no model forward or backward;
optim = logra_jax.optim):
  lowrank_merge   tx = logra(...);                     u, s = tx.update(g, s, W); W = optim.apply_updates(W, u)
  dense_updates   tx = logra(..., dense_updates=True); u, s = tx.update(g, s, W); W = optax.apply_updates(W, u)
                  (what nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads) runs: tx.update, then
                  optax.apply_updates)
  adamw_targets   optax.adamw on LoGRA's targets only, everything else frozen (like for like)
  adamw           optax.adamw on every parameter
LoGRA's settings are those of the model's config (optimizer.rank, variant, update_ratio, round_bf16, ...) in
dense-gradient mode without the predicted-KL controller; default target rules, non-targets frozen. Params and
optimizer state are donated. The step is lowered from ShapeDtypeStructs and compiled (nothing is allocated) by the
project's `logra_jax.planner.memory_analysis.step_memory`: per-device bytes = argument + output + temp − alias.

  python -m experiments.dropin.memory                 # → results.json, memory.png and a table, here; ~30 s
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.sweep import load_config
from logra_jax.job.optimizer_plan import build_optimizer
from logra_jax.job.run_config import OptimizerSection
from logra_jax.job.train_step import TrainState
from logra_jax.models.config import preset
from logra_jax.models.decoder import abstract_model, init_model
from logra_jax.optim import apply_updates, find_targets, logra
from logra_jax.parallel import sharding as shd
from logra_jax.planner.memory_analysis import step_memory

ROOT = Path(__file__).resolve().parents[2]
MODELS = {  # results key → (preset, config file, config argument): the rank and LoGRA settings come from the config
    "SmolLM2-135M": ("smollm2-135m", ROOT / "configs" / "smollm2_arithmetic.py", None),
    "Qwen2.5-Math-1.5B": ("qwen2.5-1.5b", ROOT / "configs" / "paper_qwen2.5_math.py", "1.5b"),
}
ROUTES = ("lowrank_merge", "dense_updates", "adamw_targets", "adamw")
WEIGHTS = ("float32", "bfloat16")
DEVICE_COUNTS = (1, 8)
ADAMW_LR = 1e-6
GIB = 2.0**30
LOGRA_FIELDS = (
    "rank",
    "base_seed",
    "distribution",
    "refresh",
    "variant",
    "b2",
    "eps",
    "update_ratio",
    "ratio_scope",
    "round_bf16",
)


def logra_settings(model: str) -> dict[str, Any]:
    """The model config's LoGRA settings (the keyword arguments of `logra`); refuses a config that is not LoGRA."""
    _, path, arg = MODELS[model]
    section = load_config(path, arg)["optimizer"]
    if section["name"] != "logra" or section["non_targets"] != "frozen":
        raise ValueError(f"{path.name}: expected optimizer.name='logra' with frozen non-targets, got {section}")
    return {k: section[k] for k in LOGRA_FIELDS}


def route_step(route: str, model: str) -> tuple[optax.GradientTransformation, Callable[[Any, Any], Any]]:
    """(tx, merge) of one route: merge(params, updates) -> new params."""
    if route in ("lowrank_merge", "dense_updates"):
        dense = route == "dense_updates"
        tx = logra(**logra_settings(model), dense_updates=dense)
        return tx, optax.apply_updates if dense else apply_updates
    section = OptimizerSection(name="adamw", learning_rate=ADAMW_LR, targets_only=route == "adamw_targets")
    plan = build_optimizer(section, abstract_model(preset(MODELS[model][0])))
    return plan.tx, optax.apply_updates


def abstract_params(model: str, weights: str) -> nnx.State:
    """The model's parameters (nnx.Param state, logical-axis metadata kept) as `weights`-dtype ShapeDtypeStructs."""
    params = nnx.state(abstract_model(preset(MODELS[model][0])), nnx.Param)
    return jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, jnp.dtype(weights)), params)


def measure(model: str, weights: str, devices: int, route: str) -> dict[str, int]:
    """One cell: per-device bytes of one optimizer step (params + grads in, new params + new state out)."""
    tx, merge = route_step(route, model)

    def init() -> tuple[TrainState, nnx.State]:  # traced only; the second element (the gradients) is `rest`
        params = nnx.state(init_model(preset(MODELS[model][0])), nnx.Param)
        params = jax.tree.map(lambda w: w.astype(weights), params)
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32)), params

    def step(state: TrainState, grads: nnx.State, batch: Any) -> tuple[TrainState, jax.Array]:
        del batch
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return TrainState(merge(state.params, updates), opt_state, state.step + 1), state.step

    mesh = shd.make_mesh(shd.MeshConfig(fsdp=-1), jax.devices()[:devices])
    # step_memory shards `rest` (here: the gradients) like the params and donates the train state only.
    return step_memory(step, init, {}, mesh, compiler_options=shd.FAST_CPU_COMPILE)


def target_sizes(model: str, weights: str) -> dict[str, int]:
    """Bytes (whole model, not per device) of the weights and of the float32 ΔW the dense route forms."""
    params = abstract_params(model, weights)
    targets = find_targets(params)
    f32 = [4 * math.prod(t.shape) for t in targets.values()]
    return {
        "params": sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(params)),
        "targets": len(targets),
        "targets_f32": sum(f32),
        "largest_target_f32": max(f32),
        "largest_slice_f32": max(4 * math.prod(t.shape) // t.num_slices for t in targets.values()),
    }


def table(results: list[dict[str, Any]]) -> str:
    """Markdown, GiB per device: each route's total, and the dense route's extra against the fp32 ΔW of all targets."""
    head = (
        "| model | weights | devices | " + " | ".join(ROUTES) + " | dense − low-rank | all targets' fp32 ΔW / devices |"
        " extra / that |"
    )
    lines = [head, "|---" * (len(ROUTES) + 6) + "|"]
    for row in results:
        total = {r: row["routes"][r]["total"] for r in ROUTES if r in row["routes"]}
        cells = [f"{total[r] / GIB:.3f}" if r in total else "–" for r in ROUTES]
        extra, dw = row.get("dense_extra"), row["sizes"]["targets_f32"] / row["devices"]
        tail = (
            ["–", f"{dw / GIB:.3f}", "–"]
            if extra is None
            else [f"{extra / GIB:.3f}", f"{dw / GIB:.3f}", f"{extra / dw:.2f}"]
        )
        lines.append(f"| {row['model']} | {row['weights']} | {row['devices']} | " + " | ".join(cells + tail) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: one panel per device count, groups = model × weight dtype, one bar per route (GiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = list(dict.fromkeys(row["devices"] for row in results))
    fig, axes = plt.subplots(1, len(counts), figsize=(7 * len(counts), 4.5), squeeze=False)
    for ax, n in zip(axes[0], counts):
        rows = [row for row in results if row["devices"] == n]
        routes = [r for r in ROUTES if any(r in row["routes"] for row in rows)]
        width = 0.8 / len(routes)
        for i, route in enumerate(routes):
            xs = [j + (i - (len(routes) - 1) / 2) * width for j in range(len(rows))]
            ys = [row["routes"].get(route, {"total": 0})["total"] / GIB for row in rows]
            ax.bar(xs, ys, width, label=route)
        ax.set_xticks(range(len(rows)), [f"{row['model']}\n{row['weights']} weights" for row in rows], fontsize=8)
        ax.set_yscale("log")
        mesh = f"{n} devices (FSDP)" if n > 1 else "1 device"
        ax.set_title(f"one optimizer step on {mesh}, gradients given; compile-only, XLA:CPU", fontsize=10)
        ax.set_ylabel("per-device GiB: argument + output + temp − alias")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--weights", nargs="*", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--devices", nargs="*", type=int, default=list(DEVICE_COUNTS))
    parser.add_argument("--routes", nargs="*", default=list(ROUTES), choices=list(ROUTES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    start = time.perf_counter()
    results = []
    for model in args.models:
        print(f"{model}: LoGRA settings from its config: {logra_settings(model)}", flush=True)
        sizes = target_sizes(model, "float32")
        print(
            f"{model}: {sizes['targets']} target leaves; fp32 ΔW of all targets {sizes['targets_f32'] / GIB:.3f} GiB, "
            f"of the largest target {sizes['largest_target_f32'] / GIB:.3f} GiB, of its largest layer slice "
            f"{sizes['largest_slice_f32'] / GIB:.3f} GiB (whole model)",
            flush=True,
        )
        for weights in args.weights:
            for n in args.devices:
                row: dict[str, Any] = {
                    "model": model,
                    "weights": weights,
                    "devices": n,
                    "sizes": target_sizes(model, weights),
                    "routes": {},
                }
                for route in args.routes:
                    t = time.perf_counter()
                    mem = row["routes"][route] = measure(model, weights, n, route)
                    parts = " ".join(f"{k} {mem[k] / GIB:.3f}" for k in ("argument", "output", "temp", "alias"))
                    print(
                        f"{model} {weights:8s} {n}dev {route:14s} {mem['total'] / GIB:7.3f} GiB  ({parts})"
                        f"  {time.perf_counter() - t:.1f}s",
                        flush=True,
                    )
                if {"lowrank_merge", "dense_updates"} <= row["routes"].keys():
                    row["dense_extra"] = (
                        row["routes"]["dense_updates"]["total"] - row["routes"]["lowrank_merge"]["total"]
                    )
                results.append(row)
    elapsed = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["python -m experiments.dropin.memory", *sys.argv[1:]]),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "seconds": round(elapsed, 1),
        "bytes": "per device: argument + output + temp − alias = total; sizes: whole model",
        "logra_settings": {m: logra_settings(m) for m in args.models},
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    plot(results, args.out / "memory.png")
    print(f"\nPer-device GiB, {elapsed:.0f} s:\n")
    print(table(results))


if __name__ == "__main__":
    main()
