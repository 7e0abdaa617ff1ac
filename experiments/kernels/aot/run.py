"""Every Pallas kernel compiled by the real TPU and NVIDIA compilers at real shapes, without a device.

  JAX_PLATFORMS=cpu .venv-tpu/bin/python experiments/kernels/aot/run.py --targets v4:2x2x1 v5e:2x4 v5p:2x2x1 v6e:2x4
  JAX_PLATFORMS=cpu .venv-cuda/bin/python experiments/kernels/aot/run.py --targets h100:8 h200:8 a100:8
  .venv/bin/python experiments/kernels/aot/run.py --table        # README table from the JSON files

For each target (logra_jax.planner.aot) and each of the seven target projections of Qwen2.5-Math-1.5B, Qwen2.5-Math-7B
and the 27B-class preset (q, k, v, o, gate, up, down: X [T, k_in] → y [T, d_out]; T = 4096; r ∈ {64, 256};
bf16 activations, fp32 weights and projection, as the paper's numerics), the kernels that
`implementation="pallas"` dispatches to — the fused forward (y, P = X K, X Aᵀ), the fused backward
(dX, S = H Kᵀ, Hᵀ P), the merge K + Aᵀ Uᵀ and RowAdam's row moment (paper and NeMo variants) — are traced for
one compile-only device of the target (`kernels.backend.compiling_for`) and compiled by its compiler: Mosaic TPU
for the TPU kernels, Triton + ptxas through XLA:GPU for the GPU ones. The TPU backward is also compiled as it was
before blocks were chosen per chip (blocks 256/512/512, default scoped-VMEM limit) to show what failed.

Writes experiments/kernels/aot/<target>.json (one row per kernel × shape): compiled or not, the compiler's message,
the blocks, the VMEM the TPU kernels plan for (their footprint formula reproduces the compiler's own report) and
the limit they request, and whether the dispatcher fell back to XLA instead (no Pallas custom call in the HLO).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from logra_jax.kernels import backend, gpu
from logra_jax.kernels import project as proj
from logra_jax.kernels.merge import merge
from logra_jax.kernels.row_moment import row_moment
from logra_jax.models.config import preset
from logra_jax.planner import aot

HERE = Path(__file__).parent
MODELS = {"1.5B": "qwen2.5-1.5b", "7B": "qwen2.5-7b", "27B": "dense-27b"}
T = 4096
RANKS = (64, 256)
MIB = 2**20
GPU_BLOCKS = dict(block_t=64, block_d=64, block_k=64)  # sketched_linear's GPU default


def projections(model: str) -> dict[tuple[int, int], list[str]]:
    """(k_in, d_out) → the projections of that shape, for the preset `model`."""
    cfg = preset(model)
    q, kv, h, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, shape in (("q", (h, q)), ("k", (h, kv)), ("v", (h, kv)), ("o", (q, h)), ("gate", (h, ff)),
                        ("up", (h, ff)), ("down", (ff, h))):
        shapes.setdefault(shape, []).append(name)
    return shapes


def kernels(k: int, d: int, r: int, platform: str, chip: backend.KernelTarget) -> dict[str, tuple[Any, tuple, dict]]:
    """name → (function, abstract argument shapes and dtypes, what the TPU kernel plans) for one projection."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    fwd_vmem = functools.partial(proj.forward_vmem_bytes, r=r, x_bytes=2, k_bytes=4, a_bytes=4)
    bwd_vmem = functools.partial(proj.backward_vmem_bytes, d=d, r=r, h_bytes=2, p_bytes=2, k_bytes=4)
    fwd_args = (((T, k), bf16), ((k, d), f32), ((r, k), f32))
    bwd_args = (((T, d), bf16), ((T, r), bf16), ((k, d), f32))
    merge_args = (((k, d), f32), ((d, r), f32), ((r, k), f32))
    moment_args = (((d, r), f32), ((d,), f32))
    common = {
        "merge": (lambda *z: merge(*z, round_bf16=True, implementation="pallas"), merge_args, {}),
        "row_moment_paper": (lambda s, v: row_moment(s, v, 2, implementation="pallas"), moment_args, {}),
        "row_moment_nemo": (lambda s, v: row_moment(s, v, 2, variant="nemo", implementation="pallas"),
                            moment_args, {}),
    }
    if platform == "gpu":
        return {"fused_forward": (functools.partial(gpu.fused_forward_gpu, **GPU_BLOCKS), fwd_args,
                                  {"blocks": (64, 64, 64)}),
                "fused_backward": (functools.partial(gpu.fused_backward_gpu, **GPU_BLOCKS), bwd_args,
                                   {"blocks": (64, 64, 64)}),
                **common}
    budget = proj.vmem_budget(chip)
    plans = {}
    for name, vmem in (("fused_forward", fwd_vmem), ("fused_backward", bwd_vmem)):
        blocks = proj.choose_blocks(vmem, (T, d, k), budget)
        plans[name] = {"blocks": blocks, "vmem_planned": None if blocks is None else vmem(*blocks),
                       "vmem_budget": budget}
        params = None if blocks is None else backend.compiler_params(("arbitrary",), vmem(*blocks), chip)
        plans[name]["vmem_limit_requested"] = None if params is None else params.vmem_limit_bytes
    before = (256, 512, 512)
    return {
        "fused_forward": (proj.fused_forward, fwd_args, plans["fused_forward"]),
        "fused_backward": (proj.fused_backward, bwd_args, plans["fused_backward"]),
        # as before this change: fixed blocks, no VMEM limit requested (the 16 MiB default scope)
        "fused_backward_before": (
            lambda h, p, kk: proj._fused_backward(h, p, kk, interpret=False, blocks=before, vmem_bytes=0,
                                                  target=chip),
            bwd_args, {"blocks": before, "vmem_planned": bwd_vmem(*before), "vmem_limit_requested": None}),
        **common,
    }


