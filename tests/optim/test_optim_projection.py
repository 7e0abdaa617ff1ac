"""Projections: seeds against hashlib, traced keys against host seeds, distributions, unbiasedness of S·A."""

import contextlib
import hashlib
import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.optim import (
    find_targets,
    projection,
    target_projection,
)
from logra_jax.optim.projection import (
    digest_words,
    giles_erfinv,
    giles_normal,
    key_from_digest,
    layer_key,
    layer_seed,
    path_digest,
)

PATHS = ["blocks.attn.q_proj.kernel.0", "blocks.mlp.down_proj.kernel.27", "w", "ünïcode.path"]
STEPS = [0, 1, 299, 65535, 65536, 123_456_789, 2**31 - 1]


def hashlib_seed(base, step, path):
    """The authors' formula: an 8-byte BLAKE2b digest of the name, unpacked as a little-endian uint64."""
    (digest,) = struct.unpack("<Q", hashlib.blake2b(path.encode(), digest_size=8).digest())
    return (base * 1_000_003 + step * 7_919 + digest) % 2**62


def test_layer_seed_matches_hashlib_formula():
    for base in (0, 42, 2**40 + 3):
        for step in STEPS:
            for path in PATHS:
                assert layer_seed(base, step, path) == hashlib_seed(base, step, path)
    (expected,) = struct.unpack("<Q", hashlib.blake2b(b"w", digest_size=8).digest())
    assert path_digest("w") == expected
    # BLAKE2b mixes the output length into its state: truncating the 64-byte digest is a different number.
    assert path_digest("w") != int.from_bytes(hashlib.blake2b(b"w").digest()[:8], "little")
    with pytest.raises(ValueError, match="step"):
        layer_seed(42, -1, "w")
    with pytest.raises(TypeError, match="base_seed"):
        layer_seed(42.0, 0, "w")


def test_traced_key_equals_host_seed_and_64bit_jax_key():
    words = jnp.asarray(digest_words(PATHS))
    steps = jnp.asarray(STEPS, jnp.int32)
    for base in (0, 42, 2**40 + 3):
        # step and digest both traced: the scan-over-layers use of key_from_digest.
        key_words = lambda s, w, base=base: jax.random.key_data(key_from_digest(base, s, w))
        got = jax.jit(jax.vmap(jax.vmap(key_words, in_axes=(None, 0)), in_axes=(0, None)))(steps, words)
        for i, step in enumerate(STEPS):
            for j, path in enumerate(PATHS):
                seed = hashlib_seed(base, step, path)
                assert (int(got[i, j, 0]), int(got[i, j, 1])) == (seed >> 32, seed & 0xFFFFFFFF), (step, path)
    seed = layer_seed(42, 7, PATHS[0])
    with jax.enable_x64(True):
        reference = np.asarray(jax.random.key_data(jax.random.key(seed)))
    np.testing.assert_array_equal(jax.random.key_data(layer_key(42, jnp.int32(7), PATHS[0])), reference)
    np.testing.assert_array_equal(projection(layer_key(42, 7, PATHS[0]), 4, 16), projection(seed, 4, 16))


def test_projection_distributions():
    r, k = 16, 4096
    a = np.asarray(projection(layer_seed(42, 0, "w"), r, k, "rademacher"))
    np.testing.assert_array_equal(np.abs(a), np.full((r, k), 0.25, np.float32))
    assert abs(np.mean(a > 0) - 0.5) < 0.01  # 65536 fair coin flips: sd 0.002
    g = np.asarray(projection(layer_seed(42, 0, "w"), r, k, "gaussian"), np.float64)
    assert abs(g.mean()) < 5 * np.sqrt(1 / r / g.size)
    assert abs(g.var() * r - 1) < 0.03  # var of the sample variance: 2/n, sd 0.0055
    # E[AᵀA] = I: the diagonal of AᵀA averages to 1 over columns.
    assert abs(np.mean(np.sum(g * g, axis=0)) - 1) < 0.03
    assert projection(3, 4, 8, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="distribution"):
        projection(0, 4, 8, "uniform")
    with pytest.raises(TypeError, match="rank"):
        projection(0, 0, 8)


def _legacy_erf_inv():
    """A context in which `jax.random.normal` uses Giles' float32 erf_inv: jax ≤ 0.10 always does; from 0.11 on,
    with the `jax_accurate_erf_inv` state off."""
    from jax._src import config as jax_config
    state = getattr(jax_config, "jax_accurate_erf_inv", None)
    return contextlib.nullcontext() if state is None else state(False)


def _erfinv64(y: np.ndarray) -> np.ndarray:
    """float64 erfinv by Newton's method on erfc(|x|) = 1 − |y| (exact in float64 for float32 y, and erfc keeps its
    relative accuracy in the tails, where erf(x) − y would cancel), from a start with the right sign and size."""
    y = np.asarray(y, np.float64)
    q = 1.0 - np.abs(y)
    erfc = np.vectorize(math.erfc)
    x = np.sqrt(-np.log(q * (2.0 - q)))  # erfinv(|y|) lies within a factor ~1.3 of this for q in (0, 1]
    for _ in range(40):
        x = np.maximum(x + (erfc(x) - q) / (2.0 / math.sqrt(math.pi) * np.exp(-x * x)), 0.0)
    return np.sign(y) * x


