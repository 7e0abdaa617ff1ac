"""sketched_linear and its fused Pallas kernels (interpret mode) against float64 numpy, jnp and dense-gradient oracles.

Shapes are chosen so that no size is a multiple of its block (edge blocks are partial and, in interpret mode,
padded with NaN: a missing mask shows up as NaN), and grids stay small (interpret mode ≈ 0.35 ms per step).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.kernels.project import (
    fused_backward,
    fused_backward_reference,
    fused_forward,
    fused_forward_reference,
    sketched_linear,
)

BLOCKS = dict(block_t=8, block_d=16, block_k=16)
TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _arrays(seed, t, k, d, r, dtype):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(t, k)).astype(np.float32)
    kernel = rng.normal(size=(k, d)).astype(np.float32)
    a = (rng.choice([-1.0, 1.0], size=(r, k)) / np.sqrt(r)).astype(np.float32)
    h = rng.normal(size=(t, d)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(kernel), jnp.asarray(a), jnp.asarray(h, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(21, 37, 26, 5), (9, 16, 40, 3)])
def test_fused_kernels_match_references(dtype, shape):
    t, k, d, r = shape
    x, kernel, a, h = _arrays(0, t, k, d, r, dtype)
    y, p = fused_forward(x, kernel, a, interpret=True, **BLOCKS)
    y_ref, p_ref = fused_forward_reference(x, kernel, a)
    assert y.dtype == dtype and p.dtype == dtype and y.shape == (t, d) and p.shape == (t, r)
    assert rel_err(y, y_ref) <= TOL[dtype] and rel_err(p, p_ref) <= TOL[dtype]

    dx, s = fused_backward(h, p, kernel, interpret=True, **BLOCKS)
    dx_ref, s_ref = fused_backward_reference(h, p, kernel)
    assert dx.dtype == dtype and s.dtype == jnp.float32 and dx.shape == (t, k) and s.shape == (d, r)
    assert rel_err(dx, dx_ref) <= TOL[dtype] and rel_err(s, s_ref) <= TOL[dtype]

    if dtype == jnp.float32:  # independent float64 oracle for the fp32 path
        x64, k64, a64, h64 = (np.asarray(v, np.float64) for v in (x, kernel, a, h))
        assert rel_err(y, x64 @ k64) <= 1e-6 and rel_err(p, x64 @ a64.T) <= 1e-6
        assert rel_err(dx, h64 @ k64.T) <= 1e-6 and rel_err(s, h64.T @ (x64 @ a64.T)) <= 1e-6


def _loss(implementation):
    def loss(x, kernel, a, probe):
        y = sketched_linear(x, kernel, a, probe, implementation=implementation, interpret=True, **BLOCKS)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.shape[-1], dtype=y.dtype))
    return loss


def test_pallas_gradients_equal_xla_and_dense_oracle():
    b, t, k, d, r = 2, 7, 19, 21, 4
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(b, t, k)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(k, d)), jnp.float32)
    a = jnp.asarray(rng.choice([-0.5, 0.5], size=(r, k)), jnp.float32)
    probe = jnp.zeros((d, r), jnp.float32)
    grads = {impl: jax.grad(_loss(impl), argnums=(0, 1, 2, 3))(x, kernel, a, probe) for impl in ("xla", "pallas")}
    value_p = _loss("pallas")(x, kernel, a, probe)
    assert rel_err(value_p, _loss("xla")(x, kernel, a, probe)) <= 1e-6

    # Dense oracle: G (LoGRA's [d, k]) from jax.grad of the plain x @ K; S = G Aᵀ, and dx is the ordinary dx.
    def dense(x, kernel):
        y = x @ kernel
        return jnp.sum(jnp.sin(y) * jnp.arange(d, dtype=y.dtype))
    dx_dense, dk_dense = jax.grad(dense, argnums=(0, 1))(x, kernel)
    s_dense = dk_dense.T @ a.T
    for impl, (dx, dk, da, s) in grads.items():
        assert rel_err(dx, dx_dense) <= 1e-6, impl
        assert rel_err(s, s_dense) <= 1e-6, impl
        assert not np.any(np.asarray(dk)) and not np.any(np.asarray(da)), impl
    assert rel_err(grads["pallas"][3], grads["xla"][3]) <= 1e-6
    assert rel_err(grads["pallas"][0], grads["xla"][0]) <= 1e-6


def test_scan_over_stacked_layers_and_vmap():
    """The model scans layers (one slice per step); the optimizer may vmap: both must work through pallas_call."""
    n, t, w, r = 2, 10, 18, 3
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(t, w)), jnp.float32)
    kernels = jnp.asarray(rng.normal(size=(n, w, w)) / np.sqrt(w), jnp.float32)
    a = jnp.asarray(rng.choice([-1.0, 1.0], size=(n, r, w)), jnp.float32)
    probes = jnp.zeros((n, w, r), jnp.float32)

    def loss(probes, implementation):
        def layer(h, params):
            kernel, a_l, probe = params
            return jnp.tanh(sketched_linear(h, kernel, a_l, probe, implementation=implementation, interpret=True,
                                            **BLOCKS)), None
        out, _ = jax.lax.scan(layer, x, (kernels, a, probes))
        return jnp.sum(out ** 2)

    s_pallas = jax.jit(jax.grad(loss), static_argnums=1)(probes, "pallas")
    s_xla = jax.grad(loss)(probes, "xla")
    assert s_pallas.shape == (n, w, r) and rel_err(s_pallas, s_xla) <= 1e-6

    y, p = jax.vmap(lambda k_, a_: fused_forward(x, k_, a_, interpret=True, **BLOCKS))(kernels, a)
    y_ref, p_ref = jax.vmap(lambda k_, a_: fused_forward_reference(x, k_, a_))(kernels, a)
    assert rel_err(y, y_ref) <= 1e-6 and rel_err(p, p_ref) <= 1e-6


def test_primal_without_gradient_is_plain_matmul():
    x, kernel, a, _ = _arrays(3, 5, 12, 9, 2, jnp.float32)
    y = sketched_linear(x, kernel, a, jnp.zeros((9, 2)), implementation="pallas", interpret=True, **BLOCKS)
    assert rel_err(y, np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)) <= 1e-6


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(implementation="triton"), "implementation"),
    (dict(implementation="pallas", interpret=True, block_t=0), "block_t"),
    (dict(implementation="pallas", interpret=True, block_k=2.5), "block_k"),
    (dict(implementation="pallas"), "interpret=True"),
])
def test_sketched_linear_rejects_bad_arguments(kwargs, match):
    x, kernel, a, _ = _arrays(4, 3, 8, 5, 2, jnp.float32)
    with pytest.raises(ValueError, match=match):
        sketched_linear(x, kernel, a, jnp.zeros((5, 2)), **kwargs)


def test_sketched_linear_rejects_shapes_that_do_not_chain():
    x, kernel, a, _ = _arrays(5, 3, 8, 5, 2, jnp.float32)
    with pytest.raises(ValueError, match="probe"):
        sketched_linear(x, kernel, a, jnp.zeros((5, 3)))
    with pytest.raises(ValueError, match="do not chain"):
        sketched_linear(x, kernel, a[:, :7], jnp.zeros((5, 2)))
