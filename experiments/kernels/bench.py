"""Time each LoGRA kernel, XLA against Pallas, and report % of roofline at Qwen2.5-1.5B and 7B MLP layer shapes.

  python experiments/kernels/bench.py                         # on the machine's default backend
  python experiments/kernels/bench.py --out-dir /tmp/k --repeats 50 --tokens 8192

Kernels (LoGRA notation: X [T, k], H [T, d], K [k, d] Flax layout, A [r, k], S/U/D [d, r]):
  project_fwd    y = X K and P = X Aᵀ           (XLA: two einsums; Pallas: fused_forward)
  project_bwd    dX = H Kᵀ and S = Hᵀ P         (XLA: two einsums; Pallas: fused_backward)
  merge          K ← K + Aᵀ bf16(U)ᵀ, donated   (XLA: merge_reference; Pallas: tiled, aliased)
  row_moment     RowAdam v, ρ and D, paper and NeMo variants
Roofline: t_min = max(bytes / measured copy bandwidth, flops / measured bf16 matmul rate), with the minimal bytes
each kernel must move (every operand read once, every result written once); % of roofline = 100 · t_min / t.
Times are medians over `--repeats` calls, each ended by block_until_ready, after one warm-up (compile) call.

On a CPU the Pallas kernels only run in the interpreter: the script then uses small shapes and labels every
number as a sanity run, NOT a speed measurement. On a GPU the Pallas kernels do not lower (see
logra_jax/kernels/backend.py) and are reported as errors next to the XLA numbers.
Writes bench_<platform>.json and bench_<platform>.png under --out-dir (default: this folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.kernels.merge import merge, merge_reference
from logra_jax.kernels.project import fused_backward, fused_forward
from logra_jax.kernels.row_moment import row_moment
from logra_jax.models.config import preset

HERE = Path(__file__).resolve().parent


def timed(fn: Callable, args: tuple, repeats: int, chain: bool = False) -> tuple[float, Any]:
    """Median wall time (s) of fn(*args); with `chain`, each call's output replaces args[0] (donated buffers)."""
    out = jax.block_until_ready(fn(*args))
    if chain:
        args = (out, *args[1:])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
        if chain:
            args = (out, *args[1:])
    return statistics.median(times), out


def measure_peaks(platform: str, repeats: int) -> dict[str, float]:
    """Achievable HBM bandwidth (a large elementwise copy) and bf16 matmul rate (a large square matmul)."""
    n_copy, n_mm = (1 << 28, 8192) if platform != "cpu" else (1 << 24, 1024)
    x = jnp.ones((n_copy,), jnp.float32)
    t_copy, _ = timed(jax.jit(lambda v: v + 1.0), (x,), repeats)
    a = jnp.ones((n_mm, n_mm), jnp.bfloat16)
    t_mm, _ = timed(jax.jit(lambda p, q: p @ q), (a, a), repeats)
    return {"bandwidth_bytes_per_s": 2 * 4 * n_copy / t_copy, "matmul_flops_per_s": 2 * n_mm ** 3 / t_mm}


def layer_shapes(small: bool, tokens: int) -> list[dict[str, Any]]:
    if small:
        return [{"model": "small", "layer": "mlp.up", "t": 256, "k": 192, "d": 320},
                {"model": "small", "layer": "mlp.down", "t": 256, "k": 320, "d": 192}]
    shapes = []
    for model in ("qwen2.5-1.5b", "qwen2.5-7b"):
        cfg = preset(model)
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        shapes.append({"model": model, "layer": "mlp.up", "t": tokens, "k": hidden, "d": inter})
        shapes.append({"model": model, "layer": "mlp.down", "t": tokens, "k": inter, "d": hidden})
    return shapes


def cases(shape: dict[str, Any], rank: int, interpret: bool, blocks: dict[str, int]) -> list[dict[str, Any]]:
    """For one layer shape: per kernel, the inputs, the minimal bytes/flops and the XLA and Pallas callables."""
    t, k, d, r = shape["t"], shape["k"], shape["d"], rank
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (t, k), jnp.bfloat16)
    h = jax.random.normal(keys[1], (t, d), jnp.bfloat16)
    kernel = jax.random.normal(keys[2], (k, d), jnp.bfloat16)
    a = jnp.sign(jax.random.normal(keys[3], (r, k), jnp.float32)) / np.sqrt(r)
    p = jax.random.normal(keys[4], (t, r), jnp.bfloat16)
    s = jax.random.normal(keys[5], (d, r), jnp.float32)
    v = jnp.zeros((d,), jnp.float32)
    bt, bd, bk = blocks["block_t"], blocks["block_d"], blocks["block_k"]
    pallas = dict(interpret=interpret, block_t=bt, block_d=bd, block_k=bk)
    out = [
        {"kernel": "project_fwd", "args": (x, kernel, a), "bytes": 2 * (t * k + k * d + t * d + t * r) + 4 * r * k,
         "flops": 2 * t * k * (d + r),
         "xla": jax.jit(lambda x, kr, a: (x @ kr, jnp.einsum("tk,rk->tr", x, a.astype(x.dtype),
                                                               preferred_element_type=jnp.float32).astype(x.dtype))),
         "pallas": jax.jit(lambda x, kr, a: fused_forward(x, kr, a, **pallas))},
        {"kernel": "project_bwd", "args": (h, p, kernel), "bytes": 2 * (t * d + t * r + k * d + t * k) + 4 * d * r,
         "flops": 2 * t * d * (k + r),
         "xla": jax.jit(lambda h, p, kr: (h @ kr.T, jnp.einsum("td,tr->dr", h, p, preferred_element_type=jnp.float32))),
         "pallas": jax.jit(lambda h, p, kr: fused_backward(h, p, kr, **pallas))},
        {"kernel": "merge", "args": (kernel, -1e-3 * s, a), "chain": True,
         "bytes": 2 * 2 * k * d + 4 * (d * r + r * k), "flops": 2 * k * d * r,
         "xla": jax.jit(lambda kr, u, a: merge_reference(kr, u, a, round_bf16=True), donate_argnums=0),
         "pallas": jax.jit(lambda kr, u, a: merge(kr, u, a, round_bf16=True, implementation="pallas",
                                                  interpret=interpret, block_d=bd, block_k=bk), donate_argnums=0)},
    ]
    for variant in ("paper", "nemo"):
        out.append({
            "kernel": f"row_moment_{variant}", "args": (s, v), "bytes": 4 * (2 * d * r + 2 * d), "flops": 4 * d * r,
            "xla": jax.jit(lambda s, v, variant=variant: row_moment(s, v, 3, variant=variant)),
            "pallas": jax.jit(lambda s, v, variant=variant: row_moment(
                s, v, 3, variant=variant, implementation="pallas", interpret=interpret, block_d=bd))})
    return out


