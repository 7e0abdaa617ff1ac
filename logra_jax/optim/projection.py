"""Projections A [r, k]: regenerated from (base seed, step, layer path), never stored (docs/method.md §2).

  seed = (base · 1_000_003 + step · 7_919 + digest(path)) mod 2^62
  digest(path) = BLAKE2b with digest_size=8 of the UTF-8 canonical path, read little endian (the authors' formula;
                 not the first 8 bytes of the default 64-byte digest, a different number)
  key = threefry2x32 key data [seed >> 32, seed & 0xffffffff]   (= jax.random.key(seed) with 64-bit ints)
  Rademacher: A_ij = ±1/√r;  Gaussian: A_ij ~ N(0, 1/r);  so E[AᵀA] = I and E[S A] = E[G AᵀA] = G.

JAX runs with 32-bit integers by default, so `key_from_digest` computes the 62-bit seed from uint32 (hi, lo)
words: it is fully traceable (step and digest may be tracers, e.g. inside a lax.scan over stacked layers) and
equals the host-side `layer_seed`. Regenerating the same A elsewhere needs the same JAX PRNG settings
(threefry2x32, the default `jax_threefry_partitionable=True`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.core.giles import ERFINV_GE5, ERFINV_LT5
from logra_jax.optim.targets import Target

Distribution = Literal["rademacher", "gaussian"]
DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian")

_BASE_MULT = 1_000_003
_STEP_MULT = 7_919
_SEED_BITS = 62
_MASK32 = 0xFFFFFFFF


def path_digest(path: str) -> int:
    """digest(path): `hashlib.blake2b(path.encode("utf-8"), digest_size=8)` read little endian (docs/method.md §2).

    Example:
      >>> path_digest("blocks.attn.q_proj.kernel.0") < 2**64
      True
    """
    if not isinstance(path, str):
        raise TypeError(f"path must be a str, got {path!r}")
    return int.from_bytes(hashlib.blake2b(path.encode("utf-8"), digest_size=8).digest(), "little")


def check_nonneg_int(name: str, value: int) -> int:
    """value as a Python int: TypeError unless an integer (static, so not an array), ValueError if negative."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a Python int (static; with optax.inject_hyperparams name it in "
                        f"static_args), got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return int(value)


def layer_seed(base_seed: int, step: int, path: str) -> int:
    """The 62-bit seed of the projection of layer `path` at `step` (host Python int).

    seed = (base_seed · 1_000_003 + step · 7_919 + digest(path)) mod 2^62

    Args:
      base_seed: the run's base seed (docs/method.md default 42), a non-negative int.
      step: number of completed updates (0 for a fixed projection), a non-negative int.
      path: the layer's canonical path (a batch slice i of a stacked kernel is "path.i").

    Returns:
      The seed, 0 <= seed < 2^62.

    Raises:
      TypeError: base_seed or step is not an int; ValueError: one is negative.

    Example:
      >>> 0 <= layer_seed(42, 3, "blocks.attn.q_proj.kernel.0") < 2**62
      True
    """
    base_seed = check_nonneg_int("base_seed", base_seed)
    step = check_nonneg_int("step", step)
    return (base_seed * _BASE_MULT + step * _STEP_MULT + path_digest(path)) % (1 << _SEED_BITS)


def digest_words(paths: Sequence[str]) -> np.ndarray:
    """uint32 [n, 2] array of (hi, lo) words of digest(path) for each path (host side).

    Example:
      >>> digest_words(["a", "b"]).shape
      (2, 2)
    """
    if isinstance(paths, str):
        raise TypeError(f"paths must be a sequence of str, not a single str {paths!r}")
    digests = [path_digest(p) for p in paths]
    return np.array([[d >> 32, d & _MASK32] for d in digests], dtype=np.uint32).reshape(len(digests), 2)


