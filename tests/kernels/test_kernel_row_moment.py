"""row_moment (RowAdam, docs/method.md §4) against a float64 numpy loop, over several steps, plus its invariants."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.kernels.row_moment import row_moment, row_moment_reference

B2, EPS_PAPER, EPS_NEMO = 0.95, 1e-8, 1e-8


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def numpy_row_adam(s, v, t, b2, eps, variant):
    """docs/method.md §4 row by row in float64."""
    s = np.asarray(s, np.float64)
    d, r = s.shape
    v_new, rho = np.zeros(d), np.zeros(d)
    for i in range(d):
        v_new[i] = b2 * float(v[i]) + (1 - b2) * sum(s[i, j] ** 2 for j in range(r)) / r
        rho[i] = math.sqrt(v_new[i] / (1 - b2 ** t))
    out = np.zeros_like(s)
    if variant == "nemo":
        for i in range(d):
            out[i] = s[i] / (rho[i] + eps)
        return v_new, out
    floor = max(eps * sum(rho) / d, float(np.finfo(np.float32).tiny))
    inv = [1.0 / (rho[i] + floor) for i in range(d)]
    rms = math.sqrt(sum(x * x for x in inv) / d)
    for i in range(d):
        out[i] = inv[i] / rms * s[i]
    norm_s, norm_dt = math.sqrt((s * s).sum()), math.sqrt((out * out).sum())
    return v_new, out * (norm_s / norm_dt if norm_dt > 0 else 0.0)


def _sketch(seed, d, r):
    rng = np.random.default_rng(seed)
    # Rows of very different magnitude, so the row scaling is far from uniform.
    return (rng.normal(size=(d, r)) * rng.uniform(0.01, 10.0, size=(d, 1))).astype(np.float32)


@pytest.mark.parametrize(("variant", "eps"), [("paper", EPS_PAPER), ("nemo", EPS_NEMO)])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_three_steps_match_numpy_loop(variant, eps, implementation):
    d, r = 37, 6  # 37 rows: blocks of 16 leave a partial edge block
    v_np = np.zeros(d)
    v = jnp.zeros(d, jnp.float32)
    for t in (1, 2, 3):
        s = _sketch(t, d, r)
        v_np, d_np = numpy_row_adam(s, v_np, t, B2, eps, variant)
        v, d_out = row_moment(jnp.asarray(s), v, jnp.int32(t - 1), b2=B2, eps=eps, variant=variant,
                              implementation=implementation, interpret=True, block_d=16)
        assert v.dtype == jnp.float32 and d_out.dtype == jnp.float32 and d_out.shape == (d, r)
        assert rel_err(v, v_np) <= 1e-6 and rel_err(d_out, d_np) <= 1e-6, t


def test_pallas_equals_jnp_reference():
    s, v = jnp.asarray(_sketch(7, 45, 8)), jnp.asarray(np.random.default_rng(7).uniform(size=45), jnp.float32)
    for variant in ("paper", "nemo"):
        ref = row_moment_reference(s, v, 4, b2=0.9, eps=1e-3, variant=variant)
        out = row_moment(s, v, 4, b2=0.9, eps=1e-3, variant=variant, implementation="pallas", interpret=True,
                         block_d=16)
        assert rel_err(out[0], ref[0]) <= 1e-6 and rel_err(out[1], ref[1]) <= 1e-6


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_paper_variant_invariants(implementation):
    """‖D‖_F = ‖S‖_F, every row of D is a positive multiple of the row of S, and larger rows are damped."""
    s = _sketch(11, 30, 5)
    _, d_out = row_moment(jnp.asarray(s), jnp.zeros(30), 0, implementation=implementation, interpret=True,
                          block_d=16)
    d_out = np.asarray(d_out, np.float64)
    assert abs(np.linalg.norm(d_out) / np.linalg.norm(s) - 1) <= 1e-6
    ratio = np.linalg.norm(d_out, axis=1) / np.linalg.norm(s, axis=1)
    assert np.all(ratio > 0) and np.allclose(d_out, ratio[:, None] * s, rtol=1e-5, atol=0)
    # From v = 0 the scale is 1/ρ_i ∝ 1/‖S_i‖: every row of D has (nearly) the same norm.
    row_norms = np.linalg.norm(d_out, axis=1)
    assert row_norms.max() / row_norms.min() < 1 + 1e-4


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_zero_sketch_gives_zero_update(implementation):
    for variant in ("paper", "nemo"):
        v, d_out = row_moment(jnp.zeros((20, 4)), jnp.zeros(20), 0, variant=variant, implementation=implementation,
                              interpret=True, block_d=16)
        assert np.all(np.asarray(v) == 0) and np.all(np.asarray(d_out) == 0), variant


def test_vmap_over_layers_with_traced_count():
    n, d, r = 3, 21, 4
    s = np.stack([_sketch(20 + i, d, r) for i in range(n)])
    v0 = np.random.default_rng(5).uniform(size=(n, d)).astype(np.float32)
    step = jax.jit(jax.vmap(lambda s_, v_, t: row_moment(s_, v_, t, implementation="pallas", interpret=True,
                                                          block_d=16), in_axes=(0, 0, None)))
    v, d_out = step(jnp.asarray(s), jnp.asarray(v0), jnp.int32(1))
    for i in range(n):
        v_np, d_np = numpy_row_adam(s[i], v0[i], 2, B2, EPS_PAPER, "paper")
        assert rel_err(v[i], v_np) <= 1e-6 and rel_err(d_out[i], d_np) <= 1e-6


def test_traced_hyperparameters_need_no_recompile():
    s, v0 = _sketch(30, 19, 3), np.random.default_rng(6).uniform(size=19).astype(np.float32)
    traces = []

    @jax.jit
    def step(s_, v_, count, b2, eps):
        traces.append(1)
        return row_moment(s_, v_, count, b2=b2, eps=eps, variant="nemo", implementation="pallas", interpret=True,
                          block_d=8)

    for count, b2, eps in ((0, 0.9, 1e-3), (4, 0.5, 0.2)):
        v, d_out = step(jnp.asarray(s), jnp.asarray(v0), jnp.int32(count), jnp.float32(b2), jnp.float32(eps))
        v_np, d_np = numpy_row_adam(s, v0, count + 1, float(np.float32(b2)), float(np.float32(eps)), "nemo")
        assert rel_err(v, v_np) <= 1e-6 and rel_err(d_out, d_np) <= 1e-6
    assert len(traces) == 1


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(variant="adam"), "variant"),
    (dict(b2=1.0), "b2"),
    (dict(eps=-1.0), "eps"),
    (dict(implementation="pallas", interpret=True, block_d=0), "block_d"),
    (dict(implementation="mosaic"), "implementation"),
])
def test_row_moment_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        row_moment(jnp.ones((4, 2)), jnp.zeros(4), 1, **kwargs)
    with pytest.raises(ValueError, match="v"):
        row_moment(jnp.ones((4, 2)), jnp.zeros(3), 1)
