"""Per-device memory of one sharded train step at real shapes, compile-only (nothing is allocated).

The paper's setting: one 4096-token sequence per device per microbatch, activation checkpointing per block,
bfloat16 compute, float32 weights, FSDP over the paper's 4 training GPUs and over 8 devices. Every train step is
lowered with abstract inputs (ShapeDtypeStructs carrying their shardings) and compiled for fake CPU devices;
XLA's memory analysis gives per-device bytes = arguments + outputs + temporaries − aliased (donated) buffers.

  python experiments/memory/run.py          # all models × meshes × optimizers → results.json, memory.png, table

With --target the same steps are compiled by a real accelerator compiler for compile-only devices
(logra_jax.planner.aot), each optimizer with implementation="xla" and, for LoGRA, "pallas"; a step that does not fit is
kept with the bytes the compiler says it needs:
  JAX_PLATFORMS=cpu .venv-tpu/bin/python experiments/memory/run.py --target v5e --models Qwen2.5-Math-7B --devices 4
  JAX_PLATFORMS=cpu .venv-cuda/bin/python experiments/memory/run.py --target h100 --devices 4
  .venv/bin/python experiments/memory/run.py --tables    # README tables and targets.png from targets/*.json

Optimizers (one step of each, the training loop's own step and RL objective: REINFORCE + TIS on the response
tokens, log-probs in chunks; built by logra_jax.job.optimizer_plan from run-config sections, measured by
logra_jax.planner.memory_analysis.rl_step_memory):
  adamw                 optax.adamw on every parameter (dense gradients, two dense moments).
  adamw_targets         optax.adamw on exactly LoGRA's targets, everything else frozen (like for like).
  galore                optax.contrib GaLore (rank 256, Adam inside) on the attention/MLP kernels, one layer at a
                        time (GaLore projects 2-D matrices; our kernels are stacked [L, in, out]); AdamW elsewhere.
  adafactor             optax.adafactor on every parameter (factored second moments).
  logra_dense_grad      logra_jax.optim.logra in dense-gradient mode: targets only, everything else frozen.
  logra_sketch_native   sketch-native LoGRA (no dense gradient of any target).
  logra_sketch_native_kl  the same with the predicted-KL controller, as the paper runs it: the step also holds 2
                        probe sequences per device and runs the forward-mode JVP and the realised-KL forward.
  logra_sketch_native_kl_momentum  the same with the sketch-space first moment (optimizer.momentum 0.9; one
                        float32 [rows, r] array per target, carried across projection changes).
  logra_sketch_native_kl_bf16  LoGRA+KL with every matrix stored in bfloat16 (optimizer.weight_dtype), merged
                        with stochastic rounding.
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
import sys
import time
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: experiments.contenders
from experiments.contenders import contender_sections, paper_numerics
from logra_jax.parallel import sharding as shd
from logra_jax.planner import aot
from logra_jax.planner.memory_analysis import rl_step_memory
from logra_jax.planner.plan import parse_oom

MODELS = {  # results key → preset
    "SmolLM2-135M": "smollm2-135m",
    "Qwen2.5-Math-1.5B": "qwen2.5-1.5b",
    "Qwen2.5-Math-7B": "qwen2.5-7b",
    "Dense-27B": "dense-27b",
}
DEVICE_COUNTS = (4, 8)
OPTIMIZERS = ("adamw", "adamw_targets", "galore", "adafactor", "logra_dense_grad", "logra_sketch_native",
              "logra_sketch_native_kl", "logra_sketch_native_kl_momentum", "logra_sketch_native_kl_bf16")
PROBES_PER_DEVICE = 2  # the paper's KL probe: 2 single-response sequences per data-parallel rank
SEQ_LEN = 4096
PROMPT_LEN = 512
RANK = 256
LOGPROB_CHUNK = 512
GIB = 2.0 ** 30

# The optimizers compared, as a run config would name them (logra_jax.job.optimizer_plan builds them).
OPTIMIZER_SECTIONS = contender_sections(RANK)


def measure(model: str, devices: int, optimizer: str, fast: bool, tensor: int = 1) -> dict[str, int]:
    """One cell of the table (runs in a worker process): FSDP over `devices`, or fsdp × tensor."""
    start = time.perf_counter()
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=-1, tensor=tensor), jax.devices()[:devices])
    section = OPTIMIZER_SECTIONS[optimizer]
    if section.kl_control:
        section = dataclasses.replace(section, probe_responses=PROBES_PER_DEVICE * devices)
    mem = rl_step_memory(paper_numerics(MODELS[model], SEQ_LEN), section, mesh,
                         seq_len=SEQ_LEN, prompt_len=PROMPT_LEN, logprob_chunk=LOGPROB_CHUNK,
                         compiler_options=shd.FAST_CPU_COMPILE if fast else None)
    parts = " ".join(f"{name} {mem[name] / GIB:.2f}" for name in ("argument", "output", "temp", "alias"))
    print(f"{cell_key(model, devices, tensor)} {optimizer:20s} {mem['total'] / GIB:7.2f} GiB  ({parts}) "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    return mem


def measure_target(model: str, devices: int, optimizer: str, target: str, implementation: str,
                   tensor: int = 1) -> dict[str, Any]:
    """One cell compiled for `devices` compile-only devices of chip `target`: bytes, cost and whether it fits."""
    start = time.perf_counter()
    jax.clear_caches()  # a worker's previous cell may have traced kernels for another mesh
    name = aot.target_for(target, devices)
    info = aot.target_info(name)
    mesh = aot.mesh(name, shd.MeshConfig(fsdp=-1, tensor=tensor))
    section = dataclasses.replace(OPTIMIZER_SECTIONS[optimizer], implementation=implementation)
    if section.kl_control:
        section = dataclasses.replace(section, probe_responses=PROBES_PER_DEVICE * devices)
    out: dict[str, Any] = {"target": name, "device_kind": mesh.devices.flat[0].device_kind,
                           "hbm_bytes": info.hbm_bytes}
    try:
        out.update(rl_step_memory(paper_numerics(MODELS[model], SEQ_LEN), section, mesh, seq_len=SEQ_LEN,
                                  prompt_len=PROMPT_LEN, logprob_chunk=LOGPROB_CHUNK, with_cost=True))
        # XLA:GPU compiles whatever the size, and the TPU compiler's own check (its HLO temporaries against the
        # usable HBM) can pass a step whose argument + output + temp − alias is above the chip's HBM
        out["fits"] = out["total"] <= info.hbm_bytes
    except Exception as err:  # the compiler's refusal is the result
        oom = parse_oom(str(err))
        if oom is None:
            raise
        out.update(fits=False, required=oom[0], available=oom[1],
                   message=next(line for line in str(err).splitlines() if "hbm" in line.lower() or "HBM" in line))
    out["seconds"] = round(time.perf_counter() - start, 1)
    size = out.get("total", out.get("required"))
    print(f"{name} {cell_key(model, devices, tensor)} {optimizer:22s} {implementation:6s} {size / GIB:7.2f} GiB "
          f"{'fits' if out['fits'] else 'DOES NOT FIT'} {out['seconds']:.0f}s", flush=True)
    return out


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
    parser.add_argument("--target", default="cpu",
                        help="chip compiled for: cpu (fake CPU devices) or one of " + ", ".join(
                            t.split(":")[0] for t in aot.TARGETS if not t.startswith("cpu")))
    parser.add_argument("--implementations", nargs="*", default=["xla", "pallas"], choices=["xla", "pallas"],
                        help="with --target: LoGRA's kernels (the other optimizers have none: xla only)")
    parser.add_argument("--tables", action="store_true", help="print the tables of targets/*.json, plot them")
    args = parser.parse_args()
    if args.tables:
        print(target_tables(args.out / "targets"))
        print(cost_table(args.out / "targets"))
        print(step_ratio_table(args.out / "targets"))
        plot_targets(args.out / "targets", args.out / "targets.png")
        return
    if args.target != "cpu":
        run_target(args)
        return
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


def run_target(args: argparse.Namespace) -> None:
    """The cells for one chip, merged into targets/<chip>.json as each finishes (runs add up)."""
    cells = [(m, n, o, impl) for m in args.models for n in args.devices for o in args.optimizers
             for impl in args.implementations if impl == "xla" or OPTIMIZER_SECTIONS[o].name == "logra"]
    path = args.out / "targets" / f"{args.target}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(measure_target, m, n, o, args.target, impl, args.tensor): (m, n, o, impl)
                   for m, n, o, impl in cells}
        for future in concurrent.futures.as_completed(futures):
            model, n, opt, impl = futures[future]
            try:
                cell = future.result()
            except Exception as err:  # reported in the file, not dropped
                cell = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
                print(f"{args.target} {cell_key(model, n, args.tensor)} {opt} {impl}: {cell['error']}", flush=True)
            report = json.loads(path.read_text()) if path.exists() else {"target": args.target, "cells": {}}
            report["jax"] = jax.__version__
            report["cells"].setdefault(cell_key(model, n, args.tensor), {}).setdefault(opt, {})[impl] = cell
            path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(cells)} cells in {time.perf_counter() - start:.0f} s → {path}")


def _target_reports(folder: Path) -> list[dict[str, Any]]:
    order = {t.split(":")[0]: i for i, t in enumerate(aot.TARGETS)}
    return sorted((json.loads(p.read_text()) for p in folder.glob("*.json")),
                  key=lambda rep: order.get(rep["target"], 99))


def _fits(cell: dict[str, Any]) -> bool:
    return cell["total"] <= cell["hbm_bytes"] if "total" in cell else cell.get("fits", True)


def _cell_text(cell: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    if not cell:
        return "–"
    if "error" in cell:
        return "error"
    if not cell["fits"] and "required" in cell:
        return f"**OOM** {cell['required'] / GIB:.2f}"
    text = f"{cell['total'] / GIB:.2f}" + ("" if _fits(cell) else " **> HBM**")
    if base and "total" in base and cell is not base:
        text += f" ({cell['total'] / base['total']:.0%})"
    return text


def target_tables(folder: Path) -> str:
    """Markdown per chip: GiB per device (xla; pallas for LoGRA), OOM with the compiler's required bytes."""
    out = []
    for rep in _target_reports(folder):
        columns = [(o, impl) for o in OPTIMIZERS for impl in ("xla", "pallas")
                   if any(impl in row.get(o, {}) for row in rep["cells"].values())]
        hbm = next((c.get("hbm_bytes") for row in rep["cells"].values() for o in row.values() for c in o.values()
                    if c.get("hbm_bytes")), None)
        kind = next((c.get("device_kind") for row in rep["cells"].values() for o in row.values() for c in o.values()
                     if c.get("device_kind")), "")
        out.append(f"**{rep['target']}** ({kind}, {hbm / GIB:.0f} GiB HBM per device; jax {rep.get('jax')})\n")
        out.append("| model @ devices | " + " | ".join(o + (" (pallas)" if impl == "pallas" else "")
                                                    for o, impl in columns) + " |")
        out.append("|---" * (len(columns) + 1) + "|")
        for key, row in rep["cells"].items():
            base = row.get("adamw", {}).get("xla")
            out.append(f"| {key} | " + " | ".join(_cell_text(row.get(o, {}).get(impl), base) for o, impl in columns)
                       + " |")
        out.append("")
    return "\n".join(out)


