"""Lower every Pallas kernel for CUDA (the Triton kernels) and TPU (the Mosaic ones) under the jax installed here.

  python experiments/kernels/lower_all.py [--out lower.json]

No accelerator is needed: `jit(f).trace(...).lower(lowering_platforms=(...))` runs the Pallas lowering on any
machine (JAX_PLATFORMS defaults to cpu here). From jax 0.11 the Triton lowering needs the GPU model: the local GPU's
(on a GPU machine run it with JAX_PLATFORMS=cuda,cpu, as check.sh does), else an H100, named by
`backend.compiling_for` (jax 0.10 assumed an H100's compute capability 9.0 without a GPU).
Run by `experiments/kernels/lower_newest.sh` (the newest jax a registry offers, in a scratch virtualenv)
and by `experiments/device/check.sh` (the accelerator machine's own jax). Prints one line per kernel and platform
and exits 1 if any kernel failed to lower.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from logra_jax.kernels import backend, gpu
from logra_jax.kernels.merge import merge
from logra_jax.kernels.project import fused_backward, fused_forward, sketched_linear
from logra_jax.kernels.row_moment import row_moment

# Ragged sizes (no multiple of any block), bf16 activations, fp32 weights, a non-power-of-2 rank.
T, K, D, R = 300, 400, 264, 100


def _cases() -> dict[str, dict[str, tuple[Any, tuple]]]:
    bf16, f32 = jnp.bfloat16, jnp.float32
    x, h, p = jnp.zeros((T, K), bf16), jnp.zeros((T, D), bf16), jnp.zeros((T, R), bf16)
    kernel, a, s, v = jnp.zeros((K, D), f32), jnp.zeros((R, K), f32), jnp.zeros((D, R)), jnp.zeros(D)
    hyper = jnp.zeros(4)
    tpu_blocks = dict(block_t=128, block_d=128, block_k=256)

    def sketch_grad(probe, x, kernel, a):
        return jax.grad(lambda pr: jnp.sum(sketched_linear(x, kernel, a, pr, implementation="pallas")
                                           .astype(jnp.float32)))(probe)

    return {
        "cuda": {
            "merge_gpu": (lambda *z: gpu.merge_gpu(*z, round_bf16=True), (kernel, jnp.zeros((D, R)), a)),
            "merge_gpu_bf16x3": (lambda *z: gpu.merge_gpu(*z, fp32_dot="bf16x3"), (kernel, jnp.zeros((D, R)), a)),
            "row_moment_gpu_paper": (lambda *z: gpu.row_moment_gpu(*z, variant="paper"), (s, v, hyper)),
            "row_moment_gpu_nemo": (lambda *z: gpu.row_moment_gpu(*z, variant="nemo"), (s, v, hyper)),
            "row_scale_gpu": (gpu.row_scale_gpu, (s, v)),
            "fused_forward_gpu": (gpu.fused_forward_gpu, (x, kernel, a)),
            "fused_backward_gpu": (gpu.fused_backward_gpu, (h, p, kernel)),
            "fused_forward_gpu_fp32": (gpu.fused_forward_gpu, (x.astype(f32), kernel, a)),
        },
        "tpu": {
            "merge": (lambda *z: merge(*z, round_bf16=True, implementation="pallas", block_d=128, block_k=256),
                      (kernel.astype(bf16), jnp.zeros((D, R)), a)),
            "row_moment_paper": (lambda *z: row_moment(*z, 2, implementation="pallas", block_d=128), (s, v)),
            "row_moment_nemo": (lambda *z: row_moment(*z, 2, variant="nemo", implementation="pallas",
                                                       block_d=128), (s, v)),
            "fused_forward": (lambda *z: fused_forward(*z, **tpu_blocks), (x, kernel, a)),
            "fused_backward": (lambda *z: fused_backward(*z, **tpu_blocks), (h, p, kernel)),
            "sketched_linear_grad": (sketch_grad, (jnp.zeros((D, 128)), x, kernel, jnp.zeros((128, K)))),
        },
    }


def _gpu_kind() -> str:
    """The local GPU's device kind, else an H100's."""
    try:
        return jax.devices("gpu")[0].device_kind
    except RuntimeError:
        return "NVIDIA H100 80GB HBM3"


def lower_all() -> list[dict[str, Any]]:
    rows = []
    for platform, cases in _cases().items():
        # the wrappers pick their kernels (and TPU compiler params) for the platform compiled for
        target = backend.KernelTarget("gpu", _gpu_kind()) if platform == "cuda" else backend.KernelTarget(platform)
        with backend.compiling_for(target):
            for name, (fn, args) in cases.items():
                row = {"platform": platform, "kernel": name}
                try:
                    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
                    marker = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
                    row["custom_calls"] = sum(marker in line for line in text.splitlines())
                    row["ok"] = row["custom_calls"] > 0
                except Exception as err:  # report every kernel, then fail as a whole
                    row.update(ok=False, error=f"{type(err).__name__}: {err}"[:400],
                               where=traceback.format_exc().splitlines()[-3:])
                rows.append(row)
                print(f"{platform:>5} {name:>24}  {'ok' if row['ok'] else 'FAILED ' + row.get('error', '')[:150]}",
                      flush=True)
        jax.clear_caches()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}, "
          f"python {sys.version.split()[0]}")
    rows = lower_all()
    report = {"jax": jax.__version__, "python": sys.version.split()[0], "results": rows,
              "all_ok": all(r["ok"] for r in rows)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} kernels lowered under jax {jax.__version__}")
    sys.exit(0 if report["all_ok"] else 1)


if __name__ == "__main__":
    main()
