"""Each LoGRA kernel, XLA against Pallas: error against a full-precision reference, time, and % of roofline.

  python experiments/kernels/bench.py                  # default backend; writes bench_<platform>.json/.png here
  python experiments/kernels/bench.py --out-dir /tmp/k --repeats 50 --tokens 8192 --rank 256
  python experiments/kernels/bench.py --smoke          # tiny shapes (what the tests and CPU run)

Kernels (LoGRA notation: X [T, k], H [T, d], K [k, d] Flax layout, A [r, k], S/U/D [d, r]); on a GPU the
Pallas column is the Triton kernels of logra_jax/kernels/gpu.py (through the public wrappers), on a TPU the
Mosaic ones, on CPU the TPU kernels in the interpreter (a sanity run, NOT a speed measurement):
  project_fwd    y = X K and P = X Aᵀ            one layer, T tokens
  project_bwd    dX = H Kᵀ and S = Hᵀ P          one layer, T tokens
  merge          K ← K + Aᵀ bf16(U)ᵀ, donated    all L layers of a stacked [L, k, d] weight (vmapped, as the
                                                optimizer applies it), float32 K (the trainer's weights)
  row_moment_*   RowAdam v and D, paper / NeMo   all L layers' sketches [L, d, r] (vmapped)
Shapes: Qwen2.5-1.5B and 7B MLP `up` [k = hidden, d = intermediate] and `down` [k = intermediate, d = hidden],
T = 4096, r = 256; activations bf16 (and float32 for 1.5B `up`), weights float32.

Error: max |out − ref| / max |ref| per output (for the merge, of the update out − K), ref = the same formula in
XLA at float32 HIGHEST precision on the same random inputs (fresh per kernel; never zeros).
Time: median over `--repeats` samples of `--inner` calls each, after a warm-up (compile) call.
Roofline: t_min = max(bytes / copy bandwidth, flops / bf16 matmul rate), both measured in the same run (a 1 GiB
elementwise copy; a random 8192³ bf16 matmul); bytes = every operand read once and every result written once at
its dtype; % of roofline = 100 · t_min / t.
On a GPU each Pallas kernel also runs a few block/warp settings (`SWEEPS`); the table shows the default's and
the best one's time. `--budget-s` stops starting new shapes once spent (what was measured is written).
Writes bench_<platform>.json and bench_<platform>.png under --out-dir (default: this folder).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.kernels import gpu
from logra_jax.kernels.merge import merge, merge_reference
from logra_jax.kernels.project import (
    fused_backward,
    fused_backward_reference,
    fused_forward,
    fused_forward_reference,
)
from logra_jax.kernels.row_moment import _row_moment_gpu, row_moment, row_moment_reference
from logra_jax.models.config import preset

HERE = Path(__file__).resolve().parent

# GPU settings tried per kernel besides the default (first entry = the wrappers' default).
SWEEPS: dict[str, list[dict[str, Any]]] = {
    "project_fwd": [{}, dict(block_t=128, block_d=128, block_k=32, num_warps=8),
                    dict(block_t=128, block_d=64, block_k=64, num_warps=4)],
    "project_bwd": [{}, dict(block_t=128, block_d=32, block_k=128, num_warps=8),
                    dict(block_t=64, block_d=64, block_k=128, num_warps=4)],
    "merge": [{}, dict(block_d=128, block_k=64, num_warps=8, num_stages=2), dict(fp32_dot="bf16x3"),
              dict(fp32_dot="bf16"), dict(fp32_dot="tf32")],
    "row_moment_paper": [{}, dict(block_d=16), dict(block_d=64, num_warps=8)],
    "row_moment_nemo": [{}, dict(block_d=16), dict(block_d=64, num_warps=8)],
}


def timed(fn: Callable, args: tuple, repeats: int, inner: int = 1, chain: bool = False) -> tuple[float, Any]:
    """Median seconds per call of fn(*args) over `repeats` samples of `inner` back-to-back calls.

    With `chain`, each call's output replaces args[0] (a donated buffer, as in the merge).
    """
    out = jax.block_until_ready(fn(*args))
    if chain:
        args = (out, *args[1:])
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
            if chain:
                args = (out, *args[1:])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples), out


def measure_peaks(platform: str, repeats: int) -> dict[str, float]:
    """Achievable memory bandwidth (elementwise copy, bytes read + written) and bf16 matmul rate (random data)."""
    n_copy, n_mm = (1 << 28, 8192) if platform != "cpu" else (1 << 22, 512)
    x = jax.random.normal(jax.random.key(1), (n_copy,), jnp.float32)
    t_copy, _ = timed(jax.jit(lambda v: v * 1.5 + 1.0), (x,), repeats)
    a = jax.random.normal(jax.random.key(2), (n_mm, n_mm), jnp.bfloat16)
    t_mm, _ = timed(jax.jit(lambda p, q: p @ q), (a, a), repeats)
    return {"bandwidth_bytes_per_s": 2 * 4 * n_copy / t_copy, "matmul_flops_per_s": 2 * n_mm ** 3 / t_mm}


def layer_shapes(smoke: bool, tokens: int) -> list[dict[str, Any]]:
    if smoke:
        tiny = {"model": "tiny", "layer": "mlp.up", "t": 96, "k": 80, "d": 144, "layers": 2}
        return [{**tiny, "dtype": "bfloat16", "sweep": True}, {**tiny, "dtype": "float32", "sweep": False}]
    # Order = priority under --budget-s: 1.5B up (settings explored), 7B up, the downs, then 1.5B up in float32
    # (settings explored: the fp32 accuracy target).
    shapes = []
    for layer in ("mlp.up", "mlp.down"):
        for model in ("qwen2.5-1.5b", "qwen2.5-7b"):
            cfg = preset(model)
            k, d = (cfg.hidden_size, cfg.intermediate_size) if layer == "mlp.up" else \
                (cfg.intermediate_size, cfg.hidden_size)
            shapes.append({"model": model, "layer": layer, "t": tokens, "k": k, "d": d, "layers": cfg.num_layers,
                           "dtype": "bfloat16", "sweep": not shapes})
    shapes.append({**shapes[0], "dtype": "float32", "sweep": True})
    return shapes


def _highest(fn: Callable) -> Callable:
    def wrapped(*args):
        with jax.default_matmul_precision("highest"):
            return fn(*(jnp.asarray(a, jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args))
    return jax.jit(wrapped)


def _pallas(platform: str, target: str, smoke: bool) -> dict[str, Callable[..., Callable]]:
    """Per kernel: settings → the jitted Pallas callable (`target` "gpu": gpu.py's kernels, else the TPU ones).

    On CPU both sets run in the Pallas interpreter.
    """
    on_gpu = target == "gpu"
    interp = dict(interpret=True) if platform == "cpu" else {}
    small = dict(block_t=32, block_d=64, block_k=64) if smoke else {}

    def fwd(**kw):
        f = gpu.fused_forward_gpu if on_gpu else fused_forward
        return jax.jit(lambda x, kr, a: f(x, kr, a, **interp, **small, **kw))

    def bwd(**kw):
        f = gpu.fused_backward_gpu if on_gpu else fused_backward
        return jax.jit(lambda h, p, kr: f(h, p, kr, **interp, **small, **kw))

    def mrg(**kw):
        blocks = {"block_d": 64, "block_k": 64} if smoke else {}
        if on_gpu:
            one = lambda kr, u, a: gpu.merge_gpu(kr, u, a, round_bf16=True, **interp, **blocks, **kw)
        else:
            one = lambda kr, u, a: merge(kr, u, a, round_bf16=True, implementation="pallas",
                                         **interp, **blocks, **kw)
        return jax.jit(jax.vmap(one), donate_argnums=0)

    def rows(variant):
        def make(**kw):
            blocks = {"block_d": 64} if smoke and "block_d" not in kw else {}
            if on_gpu:  # the wrapper's GPU path itself, so the settings reach its kernels
                def one(s, v):
                    kw_all = {"block_d": None, **blocks, **kw}
                    return _row_moment_gpu(s, v, 3, b2=0.95, eps=1e-8, variant=variant,
                                           interpret=bool(interp), **kw_all)
            else:
                def one(s, v):
                    return row_moment(s, v, 3, variant=variant, implementation="pallas", **interp, **blocks, **kw)
            return jax.jit(jax.vmap(one))
        return make

    return {"project_fwd": fwd, "project_bwd": bwd, "merge": mrg, "row_moment_paper": rows("paper"),
            "row_moment_nemo": rows("nemo")}


def cases(shape: dict[str, Any], rank: int, seed: int) -> list[dict[str, Any]]:
    """For one layer shape: per kernel the inputs, minimal bytes and flops, and the XLA and reference callables."""
    t, k, d, r, n = shape["t"], shape["k"], shape["d"], rank, shape["layers"]
    act = jnp.dtype(shape["dtype"])
    ia = act.itemsize
    keys = jax.random.split(jax.random.key(seed), 8)
    x = jax.random.normal(keys[0], (t, k), act)
    h = jax.random.normal(keys[1], (t, d), act)
    kernel = jax.random.normal(keys[2], (k, d), jnp.float32) / np.sqrt(k)
    a = jnp.sign(jax.random.normal(keys[3], (r, k), jnp.float32)) / np.sqrt(r)
    p = jax.random.normal(keys[4], (t, r), act)
    stacked = jax.random.normal(keys[5], (n, k, d), jnp.float32) / np.sqrt(k)
    u = 1e-3 * jax.random.normal(keys[6], (n, d, r), jnp.float32)
    a_n = jnp.sign(jax.random.normal(keys[7], (n, r, k), jnp.float32)) / np.sqrt(r)
    s = jax.random.normal(keys[6], (n, d, r), jnp.float32)
    v = jnp.abs(jax.random.normal(keys[5], (n, d), jnp.float32))
    out = [
        {"kernel": "project_fwd", "args": (x, kernel, a), "flops": 2 * t * k * (d + r),
         "bytes": ia * (t * k + t * d + t * r) + 4 * (k * d + r * k),
         "xla": jax.jit(fused_forward_reference), "ref": _highest(fused_forward_reference)},
        {"kernel": "project_bwd", "args": (h, p, kernel), "flops": 2 * t * d * (k + r),
         "bytes": ia * (t * d + t * r + t * k) + 4 * (k * d + d * r),
         "xla": jax.jit(fused_backward_reference), "ref": _highest(fused_backward_reference)},
    ]
    if shape["dtype"] == "bfloat16":  # the optimizer-side kernels do not depend on the activation dtype
        one_merge = jax.vmap(lambda kr, uu, aa: merge_reference(kr, uu, aa, round_bf16=True))
        out.append({"kernel": "merge", "args": (stacked, u, a_n), "chain": True, "flops": 2 * n * k * d * r,
                    "bytes": n * (2 * 4 * k * d + 4 * (d * r + r * k)),
                    "xla": jax.jit(one_merge, donate_argnums=0), "ref": _highest(one_merge)})
        for variant in ("paper", "nemo"):
            one = jax.vmap(lambda s_, v_, variant=variant: row_moment_reference(s_, v_, 3, b2=0.95, eps=1e-8,
                                                                                variant=variant))
            out.append({"kernel": f"row_moment_{variant}", "args": (s, v), "flops": 6 * n * d * r,
                        "bytes": 4 * n * (2 * d * r + 2 * d), "xla": jax.jit(one), "ref": _highest(one)})
    return out


@jax.jit
def _rel_error_device(x: jax.Array, y: jax.Array) -> jax.Array:
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    err = jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30)
    return jnp.where(jnp.all(jnp.isfinite(x)), err, jnp.inf)


def rel_error(out: Any, ref: Any) -> float:
    """max over outputs of max |out − ref| / max |ref| (inf when out has a NaN or Inf), reduced on the device
    (host float64 copies of a 7B stacked weight would need tens of GB)."""
    return max(float(_rel_error_device(x, y))
               for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True))


def _measure(fn: Callable, case: dict[str, Any], ref: Any, repeats: int, inner: int, t_roof: float) -> dict:
    args = case["args"]
    chain = case.get("chain", False)
    try:
        first = jax.block_until_ready(fn(jnp.copy(args[0]), *args[1:]))
        if chain:  # the merge: compare the updates ΔW = out − K, not the (much larger) merged weights
            error = rel_error(first - args[0], ref - args[0])
        else:
            error = rel_error(first, ref)
        seconds, _ = timed(fn, (jnp.copy(args[0]), *args[1:]), repeats, 1 if chain else inner, chain)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
    return {"median_s": seconds, "pct_roofline": 100.0 * t_roof / seconds, "max_rel_error": error}


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] = lambda report: None) -> dict[str, Any]:
    platform = jax.default_backend()
    smoke = args.smoke or platform == "cpu"
    if platform == "cpu":
        print("CPU: Pallas kernels run in the interpreter on tiny shapes -- a sanity run, NOT a speed measurement")
    started = time.time()
    repeats = 3 if smoke else args.repeats
    peaks = measure_peaks(platform, repeats)
    print(f"peaks: {peaks['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s copy, "
          f"{peaks['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s bf16 matmul", flush=True)
    target = args.target if args.target != "auto" else ("gpu" if platform == "gpu" else "tpu")
    pallas = _pallas(platform, target, smoke)
    results: list[dict[str, Any]] = []
    report = {
        "platform": platform,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "pallas_kernels": target,
        "meaningful_for_speed": not smoke,
        "note": ("CPU / smoke: tiny shapes, Pallas possibly interpreted; a sanity run, not a speed measurement"
                 if smoke else "median of repeats; roofline from measured copy bandwidth and bf16 matmul rate"),
        "command": " ".join(sys.argv),
        "peaks": peaks,
        "seconds": 0.0,
        "results": results,
    }
    shapes = layer_shapes(smoke, args.tokens)
    for i, shape in enumerate(shapes):
        if time.time() - started > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: skipping {len(shapes) - i} shape(s)", flush=True)
            break
        rank = 16 if smoke else args.rank
        sweep = target == "gpu" and shape["sweep"]
        for case in cases(shape, rank, seed=i):
            if time.time() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: skipping {case['kernel']} and the rest", flush=True)
                break
            t_roof = max(case["bytes"] / peaks["bandwidth_bytes_per_s"], case["flops"] / peaks["matmul_flops_per_s"])
            ref = jax.block_until_ready(case["ref"](*case["args"]))
            row = {**{key: shape[key] for key in ("model", "layer", "t", "k", "d", "layers", "dtype")}, "r": rank,
                   "kernel": case["kernel"], "bytes": case["bytes"], "flops": case["flops"], "roofline_s": t_roof}
            row["xla"] = _measure(case["xla"], case, ref, repeats, args.inner, t_roof)
            settings = SWEEPS[case["kernel"]] if sweep else [{}]
            row["pallas_settings"] = []
            for kw in settings:
                entry = _measure(pallas[case["kernel"]](**kw), case, ref, repeats, args.inner, t_roof)
                row["pallas_settings"].append({"settings": kw, **entry})
            row["pallas"] = row["pallas_settings"][0]
            timed_ok = [e for e in row["pallas_settings"] if "median_s" in e]
            row["pallas_best"] = min(timed_ok, key=lambda e: e["median_s"]) if timed_ok else row["pallas"]
            results.append(row)
            print(_line(row, not smoke), flush=True)
            report["seconds"] = time.time() - started
            save(report)  # a kill later loses nothing measured so far
    report["seconds"] = time.time() - started
    return report


def _line(row: dict[str, Any], meaningful: bool) -> str:
    def cell(entry):
        if "error" in entry:
            return f"ERROR {entry['error'][:70]}"
        pct = f" {entry['pct_roofline']:5.1f}%" if meaningful else ""
        return f"{1e3 * entry['median_s']:8.3f} ms{pct} err {entry['max_rel_error']:.1e}"
    best = row["pallas_best"]
    extra = f" | best {cell(best)} {best.get('settings')}" if best is not row["pallas"] else ""
    return (f"{row['model']:>12} {row['layer']:>8} {row['dtype']:>8} {row['kernel']:>16}  xla {cell(row['xla'])}"
            f"  pallas {cell(row['pallas'])}{extra}")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['model']}\n{r['layer']} {r['dtype']}\n{r['kernel']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 5))
    xs = np.arange(len(rows))
    meaningful = report["meaningful_for_speed"]
    key = "pct_roofline" if meaningful else "median_s"
    scale = 1.0 if meaningful else 1e3
    for offset, name in ((-0.27, "xla"), (0.0, "pallas"), (0.27, "pallas_best")):
        ax.bar(xs + offset, [scale * r[name].get(key, np.nan) for r in rows], width=0.27, label=name)
    ax.set_xticks(xs, labels, fontsize=6, rotation=45, ha="right")
    ax.set_ylabel("% of roofline" if meaningful else "median time (ms)")
    title = f"LoGRA kernels on {report['device']} (jax {report['jax']})"
    if not meaningful:
        title += "\nsmoke run on tiny shapes: NOT meaningful for speed"
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--inner", type=int, default=5, help="back-to-back calls per timed sample")
    parser.add_argument("--tokens", type=int, default=4096, help="T, tokens per layer call")
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (always on CPU)")
    parser.add_argument("--target", choices=("auto", "tpu", "gpu"), default="auto",
                        help="which Pallas kernels (auto: the platform's; on CPU both run interpreted)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new shape after this many seconds")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{jax.default_backend()}"

    def save(report: dict[str, Any]) -> None:
        tmp = args.out_dir / f"{stem}.json.tmp"
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(args.out_dir / f"{stem}.json")

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # rows already saved stay
    report = run(args, save)
    save(report)
    try:
        plot(report, args.out_dir / f"{stem}.png")
    except ImportError as err:  # matplotlib missing: the JSON is the result
        print(f"no plot: {err}")
    print(f"wrote {args.out_dir / stem}.json and .png in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