_VMEM_OOM = re.compile(r"scoped allocation with size ([\d.]+)([KMG]) and limit ([\d.]+)([KMG])", re.IGNORECASE)


def _message(err: Exception) -> str:
    text = f"{type(err).__name__}: {err}"
    found = _VMEM_OOM.search(text)
    if found:  # the one line that matters from Mosaic's long report
        return f"CompileTimeScopedVmemOom: scoped allocation {found[1]}{found[2]}, limit {found[3]}{found[4]}"
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: " + " | ".join(lines[:2])[:400]


def compile_row(fn, args, device: jax.Device, platform: str) -> dict[str, Any]:
    sharding = SingleDeviceSharding(device)
    abstract = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in args]
    marker = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    start = time.perf_counter()
    try:
        with backend.compiling_for(device):
            lowered = jax.jit(fn).lower(*abstract)
        pallas_calls = lowered.as_text().count(marker)
        lowered.compile()
        return {"compiles": True, "pallas_calls": pallas_calls, "fallback_xla": pallas_calls == 0,
                "seconds": round(time.perf_counter() - start, 2)}
    except Exception as err:  # every cell is reported, the run goes on
        return {"compiles": False, "message": _message(err), "seconds": round(time.perf_counter() - start, 2)}


def run_target(target: str) -> dict[str, Any]:
    info = aot.target_info(target)
    device = aot.devices(target)[0]
    chip = backend.target_of(device)
    rows = []
    for label, model in MODELS.items():
        for (k, d), names in projections(model).items():
            for r in RANKS:
                for kernel, (fn, args, plan) in kernels(k, d, r, info.platform, chip).items():
                    row = {"model": label, "projections": names, "k": k, "d": d, "r": r, "kernel": kernel,
                           **plan, **compile_row(fn, args, device, info.platform)}
                    rows.append(row)
                    jax.clear_caches()
                    status = "ok" if row["compiles"] else "FAILED " + row["message"][:140]
                    print(f"{target} {label:>4} {'/'.join(names):>8} k={k:5d} d={d:5d} r={r:3d} {kernel:>22} "
                          f"{status}{' (XLA fallback)' if row.get('fallback_xla') else ''}", flush=True)
    return {"target": target, "device_kind": device.device_kind, "jax": jax.__version__,
            "vmem_bytes": info.vmem_bytes, "shared_memory_per_block": info.shared_memory_per_block, "T": T,
            "rows": rows}


def table(reports: list[dict[str, Any]]) -> str:
    """Markdown: per target and kernel, shapes that compile / fall back / fail, and the failures' messages."""
    lines = ["| target | kernel | compiles (Pallas) | falls back to XLA | fails | compiler's message (first failure) | "
             "VMEM planned, max (MiB) |", "|---" * 7 + "|"]
    for rep in reports:
        kernels_seen = list(dict.fromkeys(row["kernel"] for row in rep["rows"]))
        for kernel in kernels_seen:
            rows = [row for row in rep["rows"] if row["kernel"] == kernel]
            ok = [row for row in rows if row["compiles"] and not row.get("fallback_xla")]
            fallback = [row for row in rows if row["compiles"] and row.get("fallback_xla")]
            failed = [row for row in rows if not row["compiles"]]
            first = failed[0] if failed else None
            message = (f"{first['model']} {'/'.join(first['projections'])} r={first['r']}: {first['message'][:120]}"
                       if first else "")
            planned = [row["vmem_planned"] for row in rows if row.get("vmem_planned")]
            vmem = f"{max(planned) / MIB:.2f}" if planned else "–"
            fb = ", ".join(f"{row['model']} {'/'.join(row['projections'])} r={row['r']}" for row in fallback)
            lines.append(f"| {rep['target']} ({rep['device_kind']}) | {kernel} | {len(ok)}/{len(rows)} | "
                         f"{fb or 0} | {len(failed)} | {message} | {vmem} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--table", action="store_true", help="print the Markdown table of every <target>.json")
    args = parser.parse_args()
    for target in args.targets:
        start = time.perf_counter()
        report = run_target(target)
        report["seconds"] = round(time.perf_counter() - start, 1)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{target.replace(':', '_')}.json").write_text(json.dumps(report, indent=1) + "\n")
        failed = sum(not row["compiles"] for row in report["rows"])
        print(f"{target}: {len(report['rows']) - failed}/{len(report['rows'])} compiled in {report['seconds']} s",
              flush=True)
    if args.table:
        order = {t.split(":")[0]: i for i, t in enumerate(aot.TARGETS)}
        reports = sorted((json.loads(p.read_text()) for p in args.out.glob("*.json")),
                         key=lambda rep: order.get(rep["target"].split(":")[0], 99))
        print(table(reports))
    if not args.targets and not args.table:
        parser.error("give --targets and/or --table")
    sys.exit(0)


if __name__ == "__main__":
    main()
