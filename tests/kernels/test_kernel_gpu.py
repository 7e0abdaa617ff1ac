"""The NVIDIA GPU kernels (logra_jax/kernels/gpu.py): jnp references in the interpreter, and CUDA lowering on CPU.

`jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas → Triton lowering without a GPU (the
Triton IR is embedded in a `__gpu$xla.gpu.triton` custom call); compiling that IR to PTX and running it is left to
experiments/device/check.sh on a GPU.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.kernels import backend, gpu
from logra_jax.kernels.merge import merge, merge_reference
from logra_jax.kernels.project import fused_backward_reference, fused_forward_reference, sketched_linear
from logra_jax.kernels.row_moment import row_moment, row_moment_reference

# Ragged everywhere: no size is a multiple of the 16-wide blocks, r is not a power of 2, T spans several splits.
T, K, D, R = 53, 70, 45, 6
BLOCKS = dict(block_t=16, block_d=16, block_k=16)
H100 = backend.KernelTarget("gpu", "NVIDIA H100 80GB HBM3")


def _normal(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.abs(x - ref).max() / np.abs(ref).max()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_fused_projection_kernels_equal_their_references(rng, dtype, tol):
    x, h = _normal(rng, T, K, dtype=dtype), _normal(rng, T, D, dtype=dtype)
    kernel, a = _normal(rng, K, D), _normal(rng, R, K)
    y, p = gpu.fused_forward_gpu(x, kernel, a, interpret=True, **BLOCKS)
    y_ref, p_ref = fused_forward_reference(x, kernel, a)
    assert y.dtype == p.dtype == dtype and y.shape == (T, D) and p.shape == (T, R)
    assert _rel(y, y_ref) < tol and _rel(p, p_ref) < tol
    # 4 token blocks in 2 splits of 2: the split reduction sums partials of different token ranges.
    dx, s = gpu.fused_backward_gpu(h, p_ref, kernel, interpret=True, target_programs=4, **BLOCKS)
    dx_ref, s_ref = fused_backward_reference(h, p_ref, kernel)
    assert dx.dtype == dtype and s.dtype == jnp.float32 and s.shape == (D, R)
    assert _rel(dx, dx_ref) < tol and _rel(s, s_ref) < 1e-6


@pytest.mark.parametrize("round_bf16", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_kernel_equals_its_reference(rng, round_bf16, dtype):
    kernel, factor, a = _normal(rng, K, D, dtype=dtype), _normal(rng, D, R), _normal(rng, R, K)
    out = gpu.merge_gpu(kernel, factor, a, round_bf16=round_bf16, interpret=True, block_d=16, block_k=32)
    ref = merge_reference(kernel, factor, a, round_bf16=round_bf16)
    assert out.dtype == dtype and out.shape == (K, D)
    # one rounding to K's dtype from float32 sums that agree to ~1e-7: at most one ulp apart
    ulp = np.abs(np.asarray(ref, np.float32)) * (2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -23)
    assert np.all(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)) <= ulp + 1e-6)


@pytest.mark.parametrize("variant", ["paper", "nemo"])
def test_row_moment_kernels_equal_the_reference(rng, variant):
    s, v = _normal(rng, D, R), jnp.abs(_normal(rng, D))
    hyper = jnp.asarray([0.95, 1.0 / (1.0 - 0.95 ** 4), 1e-8, 0.0], jnp.float32)
    v_ref, d_ref = row_moment_reference(s, v, 3, b2=0.95, eps=1e-8, variant=variant)
    outs = gpu.row_moment_gpu(s, v, hyper, variant=variant, interpret=True, block_d=16)
    np.testing.assert_allclose(outs[0], v_ref, rtol=1e-6)
    if variant == "nemo":
        np.testing.assert_allclose(outs[1], d_ref, rtol=1e-6, atol=1e-7)
    else:
        rowsq = np.sum(np.asarray(s, np.float64) ** 2, axis=1)
        np.testing.assert_allclose(outs[2], rowsq, rtol=1e-6)
        np.testing.assert_allclose(outs[1], np.sqrt(np.asarray(v_ref) / (1 - 0.95 ** 4)), rtol=1e-6)


def test_gpu_blocks_must_be_powers_of_two():
    z = jnp.zeros((32, 32))
    with pytest.raises(ValueError, match="merge: block_d must be a power of 2 >= 16 on GPU, got 48"):
        gpu.merge_gpu(z, jnp.zeros((32, 4)), jnp.zeros((4, 32)), block_d=48, interpret=True)
    with pytest.raises(ValueError, match="fused_backward: block_t"):
        gpu.fused_backward_gpu(z, jnp.zeros((32, 4)), z, block_t=8, interpret=True)


@pytest.fixture
def gpu_target(monkeypatch):
    """Route implementation='pallas' to the GPU kernels (interpreted here), as a compiled run on CUDA does."""
    for name in ("merge", "row_moment", "project"):  # the package exports functions of the same names
        module = importlib.import_module(f"logra_jax.kernels.{name}")
        monkeypatch.setattr(module, "pallas_target", lambda where, interpret, platform=None: "gpu")
    yield
    jax.clear_caches()


def test_public_kernels_dispatch_to_the_gpu_kernels(rng, gpu_target):
    """merge, row_moment (both variants, finished in jnp for paper) and sketched_linear's forward and backward."""
    kernel, factor, a = _normal(rng, K, D), _normal(rng, D, R), _normal(rng, R, K)
    out = merge(kernel, factor, a, implementation="pallas", interpret=True, block_d=16, block_k=16)
    np.testing.assert_allclose(out, merge_reference(kernel, factor, a), rtol=1e-6, atol=1e-6)
    s, v = _normal(rng, D, R), jnp.abs(_normal(rng, D))
    for variant in ("paper", "nemo"):
        got = row_moment(s, v, 2, variant=variant, implementation="pallas", interpret=True, block_d=16)
        want = row_moment_reference(s, v, 2, b2=0.95, eps=1e-8, variant=variant)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    x = _normal(rng, 2, 20, K)

    def loss(probe, implementation):
        y = sketched_linear(x, kernel, a, probe, implementation=implementation, interpret=True, **BLOCKS)
        return jnp.sum(jnp.tanh(y))

    probe = jnp.zeros((D, R))
    (y_p, s_p), (y_x, s_x) = (jax.value_and_grad(loss)(probe, impl) for impl in ("pallas", "xla"))
    np.testing.assert_allclose(y_p, y_x, rtol=1e-5)
    assert _rel(s_p, s_x) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# CUDA lowering (on CPU).


