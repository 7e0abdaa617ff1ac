"""How each real compiler lowers `jax.lax.ragged_dot` (the MoE's grouped expert matmul), compile-only.

  JAX_PLATFORMS=cpu .venv-cuda/bin/python -m experiments.memory.ragged_dot --target=h100:1
  JAX_PLATFORMS=cpu .venv-tpu/bin/python -m experiments.memory.ragged_dot --target=v5e:1x1

One bfloat16 ragged_dot of x [M, K] (rows sorted by group) with G stacked kernels [G, K, N], compiled for the
target's compile-only device. Printed (and written to --json): the flops `planner.hlo_cost` counts over the
grouped product's 2·M·K·N, the HBM bytes it counts over the kernels' bytes, the compiled program's temporaries,
and whether the program calls a kernel of its own (a custom call). A grouped kernel runs each group's rows
against its own kernel only (1× the flops); a dense lowering multiplies every row by every group's kernel (G×).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from logra_jax.planner import aot
from logra_jax.planner.hlo_cost import hlo_cost


def measure(target: str, m: int, k: int, n: int, groups: int) -> dict:
    """The counts of one compiled ragged_dot on `target` (see the module docstring)."""
    device = aot.devices(target)[0]
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    compiled = jax.jit(jax.lax.ragged_dot).lower(spec((m, k)), spec((groups, k, n)),
                                                 spec((groups,), jnp.int32)).compile()
    text = compiled.as_text()
    cost = hlo_cost(text)
    return {"target": target, "jax": jax.__version__, "m": m, "k": k, "n": n, "groups": groups,
            "flops_over_grouped": cost.flops / (2 * m * k * n),
            "hbm_bytes_over_kernels": cost.bytes_accessed / (groups * k * n * 2),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="h100:1, v5e:1x1, ...")
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    result = measure(args.target, args.m, args.k, args.n, args.groups)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