def _add64(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) uint32 addition modulo 2^64."""
    lo = a[1] + b[1]
    carry = (lo < a[1]).astype(jnp.uint32)
    return a[0] + b[0] + carry, lo


def key_from_digest(base_seed: int, step: jax.Array | int, digest_hi_lo: jax.Array | np.ndarray) -> jax.Array:
    """The projection key for (base_seed, step, path) given the path's digest words; traceable.

    Computes seed = (base·1_000_003 + step·7_919 + digest) mod 2^62 in uint32 (hi, lo) arithmetic and wraps
    [hi, lo] as threefry2x32 key data, equal to `jax.random.key(layer_seed(base_seed, step, path))` under
    64-bit integers.

    Args:
      base_seed: non-negative Python int (static).
      step: non-negative integer scalar, traced or not (< 2^32).
      digest_hi_lo: uint32 [2] (hi, lo) words of digest(path), from `digest_words`; may be a tracer.

    Returns:
      A typed PRNG key (threefry2x32).

    Example:
      >>> import jax
      >>> key = key_from_digest(42, 3, digest_words(["blocks.attn.q_proj.kernel.0"])[0])
      >>> int(jax.random.key_data(key)[1]) == layer_seed(42, 3, "blocks.attn.q_proj.kernel.0") & 0xFFFFFFFF
      True
    """
    base = check_nonneg_int("base_seed", base_seed) * _BASE_MULT % (1 << 64)
    base_words = (jnp.uint32(base >> 32), jnp.uint32(base & _MASK32))
    step = jnp.asarray(step)
    if not jnp.issubdtype(step.dtype, jnp.integer) or step.shape != ():
        raise TypeError(f"step must be an integer scalar, got {step.dtype}{list(step.shape)}")
    step = step.astype(jnp.uint32)
    # step · 7_919 < 2^45: split step into 16-bit halves so every partial product fits in 32 bits.
    high = (step >> 16) * jnp.uint32(_STEP_MULT)
    low = (step & jnp.uint32(0xFFFF)) * jnp.uint32(_STEP_MULT)
    step_words = _add64((high >> 16, (high & jnp.uint32(0xFFFF)) << 16), (jnp.uint32(0), low))
    digest = jnp.asarray(digest_hi_lo, dtype=jnp.uint32)
    if digest.shape != (2,):
        raise ValueError(f"digest_hi_lo must have shape (2,), got {digest.shape}")
    hi, lo = _add64(_add64(base_words, step_words), (digest[0], digest[1]))
    hi = hi & jnp.uint32((1 << (_SEED_BITS - 32)) - 1)
    return jax.random.wrap_key_data(jnp.stack([hi, lo]), impl="threefry2x32")


def layer_key(base_seed: int, step: jax.Array | int, path: str) -> jax.Array:
    """The projection key of layer `path` at `step`; `step` may be a traced int32.

    Example:
      >>> import jax
      >>> jax.random.key_data(layer_key(42, 0, "w")).shape
      (2,)
    """
    return key_from_digest(base_seed, step, digest_words([path])[0])


def check_projection_args(rank: int, distribution: str) -> None:
    """Raise ValueError/TypeError for a bad rank (positive Python int) or distribution name."""
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank <= 0:
        raise TypeError(f"rank must be a positive Python int (static; with optax.inject_hyperparams name it in "
                        f"static_args), got {rank!r}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


# jax 0.12.1 lowers erf_inv to a more accurate piecewise polynomial by default (its Gaussian draws were up to 76 ulp
# from Giles' in tests/vllm/test_torch_projection.py). Written out here (`logra_jax.core.giles`), a Gaussian A is the
# same on every JAX version (a checkpoint resumes with the projections it was trained with) and the PyTorch port
# repeats the same operations.
def giles_erfinv(x: jax.Array) -> jax.Array:
    """float32 erfinv(x) for x in [−1, 1] by Giles' polynomial, in the order of operations of XLA's decomposition
    (±1 map to ±inf).

    Example:
      >>> float(giles_erfinv(jnp.float32(0.0)))
      0.0
    """
    x = jnp.asarray(x, jnp.float32)
    w = -jnp.log1p(x * -x)
    lt = w < np.float32(5.0)
    w = jnp.where(lt, w - np.float32(2.5), jnp.sqrt(w) - np.float32(3.0))
    coef = lambda i: jnp.where(lt, np.float32(ERFINV_LT5[i]), np.float32(ERFINV_GE5[i]))
    p = coef(0)
    for i in range(1, len(ERFINV_LT5)):
        p = coef(i) + p * w
    return jnp.where(jnp.abs(x) == np.float32(1.0), x * np.float32(np.inf), p * x)


@functools.partial(jax.jit, static_argnames="shape")
def giles_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 N(0, 1) draws of `key`: √2 · erfinv(u), u uniform in [−(1 − 2⁻²⁴), 1) (`jax.random.uniform`), with
    `giles_erfinv`: bit for bit `jax.random.normal(key, shape)` where JAX's erf_inv is Giles' (jax ≤ 0.10) on the
    same backend and compile options, and the same draws on every later version. Jitted, like jax.random.normal:
    run op by op, XLA:CPU's log1p compiled alone rounds some entries differently (jax 0.12.0.1: 67 of 64,000 under
    the tests' flags, by up to 3 ulp).

    Example:
      >>> z = giles_normal(jax.random.key(0), (2, 3))
      >>> z.shape, z.dtype
      ((2, 3), dtype('float32'))
    """
    lo = np.nextafter(np.float32(-1.0), np.float32(0.0))
    u = jax.random.uniform(key, shape, jnp.float32, lo, np.float32(1.0))
    return np.float32(math.sqrt(2)) * giles_erfinv(u)