@pytest.fixture
def cuda_default(monkeypatch):
    """The wrappers pick the GPU kernels as on a CUDA machine; traces made under it are dropped afterwards."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    yield
    jax.clear_caches()


def _triton_calls(fn, *args) -> list[str]:
    with backend.compiling_for(H100):  # the GPU the Triton kernels are lowered for (jax >= 0.11 needs one named)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]


def _names(calls: list[str]) -> list[str]:
    return [line.split('name = "')[1].split('"')[0] for line in calls]


def test_every_gpu_kernel_lowers_for_cuda_through_the_public_api(cuda_default):
    # Real-model-like dtypes (bf16 activations, fp32 weights) on ragged sizes with a non-power-of-2 rank.
    t, k, d, r = 300, 400, 264, 100
    bf16, f32 = jnp.bfloat16, jnp.float32
    x, h, p = jnp.zeros((t, k), bf16), jnp.zeros((t, d), bf16), jnp.zeros((t, r), bf16)
    kernel, a = jnp.zeros((k, d), f32), jnp.zeros((r, k), f32)
    merge_calls = _triton_calls(lambda *z: merge(*z, round_bf16=True, implementation="pallas"),
                                kernel.astype(bf16), jnp.zeros((d, r), f32), a)
    assert _names(merge_calls) == ["logra_merge_gpu"]
    # in place: the custom call aliases K (operand 0) to its output
    assert "output_operand_aliases" in merge_calls[0] and "operand_index = 0" in merge_calls[0]
    assert _names(_triton_calls(lambda s, v: row_moment(s, v, 2, implementation="pallas"),
                                jnp.zeros((d, r)), jnp.zeros(d))) == ["logra_row_moment_gpu", "logra_row_scale_gpu"]
    assert _names(_triton_calls(lambda s, v: row_moment(s, v, 2, variant="nemo", implementation="pallas"),
                                jnp.zeros((d, r)), jnp.zeros(d))) == ["logra_row_moment_gpu"]
    assert _names(_triton_calls(gpu.fused_forward_gpu, x, kernel, a)) == ["logra_fused_forward_gpu"]
    assert _names(_triton_calls(gpu.fused_backward_gpu, h, p, kernel)) == ["logra_fused_backward_dx_gpu",
                                                                             "logra_sketch_gpu"]
    # float32 operands: the 3-pass TF32 dot is accepted by the Triton lowering too
    assert _triton_calls(lambda *z: merge(*z, implementation="pallas"), kernel, jnp.zeros((d, r)), a)


def test_sketched_layers_under_scan_and_grad_lower_for_cuda(cuda_default):
    """What the sketch-native train step runs: stacked layers in a scan, both fused kernels inside the loop."""
    def loss(probes, x, kernels, a):
        def layer(h, params):
            kernel, a_l, probe = params
            return sketched_linear(h, kernel, a_l, probe, implementation="pallas"), None
        out, _ = jax.lax.scan(layer, x, (kernels, a, probes))
        return jnp.sum(out.astype(jnp.float32))

    calls = _triton_calls(jax.grad(loss), jnp.zeros((2, 256, 128)), jnp.zeros((300, 256), jnp.bfloat16),
                          jnp.zeros((2, 256, 256)), jnp.zeros((2, 128, 256)))
    assert set(_names(calls)) == {"logra_fused_forward_gpu", "logra_fused_backward_dx_gpu", "logra_sketch_gpu"}


def test_wide_ranks_loop_over_rank_chunks_and_blocks(rng):
    """r = 130 pads to 256: the merge sums 4 rank chunks of 64, the sketch pass spans 2 rank blocks of 128."""
    t, k, d, r = 40, 24, 20, 130
    kernel, factor, a = _normal(rng, k, d), _normal(rng, d, r), _normal(rng, r, k)
    out = gpu.merge_gpu(kernel, factor, a, interpret=True, block_d=16, block_k=16)
    assert _rel(out - kernel, merge_reference(kernel, factor, a) - kernel) < 1e-6
    h, p = _normal(rng, t, d), _normal(rng, t, r)
    _, s = gpu.fused_backward_gpu(h, p, kernel, interpret=True, target_programs=8, **BLOCKS)
    assert s.shape == (d, r) and _rel(s, fused_backward_reference(h, p, kernel)[1]) < 1e-6