def _roofline(cell: dict[str, Any]) -> aot.Roofline:
    return aot.roofline(cell["flops"], cell["bytes_accessed"], cell["collective_bytes"], cell["target"])


def cost_table(folder: Path) -> str:
    """Markdown: per-device flops, HBM bytes and collective bytes of each compiled step with every loop iteration
    counted (`logra_jax.planner.hlo_cost`), the compiler's own flop count beside it (loop bodies once), and the roofline
    (`aot.roofline`: max(F / peak bf16 FLOP/s, B / HBM bandwidth) + C / link bandwidth), with its ratio to AdamW
    and to AdamW on LoGRA's targets."""
    lines = ["| target | model @ devices | optimizer | impl | GFLOP | XLA's GFLOP (loops once) | HBM GB | "
             "collective GB | compute ms | memory ms | collective ms | roofline ms | ÷ adamw | ÷ adamw_targets |",
             "|---" * 14 + "|"]
    for rep in _target_reports(folder):
        for key, row in rep["cells"].items():
            times: dict[str, float] = {}
            for opt in OPTIMIZERS:
                for impl, cell in row.get(opt, {}).items():
                    if cell.get("matmul_flops") is None:  # a cell measured before the loop-aware count
                        continue
                    r = _roofline(cell)
                    seconds = times[f"{opt}/{impl}"] = r.seconds
                    ratios = [f"{seconds / times[b]:.2f}" if b in times else "–"
                              for b in ("adamw/xla", "adamw_targets/xla")]
                    xla = "–" if cell.get("xla_flops") is None else f"{cell['xla_flops'] / 1e9:.0f}"
                    uncounted = f" ({cell['uncounted_custom_calls']} kernels uncounted)" if cell.get(
                        "uncounted_custom_calls") else ""
                    lines.append(f"| {cell['target']} | {key} | {opt} | {impl} | "
                                 f"{cell['flops'] / 1e9:.0f}{uncounted} | {xla} | {cell['bytes_accessed'] / 1e9:.1f} | "
                                 f"{cell['collective_bytes'] / 1e9:.2f} | {r.compute * 1e3:.1f} | "
                                 f"{r.memory * 1e3:.1f} | {r.collective * 1e3:.1f} | {seconds * 1e3:.1f} | "
                                 + " | ".join(ratios) + " |")
    return "\n".join(lines)