def test_gaussian_draws_are_giles_erfinv_on_every_jax_version():
    """The Gaussian A is √2·erfinv(u) with Giles' float32 erfinv written out (`giles_normal`): bit for bit what
    `jax.random.normal` draws with that erf_inv (every JAX up to 0.10), eagerly and inside a jitted program, and
    within Giles' accuracy of a float64 erfinv, down to the clamped tails."""
    key = jax.random.key(3)
    shape = (64, 1000)
    with _legacy_erf_inv():
        want = np.asarray(jax.random.normal(key, shape, jnp.float32))
        want_jit = np.asarray(jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32) * 2.0)(key))
    got = np.asarray(giles_normal(key, shape))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    got_jit = np.asarray(jax.jit(lambda k: giles_normal(k, shape) * 2.0)(key))
    np.testing.assert_array_equal(got_jit.view(np.uint32), want_jit.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(projection(layer_seed(7, 0, "w"), 4, 16, "gaussian")),
                                  np.asarray(giles_normal(layer_key(7, 0, "w"), (4, 16))) * np.float32(0.5))
    # Accuracy against float64: some of the draws' own uniforms and the extremes (±(1 − 2⁻²⁴), 0, near ±1).
    lo = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    u = np.asarray(jax.random.uniform(key, shape, jnp.float32, lo, 1.0)).ravel()[:4000]
    np.testing.assert_allclose(got.ravel()[:4000], math.sqrt(2) * _erfinv64(u), rtol=1e-5, atol=1e-6)
    edges = np.array([lo, -lo, 0.0, 0.5, -0.999, 1 - 2.0**-20], np.float32)
    np.testing.assert_allclose(np.asarray(giles_erfinv(edges), np.float64), _erfinv64(edges), rtol=1e-5, atol=1e-6)
    assert np.asarray(giles_erfinv(np.array([1.0, -1.0], np.float32))).tolist() == [np.inf, -np.inf]
    assert abs(_erfinv64(np.array([0.5]))[0] - 0.4769362762044699) < 1e-15  # erfinv(0.5), a published value


def test_target_projection_slices_refresh_and_scan_over_layers():
    params = {"blocks": {"q_proj": {"kernel": jnp.zeros((3, 8, 5))}}}
    t = find_targets(params)["blocks.q_proj.kernel"]
    a = target_projection(t, 42, 2, 4, "gaussian")
    assert a.shape == (3, 4, 8)
    for i in range(3):
        np.testing.assert_array_equal(a[i], projection(layer_seed(42, 2, f"blocks.q_proj.kernel.{i}"), 4, 8,
                                                       "gaussian"))
    assert not np.allclose(a, target_projection(t, 42, 3, 4, "gaussian"))  # a new A every step
    # The sketch-native model scans over layers with the digests as scanned inputs: same A per layer.
    words = jnp.asarray(digest_words(t.slice_paths))

    def body(carry, digest):
        return carry, projection(key_from_digest(42, carry, digest), 4, t.k, "gaussian")

    _, scanned = jax.jit(lambda step: jax.lax.scan(body, step, words))(jnp.int32(2))
    np.testing.assert_array_equal(scanned, a)
    unbatched = find_targets({"q_proj": {"kernel": jnp.zeros((8, 5))}})["q_proj.kernel"]
    np.testing.assert_array_equal(target_projection(unbatched, 42, 0, 4),
                                  projection(layer_seed(42, 0, "q_proj.kernel"), 4, 8))


@pytest.mark.parametrize("dist", ["rademacher", "gaussian"])
def test_sketch_times_projection_is_unbiased(dist):
    """mean over N seeds of S A = G (AᵀA) → G, with per-entry standard errors from the exact variance.

    (AᵀA)_ml − δ_ml has mean 0 and variance 1/r off the diagonal; on the diagonal 0 (Rademacher) or 2/r
    (Gaussian). So Var[(G AᵀA)_jl] = (Σ_{m≠l} G_jm² + c G_jl²)/r with c = 0 or 2, and the mean of N independent
    draws has that variance / N.
    """
    r, d, k, n = 8, 6, 32, 4000
    g = np.random.default_rng(0).normal(size=(d, k))
    target = find_targets({"q_proj": {"kernel": jnp.zeros((k, d))}})["q_proj.kernel"]

    @jax.jit
    def mean_estimate(g):
        def one(step):
            a = target_projection(target, 42, step, r, dist)
            return (g @ a.T) @ a

        return jnp.mean(jax.lax.map(one, jnp.arange(n, dtype=jnp.int32), batch_size=500), axis=0)

    est = np.asarray(mean_estimate(jnp.asarray(g, jnp.float32)), np.float64)
    c = 2.0 if dist == "gaussian" else 0.0
    var = ((np.sum(g ** 2, axis=1, keepdims=True) - g ** 2) + c * g ** 2) / r
    z = (est - g) / np.sqrt(var / n)
    # 192 entries, each ~N(0, 1): |z| < 5 fails with probability ~1e-4; the mean square concentrates at 1.
    assert np.abs(z).max() < 5.0
    assert 0.6 < np.mean(z ** 2) < 1.5
    # A biased estimator (e.g. missing 1/√r) would be off by O(1) in every entry, hundreds of standard errors.
    assert np.abs(est - g).max() < 0.2 * np.abs(g).max()
