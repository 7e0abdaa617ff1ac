"""The kernels follow the target they are compiled for: dispatch, TPU compiler params and block choice.

Pure Python and CUDA/TPU lowering on CPU (fast, part of `make test`). That the chosen blocks compile for real
chips is tests/kernels/test_kernel_aot.py, which runs under the compile-only venvs (`make venv-tpu` / `venv-cuda`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.kernels import backend
from logra_jax.kernels.merge import merge
from logra_jax.kernels.project import (
    DEFAULT_BLOCKS,
    backward_vmem_bytes,
    choose_blocks,
    forward_vmem_bytes,
    fused_backward,
    fused_forward,
    sketched_linear,
    vmem_budget,
)
from logra_jax.planner import aot

V5E, V5P, V4 = (backend.KernelTarget("tpu", kind) for kind in ("TPU v5 lite", "TPU v5", "TPU v4"))
MIB = 1 << 20


def test_current_target_follows_compiling_for_not_the_host():
    assert backend.current_target().platform == "cpu"
    devices = jax.devices()[:2]
    with backend.compiling_for(V5E) as target:
        assert target == backend.current_target() == V5E
        assert backend.pallas_target("merge", False) == "tpu"
        with backend.compiling_for(backend.KernelTarget("gpu", "NVIDIA H100 80GB HBM3")):
            assert backend.pallas_target("merge", False) == "gpu"
            assert backend.compiler_params(("parallel",)) is None
        assert backend.compiler_params(("parallel",)).dimension_semantics == ("parallel",)
        with backend.compiling_for(devices), pytest.raises(ValueError, match="interpret=True"):
            backend.pallas_target("merge", False)
    assert backend.current_target().platform == "cpu"
    assert backend.target_of(jax.sharding.Mesh(np.array(devices), ("x",))) == backend.KernelTarget("cpu", "cpu")


def test_compiler_params_request_vmem_up_to_the_chips():
    assert backend.compiler_params(("arbitrary",), 8 * MIB, V5E).vmem_limit_bytes is None  # the default suffices
    assert backend.compiler_params(("arbitrary",), 21 * MIB, V5E).vmem_limit_bytes == int(21 * MIB * 1.25) + 4 * MIB
    assert backend.compiler_params(("arbitrary",), 100 * MIB, V5E).vmem_limit_bytes == 128 * MIB
    assert backend.compiler_params(("arbitrary",), 100 * MIB, V5P).vmem_limit_bytes == 64 * MIB
    unlisted = backend.KernelTarget("tpu", "TPU v9")  # no cap where the chip's VMEM is not known
    assert backend.compiler_params(("arbitrary",), 100 * MIB, unlisted).vmem_limit_bytes == 129 * MIB


def test_backward_footprint_matches_the_tpu_compilers_report():
    # libtpu for TPU v5e, blocks 256/512/512, all bf16: "scoped allocation with size 21.25M" (issue 36).
    assert backward_vmem_bytes(256, 512, 512, d=18944, r=256, h_bytes=2, p_bytes=2, k_bytes=2) == 21.25 * MIB


@pytest.mark.parametrize("target", [V5E, V5P, V4])
@pytest.mark.parametrize("model", ["qwen2.5-1.5b", "qwen2.5-7b", "dense-27b"])
def test_chosen_blocks_fit_the_chip_or_fall_back(target, model):
    from logra_jax.models.config import preset

    cfg = preset(model)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, ff = cfg.hidden_size, cfg.intermediate_size
    budget = vmem_budget(target)
    for r in (64, 256):
        for k, d in ((h, q), (h, kv), (q, h), (h, ff), (ff, h)):
            for vmem in (functools.partial(backward_vmem_bytes, d=d, r=r, h_bytes=2, p_bytes=2, k_bytes=4),
                         functools.partial(forward_vmem_bytes, r=r, x_bytes=2, k_bytes=4, a_bytes=4)):
                blocks = choose_blocks(vmem, (4096, d, k), budget)
                if blocks is None:  # only the backward on v4, where even the smallest blocks beside S do not fit
                    assert target == V4 and vmem(16, 128, 128) > budget, (k, d, r)
                    continue
                assert vmem(*blocks) <= budget
                assert all(b <= m for b, m in zip(blocks, DEFAULT_BLOCKS))


def test_choose_blocks_halves_k_then_d_then_t():
    vmem = lambda bt, bd, bk: bt * bd * bk
    assert choose_blocks(vmem, (4096, 4096, 4096), 256 * 512 * 512) == (256, 512, 512)
    assert choose_blocks(vmem, (4096, 4096, 4096), 256 * 512 * 256) == (256, 512, 256)
    assert choose_blocks(vmem, (4096, 4096, 4096), 256 * 256 * 128) == (256, 256, 128)
    assert choose_blocks(vmem, (100, 300, 4096), 100 * 300 * 512) == (100, 300, 512)  # clipped to the axes
    assert choose_blocks(vmem, (4096, 4096, 4096), 15 * 128 * 128) is None


def test_the_fused_kernels_refuse_shapes_whose_blocks_do_not_fit_the_chip():
    """Asked for the Pallas kernel, a shape that no blocks fit raises, naming the kernel, the chip and the way
    out; it is never swapped for the XLA reference (which the backward was before)."""
    # TPU v4 (16 MiB): S [16384, 256] float32 is 16 MiB alone.
    h, p, kernel = jnp.zeros((64, 16384), jnp.bfloat16), jnp.zeros((64, 256), jnp.bfloat16), jnp.zeros((128, 16384))
    # A fresh function per target: jit's cache keys on the arguments (their shardings), not on the context.
    with backend.compiling_for(V4), pytest.raises(ValueError, match=r"fused_backward: no blocks fit the VMEM of "
                                                                    r"TPU v4 .*implementation='xla'"):
        jax.jit(lambda *z: fused_backward(*z)).trace(h, p, kernel)
    with backend.compiling_for(V5E):
        text = jax.jit(lambda *z: fused_backward(*z)).trace(h, p, kernel).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    # the forward: a projection so wide that A's smallest blocks alone exceed v5e's VMEM
    x, k32, a = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((64, 128), (128, 128), (1 << 18, 128)))
    with backend.compiling_for(V5E), pytest.raises(ValueError, match="fused_forward: no blocks fit the VMEM of "
                                                                     "TPU v5 lite"):
        jax.jit(lambda *z: fused_forward(*z)).trace(x, k32, a)
    # through the layer with implementation="pallas" (the backward is traced by the gradient)
    x, probe = jnp.zeros((64, 128), jnp.bfloat16), jnp.zeros((16384, 256))
    layer = lambda x, probe: sketched_linear(x, kernel, jnp.zeros((256, 128)), probe, implementation="pallas").sum()
    with backend.compiling_for(V4), pytest.raises(ValueError, match="fused_backward: no blocks fit"):
        jax.jit(jax.grad(layer, argnums=1)).trace(x, probe)


def test_merge_lowers_for_the_target_platform():
    kernel, factor, a = jnp.zeros((64, 32)), jnp.zeros((32, 16)), jnp.zeros((16, 64))
    with backend.compiling_for(backend.KernelTarget("gpu", "NVIDIA H100 80GB HBM3")):
        text = jax.jit(lambda *z: merge(*z, implementation="pallas")).trace(kernel, factor, a).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    with backend.compiling_for(V5E):
        text = jax.jit(lambda *z: merge(*z, implementation="pallas")).trace(kernel, factor, a).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_aot_targets_and_their_published_figures():
    info = aot.target_info("v5e:2x2")
    assert (info.platform, info.num_devices, info.hbm_bytes, info.vmem_bytes) == ("tpu", 4, 16 * 2**30, 128 * MIB)
    assert aot.target_info("v4:2x2x1").num_devices == 8  # compile-only v4 devices are TensorCores, 2 per chip
    h100 = aot.target_info("h100:8")
    assert (h100.platform, h100.num_devices, h100.shared_memory_per_block) == ("gpu", 8, 227 * 1024)
    assert h100.peak_bf16_flops == 989.4e12 and h100.hbm_bandwidth == 3.35e12 and h100.sources
    assert aot.target_info("cpu:4").hbm_bytes is None
    config = aot.gpu_target_config("a100")
    assert "major: 8" in config and "core_count: 108" in config and 'device_description_str: "NVIDIA A100' in config
    for bad in ("v5e", "tpu:2x2", "h100:0", "v5e:2xa", "cpu:"):
        with pytest.raises(ValueError, match="target"):
            aot.target_info(bad)
    with pytest.raises(ValueError, match="gpu_target_config"):
        aot.gpu_target_config("v5e")


def test_aot_names_the_make_command_when_the_compiler_is_missing():
    for target, command in (("v5e:2x4", "make venv-tpu"), ("h100:8", "make venv-cuda")):
        if aot.compiler_available(target):
            continue
        with pytest.raises(RuntimeError, match=f"{target!r} needs the .* `{command}`"):
            aot.devices(target)
    assert aot.devices("cpu:2") == jax.devices("cpu")[:2]
    assert dict(aot.mesh("cpu:4").shape) == {"data": 1, "fsdp": 4, "tensor": 1}


def test_pallas_runs_per_device_inside_a_sharded_step():
    """Under compiling_for(mesh) every Pallas call is a shard_map (GSPMD cannot partition Mosaic kernels); the
    results equal numpy's (interpreted here, on 4 CPU devices, one grid step per call)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from logra_jax.kernels.project import sketched_linear
    from logra_jax.kernels.row_moment import row_moment

    mesh = aot.mesh("cpu:4")
    rng = np.random.default_rng(0)
    x, kernel, a = rng.normal(size=(4, 8, 32)), rng.normal(size=(32, 24)), rng.normal(size=(8, 32))
    s, v = rng.normal(size=(24, 8)), np.abs(rng.normal(size=24))
    x_sharded = jax.device_put(jnp.asarray(x), NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))

    def step(x, kernel, a, s, v):
        with backend.compiling_for(mesh):
            loss = lambda probe: jnp.sum(sketched_linear(x, kernel, a, probe, implementation="pallas",
                                                         interpret=True, block_t=8, block_d=24, block_k=32))
            sketch = jax.grad(loss)(jnp.zeros((24, 8)))
            merged = merge(kernel, s, a, implementation="pallas", interpret=True, block_d=24, block_k=32)
            moments = row_moment(s, v, 2, implementation="pallas", interpret=True, block_d=24)
        return sketch, merged, moments

    lowered = jax.jit(step).lower(x_sharded, kernel, a, s, v)
    text = lowered.as_text()
    assert text.count("sdy.manual_computation") + text.count("SPMDFullToShardShape") >= 3  # one per kernel call
    sketch, merged, _ = lowered.compile()(x_sharded, kernel, a, s, v)
    # ∂Σy/∂probe = Hᵀ (X Aᵀ) with H = 1: every row of S is the token sum of P = X Aᵀ
    p_sum = np.einsum("btk,rk->r", x, a)
    np.testing.assert_allclose(sketch, np.broadcast_to(p_sum, (24, 8)), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(merged, kernel + a.T @ s.T, rtol=1e-5, atol=1e-5)


def test_a_pallas_kernel_that_cannot_split_over_the_mesh_says_so_once(monkeypatch):
    """In a sharded step the kernels run per device on a split of d (merge) or of the token rows (the sketched
    layer); where it does not divide they run on whole, gathered arrays: right, but never silently."""
    import warnings

    monkeypatch.setattr(backend, "_WARNED", set())
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    kernel, factor, a = jnp.zeros((16, 12)), jnp.ones((12, 2)), jnp.ones((2, 16))  # d = 12 over 8 devices
    merged = lambda *z: merge(*z, implementation="pallas", interpret=True)
    with backend.compiling_for(mesh), pytest.warns(RuntimeWarning, match=r"merge: .* d = 12 does not divide"):
        out = jax.jit(merged)(kernel, factor, a)
    np.testing.assert_allclose(out, merge(kernel, factor, a))
    x, probe = jnp.ones((12, 16)), jnp.zeros((12, 2))  # 12 token rows over 8 devices
    layer = lambda x, p: sketched_linear(x, kernel, a, p, implementation="pallas", interpret=True).sum()
    with backend.compiling_for(mesh), pytest.warns(RuntimeWarning, match="sketched_linear: .* 12 rows do not"):
        jax.jit(jax.grad(layer, argnums=1)).trace(x, probe)
    with backend.compiling_for(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # traced again (another function): said once already
        jax.jit(lambda *z: merged(*z)).trace(kernel, factor, a)
        jax.jit(jax.grad(lambda x, p: layer(x, p), argnums=1)).trace(x, probe)