PAPER_SEQUENCES_PER_DEVICE = 64  # configs/paper_qwen2.5_math.py: 256 prompts × 1 sample per step over 4 devices


def step_ratio_table(folder: Path, per_device: tuple[int, ...] = (1, 8, PAPER_SEQUENCES_PER_DEVICE)) -> str:
    """Markdown: roofline time of a whole step of M sequences per device, LoGRA+KL ÷ AdamW-targets and LoGRA ÷
    AdamW-targets, from the one-sequence cells: each microbatch costs the optimizer's one-sequence step (its
    once-per-step update counted M times: an upper bound), the KL probe (LoGRA+KL − LoGRA) once per step."""
    lines = ["| target | model @ devices | " + " | ".join(
        f"M = {m}: LoGRA ÷ AdamW-targets, LoGRA+KL ÷ AdamW-targets" for m in per_device) + " |",
        "|---" * (2 + len(per_device)) + "|"]
    for rep in _target_reports(folder):
        for key, row in rep["cells"].items():
            times = {}
            for opt in ("adamw_targets", "logra_sketch_native", "logra_sketch_native_kl"):
                cell = row.get(opt, {}).get("xla", {})
                if cell.get("matmul_flops") is not None:
                    times[opt] = _roofline(cell).seconds
            if len(times) < 3:
                continue
            probe = times["logra_sketch_native_kl"] - times["logra_sketch_native"]
            cells = [f"{times['logra_sketch_native'] / times['adamw_targets']:.2f}, "
                     f"{(m * times['logra_sketch_native'] + probe) / (m * times['adamw_targets']):.2f}"
                     for m in per_device]
            lines.append(f"| {rep['target']} | {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_targets(folder: Path, path: Path) -> None:
    """One panel per model @ devices: GiB per device by optimizer, a bar per chip (hatched: does not fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = _target_reports(folder)
    keys = list(dict.fromkeys(k for rep in reports for k in rep["cells"]))
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        opts = [o for o in OPTIMIZERS if any(o in rep["cells"].get(key, {}) for rep in reports)]
        width = 0.8 / max(1, len(reports))
        for i, rep in enumerate(reports):
            row = rep["cells"].get(key, {})
            xs = [j + (i - (len(reports) - 1) / 2) * width for j in range(len(opts))]
            cells = [row.get(o, {}).get("xla", {}) for o in opts]
            ys = [c.get("total", c.get("required", 0)) / GIB for c in cells]
            bars = ax.bar(xs, ys, width, label=rep["target"])
            for bar, c in zip(bars, cells):
                if c and not _fits(c):
                    bar.set_hatch("//")
        ax.set_xticks(range(len(opts)), opts, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{key}: per-device GiB by the real compilers (hatched: does not fit)", fontsize=9)
        ax.set_ylabel("GiB per device")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
