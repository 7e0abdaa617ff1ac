"""The blocks the TPU kernels choose compile for each real chip at each real shape; the GPU kernels compile too.

Runs only where the target's compiler is installed (skipped, with the command that creates it, elsewhere):
`make test-aot` runs it under both compile-only venvs (before a kernel change lands), or one of them:
  JAX_PLATFORMS=cpu .venv-tpu/bin/python -m pytest -q tests/kernels/test_kernel_aot.py    # make venv-tpu
  JAX_PLATFORMS=cpu .venv-cuda/bin/python -m pytest -q tests/kernels/test_kernel_aot.py   # make venv-cuda
Every projection of the 1.5B, 7B and 27B-class presets (T = 4096, r ∈ {64, 256}, bf16 activations, fp32
weights), compiled by libtpu's Mosaic (TPU) or XLA:GPU + Triton + ptxas (GPU) for one compile-only device.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from logra_jax.kernels import backend, gpu
from logra_jax.kernels.project import fused_backward, fused_forward
from logra_jax.models.config import preset
from logra_jax.planner import aot

TARGETS = ("v5e:2x4", "v5p:2x2x1", "v6e:2x4", "v4:2x2x1", "h100:8", "h200:8", "a100:8")
MODELS = ("qwen2.5-1.5b", "qwen2.5-7b", "dense-27b")
T = 4096


def _shapes(model: str) -> list[tuple[int, int]]:
    """Distinct (k_in, d_out) of q, k, v, o, gate, up, down."""
    c = preset(model)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, ff = c.hidden_size, c.intermediate_size
    return sorted({(h, q), (h, kv), (q, h), (h, ff), (ff, h)})


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("target", TARGETS)
def test_fused_kernels_compile_with_the_chosen_blocks(target, model):
    if not aot.compiler_available(target):
        venv = aot.target_info(target).venv
        pytest.skip(f"{target}: its compiler is not installed here (make {venv.lstrip('.')}; run under {venv})")
    device = aot.devices(target)[0]
    platform = aot.target_info(target).platform
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    bf16, f32 = jnp.bfloat16, jnp.float32
    marker = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    for k, d in _shapes(model):
        for r in (64, 256):
            if platform == "tpu":
                forward, backward = fused_forward, fused_backward
            else:
                forward = lambda *z: gpu.fused_forward_gpu(*z, block_t=64, block_d=64, block_k=64)
                backward = lambda *z: gpu.fused_backward_gpu(*z, block_t=64, block_d=64, block_k=64)
            cases = {"forward": (forward, (spec((T, k), bf16), spec((k, d), f32), spec((r, k), f32))),
                     "backward": (backward, (spec((T, d), bf16), spec((T, r), bf16), spec((k, d), f32)))}
            for name, (fn, args) in cases.items():
                # conftest's "highest" default matmul precision has no bf16 Mosaic dot ("Bad lhs type")
                try:
                    with backend.compiling_for(device), jax.default_matmul_precision("default"):
                        lowered = jax.jit(lambda *z, fn=fn: fn(*z)).lower(*args)
                except ValueError as err:  # refused, never an XLA fallback: only S [d, r] beyond v4's VMEM
                    assert "no blocks fit" in str(err), err
                    assert name == "backward" and target.startswith("v4") and d * r * 4 >= 12 << 20, (name, k, d, r)
                    continue
                assert marker in lowered.as_text(), (name, k, d, r)  # a Pallas call
                lowered.compile()
            jax.clear_caches()
