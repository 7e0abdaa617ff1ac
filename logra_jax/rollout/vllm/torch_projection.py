"""The projections A of logra_jax.optim.projection regenerated in PyTorch, bit for bit JAX's.

An engine that runs in PyTorch (vLLM) merges W ← W + U·A from the factor U and the seed alone, so it must draw the
very A the trainer's JAX code drew. This module repeats JAX's computation step by step, in integer arithmetic
wherever JAX's is integer, and imports only torch, the standard library and `logra_jax.core.giles` (constants; it runs
inside vLLM's process):

  seed      = (base · 1_000_003 + step · 7_919 + digest(path)) mod 2^62              (`layer_seed`)
  key       = (k₀, k₁) = (seed >> 32, seed & 0xffffffff)                            (threefry2x32 key data)
  bits_i    = x₀ ^ x₁ where (x₀, x₁) = threefry2x32(key, (i >> 32, i & 0xffffffff)),  i the row-major index
              (`jax.random.bits` with the default `jax_threefry_partitionable=True`)
  u_i       = float32 with bits (bits_i >> 9) | 0x3f800000, minus 1                   (uniform [0, 1))
  Rademacher: A_i = (2·[u_i < 0.5] − 1) · f32(1/√r)                                   (exact in any arithmetic)
  Gaussian:   v_i = max(lo, 2·u_i + lo), lo = −(1 − 2^−24);  A_i = √2 · erfinv(v_i) · f32(1/√r)
              with erfinv Giles' float32 polynomial (`logra_jax.optim.projection.giles_erfinv`, what XLA
              decomposed `erf_inv` into up to jax 0.10; the trainer writes it out on every version),
              w = −log1p(−v²), evaluated in the same order of float32 operations.

The Rademacher draw (the default) involves no floating-point rounding except the final scale and is bit for bit
JAX's on any device. The Gaussian draw goes through log1p and sqrt, whose float32 results are not fixed across
libraries: XLA's own CPU log1p changes with its compile options (JAX's Gaussian draws differ between XLA's default
pipeline and -O0), so a Gaussian A here equals JAX's to a few ulp, not bit for bit (the tests bound it).
JAX with `jax_enable_x64` draws Rademacher entries from 64-bit uniforms: this port follows the default 32-bit mode.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from logra_jax.core.giles import ERFINV_GE5, ERFINV_LT5

DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian")

_BASE_MULT = 1_000_003
_STEP_MULT = 7_919
_SEED_BITS = 62
_MASK32 = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KS_PARITY = 0x1BD11BDA


def path_digest(path: str) -> int:
    """digest(path): BLAKE2b with digest_size=8 of the UTF-8 path, read little endian (as the JAX side)."""
    if not isinstance(path, str):
        raise TypeError(f"path must be a str, got {path!r}")
    return int.from_bytes(hashlib.blake2b(path.encode("utf-8"), digest_size=8).digest(), "little")


def layer_seed(base_seed: int, step: int, path: str) -> int:
    """The 62-bit seed of the projection of `path` at `step`: (base·1_000_003 + step·7_919 + digest) mod 2^62.

    Raises:
      TypeError / ValueError: base_seed or step is not a non-negative int (named).

    Example:
      >>> 0 <= layer_seed(42, 3, "blocks.attn.q_proj.kernel.0") < 2**62
      True
    """
    for name, value in (("base_seed", base_seed), ("step", step)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    return (base_seed * _BASE_MULT + step * _STEP_MULT + path_digest(path)) % (1 << _SEED_BITS)


def _rotl(x: torch.Tensor, d: int) -> torch.Tensor:
    return ((x << d) | (x >> (32 - d))) & _MASK32


def threefry2x32(key: tuple[int, int], x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 (20 rounds) of the counter words (x0, x1) under `key`, as JAX's `threefry2x32_p`.

    Words are held in int64 tensors with values in [0, 2^32) (torch has no full uint32 arithmetic); every sum is
    reduced mod 2^32.

    Example (the Random123 known-answer vector):
      >>> out = threefry2x32((0x13198a2e, 0x03707344), torch.tensor([0x243f6a88]), torch.tensor([0x85a308d3]))
      >>> [hex(int(w)) for w in out]
      ['0xc4923a9c', '0x483df7a0']
    """
    k0, k1 = (int(k) & _MASK32 for k in key)
    ks = (k0, k1, k0 ^ k1 ^ _KS_PARITY)
    x0 = (x0 + ks[0]) & _MASK32
    x1 = (x1 + ks[1]) & _MASK32
    for block in range(5):
        for rot in _ROTATIONS[block % 2]:
            x0 = (x0 + x1) & _MASK32
            x1 = _rotl(x1, rot) ^ x0
        x0 = (x0 + ks[(block + 1) % 3]) & _MASK32
        x1 = (x1 + ks[(block + 2) % 3] + block + 1) & _MASK32
    return x0, x1


