"""merge (K ← K + Aᵀ Uᵀ) in interpret mode against a float64 numpy loop over rows of W, in place and under vmap."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from logra_jax.kernels.merge import merge, merge_reference

BLOCKS = dict(block_d=16, block_k=16)


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def numpy_merge(kernel, factor, a, round_bf16):
    """W_new[i, :] = W[i, :] + Σ_j U[i, j] A[j, :] row by row in float64 (W = Kᵀ), U optionally bf16-rounded."""
    u = np.asarray(factor, np.float32)
    if round_bf16:
        u = u.astype(ml_dtypes.bfloat16).astype(np.float32)
    w = np.asarray(kernel, np.float64).T.copy()
    a64 = np.asarray(a, np.float64)
    for i in range(w.shape[0]):
        for j in range(a64.shape[0]):
            w[i] += float(u[i, j]) * a64[j]
    return w.T


def _arrays(seed, k, d, r, dtype):
    rng = np.random.default_rng(seed)
    kernel = jnp.asarray(rng.normal(size=(k, d)), dtype)
    factor = jnp.asarray(rng.normal(size=(d, r)) * 0.3, jnp.float32)
    a = jnp.asarray(rng.choice([-1.0, 1.0], size=(r, k)) / np.sqrt(r), jnp.float32)
    return kernel, factor, a


@pytest.mark.parametrize("round_bf16", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_matches_numpy_loop(dtype, round_bf16):
    k, d, r = 37, 29, 6
    kernel, factor, a = _arrays(0, k, d, r, dtype)
    expected = numpy_merge(kernel, factor, a, round_bf16)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for impl in ("xla", "pallas"):
        out = merge(kernel, factor, a, round_bf16=round_bf16, implementation=impl, interpret=True, **BLOCKS)
        assert out.dtype == dtype and out.shape == (k, d)
        assert rel_err(out, expected) <= tol, impl
    pallas = merge(kernel, factor, a, round_bf16=round_bf16, implementation="pallas", interpret=True, **BLOCKS)
    assert rel_err(pallas, merge_reference(kernel, factor, a, round_bf16=round_bf16)) <= tol


def test_round_bf16_rounds_the_factor():
    """The bf16 rounding must be visible in fp32: the rounded and unrounded merges differ by ≈ 2⁻⁹ of ΔW."""
    kernel, factor, a = _arrays(1, 24, 20, 4, jnp.float32)
    kernel = jnp.zeros_like(kernel)
    exact = merge(kernel, factor, a, implementation="pallas", interpret=True, **BLOCKS)
    rounded = merge(kernel, factor, a, round_bf16=True, implementation="pallas", interpret=True, **BLOCKS)
    gap = rel_err(rounded, exact)
    assert 1e-5 < gap < 2 ** -7


def test_merge_is_in_place_under_donation():
    kernel, factor, a = _arrays(2, 40, 24, 4, jnp.float32)
    expected = numpy_merge(kernel, factor, a, False)
    step = jax.jit(lambda k_, u, a_: merge(k_, u, a_, implementation="pallas", interpret=True, **BLOCKS),
                   donate_argnums=0)
    pointer = kernel.unsafe_buffer_pointer()
    out = step(kernel, factor, a)
    assert kernel.is_deleted() and out.unsafe_buffer_pointer() == pointer
    assert rel_err(out, expected) <= 1e-6


def test_merge_vmaps_over_stacked_layers():
    n, k, d, r = 3, 20, 18, 5
    rng = np.random.default_rng(3)
    kernels = jnp.asarray(rng.normal(size=(n, k, d)), jnp.float32)
    factors = jnp.asarray(rng.normal(size=(n, d, r)), jnp.float32)
    a = jnp.asarray(rng.choice([-1.0, 1.0], size=(n, r, k)), jnp.float32)
    out = jax.vmap(lambda k_, u, a_: merge(k_, u, a_, round_bf16=True, implementation="pallas", interpret=True,
                                           **BLOCKS))(kernels, factors, a)
    for i in range(n):
        assert rel_err(out[i], numpy_merge(kernels[i], factors[i], a[i], True)) <= 1e-6


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((), dict(implementation="cuda"), "implementation"),
    ((), dict(implementation="pallas", interpret=True, block_d=-1), "block_d"),
    ((), dict(implementation="pallas"), "interpret=True"),
    (("factor",), {}, "do not chain"),
])
def test_merge_rejects_bad_arguments(args, kwargs, match):
    kernel, factor, a = _arrays(4, 8, 6, 2, jnp.float32)
    if "factor" in args:
        factor = factor[:5]
    with pytest.raises(ValueError, match=match):
        merge(kernel, factor, a, **kwargs)