def max_rel_diff(a: Any, b: Any) -> float:
    diffs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        diffs.append(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)))
    return max(diffs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    platform = jax.default_backend()
    small = platform == "cpu"
    if small:
        print("CPU: Pallas kernels run in the interpreter on small shapes -- sanity timing, NOT a speed measurement")
    peaks = measure_peaks(platform, args.repeats)
    # Small blocks on CPU so the interpreter walks real multi-block grids (edge blocks included).
    default_block = 128 if small else None
    blocks = {name: getattr(args, name) or default_block or default
              for name, default in (("block_t", 256), ("block_d", 512), ("block_k", 512))}
    results = []
    for shape in layer_shapes(small, args.tokens):
        rank = min(args.rank, 32) if small else args.rank
        for case in cases(shape, rank, interpret=small, blocks=blocks):
            t_roof = max(case["bytes"] / peaks["bandwidth_bytes_per_s"], case["flops"] / peaks["matmul_flops_per_s"])
            row = {**shape, "r": rank, "kernel": case["kernel"], "bytes": case["bytes"], "flops": case["flops"],
                   "roofline_s": t_roof}
            outputs = {}
            for impl in ("xla", "pallas"):
                # merge donates its first argument: give each implementation its own copy.
                call_args = (jnp.copy(case["args"][0]), *case["args"][1:])
                try:
                    seconds, outputs[impl] = timed(case[impl], call_args, args.repeats, case.get("chain", False))
                    row[impl] = {"median_s": seconds, "pct_roofline": 100.0 * t_roof / seconds}
                except (NotImplementedError, ValueError) as err:  # Pallas off TPU: report, keep measuring XLA
                    row[impl] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
            if len(outputs) == 2 and not case.get("chain"):
                row["max_rel_diff_pallas_vs_xla"] = max_rel_diff(outputs["pallas"], outputs["xla"])
            results.append(row)
            print(_line(row, not small), flush=True)
    return {
        "platform": platform,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "meaningful_for_speed": not small,
        "note": ("CPU: Pallas runs in the interpreter on small shapes; a sanity run, not a speed measurement"
                 if small else "median of repeats; roofline from measured copy bandwidth and bf16 matmul rate"),
        "command": "python experiments/kernels/bench.py " + " ".join(
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if v is not None and v != HERE),
        "blocks": blocks,
        "peaks": peaks,
        "results": results,
    }


def _line(row: dict[str, Any], meaningful: bool) -> str:
    def cell(impl):
        entry = row[impl]
        if "error" in entry:
            return f"{impl}: {entry['error'][:60]}"
        pct = f" {entry['pct_roofline']:6.1f}% of roofline" if meaningful else ""
        return f"{impl} {1e3 * entry['median_s']:9.3f} ms{pct}"
    diff = row.get("max_rel_diff_pallas_vs_xla")
    diff = f"  rel diff {diff:.1e}" if diff is not None else ""
    return f"{row['model']:>13} {row['layer']:>8} {row['kernel']:>17}  {cell('xla')}  {cell('pallas')}{diff}"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['model']}\n{r['layer']}\n{r['kernel']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 5))
    xs = np.arange(len(rows))
    meaningful = report["meaningful_for_speed"]
    for offset, impl in ((-0.2, "xla"), (0.2, "pallas")):
        if meaningful:
            vals = [r[impl].get("pct_roofline", np.nan) for r in rows]
        else:
            vals = [1e3 * r[impl].get("median_s", np.nan) for r in rows]
        ax.bar(xs + offset, vals, width=0.4, label=impl)
    ax.set_xticks(xs, labels, fontsize=6, rotation=45, ha="right")
    ax.set_ylabel("% of roofline" if meaningful else "median time (ms)")
    title = f"LoGRA kernels on {report['device']} (jax {report['jax']})"
    if not report["meaningful_for_speed"]:
        title += "\nCPU + Pallas interpreter: sanity timing, NOT meaningful for speed"
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4096, help="T, tokens per layer call (accelerators)")
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--block-t", type=int, default=None, help="default 256 (128 on CPU)")
    parser.add_argument("--block-d", type=int, default=None, help="default 512 (128 on CPU)")
    parser.add_argument("--block-k", type=int, default=None, help="default 512 (128 on CPU)")
    args = parser.parse_args()
    report = run(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{report['platform']}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out_dir / f"{stem}.png")
    print(f"wrote {args.out_dir / stem}.json and .png")


if __name__ == "__main__":
    main()