def random_bits(seed: int, shape: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """uint32 words (in int64) of `jax.random.bits(jax.random.key(seed), shape)` (partitionable threefry)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    n = math.prod(shape)
    index = torch.arange(n, dtype=torch.int64, device=device)
    x0, x1 = threefry2x32((seed >> 32, seed & _MASK32), index >> 32, index & _MASK32)
    return (x0 ^ x1).reshape(tuple(shape))


def uniform_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) from uint32 words: the 23 high bits as mantissa of a number in [1, 2), minus 1."""
    mantissa = (bits >> 9) | 0x3F800000
    return mantissa.to(torch.int32).view(torch.float32) - 1.0


def _erfinv(x: torch.Tensor) -> torch.Tensor:
    w = -torch.log1p(x * -x)
    lt = w < 5.0
    w = torch.where(lt, w - 2.5, torch.sqrt(w) - 3.0)
    coef = lambda i: torch.where(lt, torch.tensor(ERFINV_LT5[i], dtype=torch.float32, device=x.device),
                                 torch.tensor(ERFINV_GE5[i], dtype=torch.float32, device=x.device))
    p = coef(0)
    for i in range(1, len(ERFINV_LT5)):
        p = coef(i) + p * w
    return torch.where(x.abs() == 1.0, x * math.inf, p * x)


def draw(seed: int, shape: Sequence[int], distribution: str = "rademacher",
         device: torch.device | str | None = None) -> torch.Tensor:
    """float32 `jax.random.rademacher` (±1) or `jax.random.normal` of key(seed) with this shape (unscaled)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    u = uniform_bits(random_bits(seed, shape, device))
    if distribution == "rademacher":
        return 2.0 * (u < 0.5).to(torch.float32) - 1.0
    lo = torch.tensor(-(1.0 - 2.0 ** -24), dtype=torch.float32, device=u.device)
    v = torch.maximum(lo, u * 2.0 + lo)
    return torch.tensor(math.sqrt(2), dtype=torch.float32, device=u.device) * _erfinv(v)


def projection(seed: int, rank: int, width: int, distribution: str = "rademacher",
               device: torch.device | str | None = None) -> torch.Tensor:
    """A [rank, width] float32, equal to `logra_jax.optim.projection.projection(seed, rank, width, distribution)`.

    Example:
      >>> a = projection(layer_seed(42, 0, "w"), rank=4, width=8)
      >>> tuple(a.shape), float(a[0, 0].abs())
      ((4, 8), 0.5)
    """
    for name, value in (("rank", rank), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scale = torch.tensor(1.0 / math.sqrt(rank), dtype=torch.float32, device=device)
    return draw(seed, (rank, width), distribution, device) * scale


def slice_projections(base_seed: int, step: int, paths: Sequence[str], rank: int, width: int,
                      distribution: str = "rademacher", device: torch.device | str | None = None) -> torch.Tensor:
    """A [len(paths), rank, width]: the projection of each slice path at `step` (the step the projection is drawn
    for, i.e. `SketchSpec.draw_step` of the update's step), as `logra_jax.optim.projection.slice_projections`."""
    if isinstance(paths, str):
        raise TypeError(f"paths must be a sequence of str, not a single str {paths!r}")
    return torch.stack([projection(layer_seed(base_seed, step, p), rank, width, distribution, device)
                        for p in paths])