def projection(key_or_seed: jax.Array | int, rank: int, width: int, distribution: Distribution = "rademacher",
               dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """A [rank, width] with entries ±1/√r (Rademacher) or N(0, 1/r) (Gaussian), so that E[AᵀA] = I.

    Args:
      key_or_seed: a typed PRNG key (e.g. from `layer_key`) or a host int seed < 2^64 (wrapped as
        threefry2x32 key data [seed >> 32, seed & 0xffffffff], the 64-bit `jax.random.key(seed)`).
      rank: r, a positive int.
      width: k, a positive int.
      distribution: "rademacher" or "gaussian".
      dtype: output dtype (sampled in float32, then cast).

    Returns:
      A [rank, width].

    Example:
      >>> a = projection(layer_seed(42, 0, "w"), rank=4, width=8)
      >>> a.shape, float(abs(a[0, 0]))
      ((4, 8), 0.5)
    """
    check_projection_args(rank, distribution)
    if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or width <= 0:
        raise ValueError(f"width must be a positive int, got {width!r}")
    if isinstance(key_or_seed, (int, np.integer)) and not isinstance(key_or_seed, bool):
        seed = int(key_or_seed)
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2^64), got {seed}")
        key = jax.random.wrap_key_data(np.array([seed >> 32, seed & _MASK32], np.uint32), impl="threefry2x32")
    else:
        key = key_or_seed
    shape = (int(rank), int(width))
    if distribution == "rademacher":
        a = jax.random.rademacher(key, shape, jnp.float32)
    else:
        a = giles_normal(key, shape)
    return (a * (1.0 / math.sqrt(rank))).astype(dtype)


def slice_projections(base_seed: int, step: jax.Array | int, digests: jax.Array, rank: int, width: int,
                      distribution: Distribution = "rademacher", dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """A [n, rank, width] for n paths given their digest words [n, 2] (`digest_words`); traceable.

    Example:
      >>> a = slice_projections(42, 0, digest_words(["w.0", "w.1"]), rank=4, width=8)
      >>> bool((a[1] == projection(layer_seed(42, 0, "w.1"), 4, 8)).all())
      True
    """
    one = lambda dg: projection(key_from_digest(base_seed, step, dg), rank, width, distribution, dtype)
    return jax.vmap(one)(jnp.asarray(digests, jnp.uint32))


def target_projection(target: Target, base_seed: int, step: jax.Array | int, rank: int,
                      distribution: Distribution = "rademacher", dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """All projections of a target: A (*batch_shape, r, k); batch slice i (flat row-major) uses "path.i".

    `step` is the step the projection is drawn for (pass 0 when refresh is off); it may be traced.

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim.targets import find_targets
      >>> t = find_targets({"q_proj": {"kernel": jnp.zeros((3, 8, 5))}})["q_proj.kernel"]
      >>> target_projection(t, base_seed=42, step=0, rank=4).shape
      (3, 4, 8)
    """
    check_projection_args(rank, distribution)
    check_nonneg_int("base_seed", base_seed)
    a = _slice_projections(base_seed, int(rank), target.k, distribution, jnp.dtype(dtype), jnp.asarray(step),
                           digest_words(target.slice_paths))
    return a.reshape(*target.batch_shape, rank, target.k)


# Jitted with the static arguments (not the path, whose digests are an input) so that eager use compiles once
# per shape and distribution.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _slice_projections(base_seed: int, rank: int, width: int, distribution: Distribution, dtype: jnp.dtype,
                       step: jax.Array, digests: np.ndarray) -> jax.Array:
    return slice_projections(base_seed, step, digests, rank, width, distribution, dtype)
