"""A fingerprint of an array's bits, computed on device: the project's one way to tell that two arrays are equal
bitwise without moving them (checkpoint verification, policy-sync drift checks, equal starting weights across
processes).

Definition (persisted in checkpoints' layout records: it must never change):
  words w_i = the array's bits as uint32 in row-major order (8/16-bit types zero-extended, 64-bit types split into
  two words, low word first, bool as 0/1),
  c_i = (i · 0x9E3779B1 + 0x7F4A7C15) | 1,   fingerprint = Σ_i c_i w_i  mod 2³².
Every c_i is odd, hence invertible mod 2³²: a change of any single word always changes the fingerprint. Unlike a
plain sum it also sees words swapped between positions a and b, unless (c_a − c_b)·(w_a − w_b) happens to be a
multiple of 2³². It guards against corruption and drift, not against an adversary.

How it is computed: one fused pass over the words, no full-size temporary. XLA's CPU backend fuses the weights into
a reduction over a short axis but writes the whole weighted product to memory before a long one (several times
slower), so the leading axis of the words, R rows of M words each, is viewed as [R/B, B] with B ≤ 32 dividing R:
i = (r·B + b)·M + m, and
  G·i + O = r·(G·B·M) + b·(G·M) + (G·m + O)   (mod 2³², G = 0x9E3779B1, O = 0x7F4A7C15),
so c_i comes from three iotas; the [R/B, M] sums over b are then summed. B also divides the rows a shard holds when
the leading axis is sharded (`leaf_fingerprints` reads the sharding), so that view needs no communication: a
sharded array is fingerprinted where it lies, each device summing its own words, plus one scalar all-reduce.

Example:
  >>> import jax.numpy as jnp
  >>> tree_fingerprint({"b": jnp.array([1, 0], jnp.uint32), "a": {"c": jnp.zeros(3)}})
  {'a.c': 0, 'b': 2135587861}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from logra_jax.core.tree_paths import path_str

_GOLDEN = 0x9E3779B1
_OFFSET = 0x7F4A7C15
_MAX_SPLIT = 32  # XLA's CPU backend rewrites longer reductions into trees of 32-wide windows, unfused


def _word_bits(dtype: Any, name: str = "") -> int:
    """Bits per element of a supported dtype (bool: 1); TypeError naming the dtype (and leaf) otherwise."""
    if dtype == jnp.bool_:
        return 1
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        bits = 0
    if bits not in (8, 16, 32, 64):
        where = f" of leaf {name}" if name else ""
        raise TypeError(f"fingerprint: unsupported dtype {dtype}{where} (supported: bool and 8/16/32/64-bit "
                        f"integer or real floating dtypes)")
    return bits


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words (one per element; two per element, on a new last axis, for 64-bit types)."""
    bits = _word_bits(x.dtype)
    if bits == 1:
        return x.astype(jnp.uint32)
    if bits < 32:
        return lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
    return lax.bitcast_convert_type(x, jnp.uint32)


def _split(rows: int, shards: int = 1) -> int:
    """B: the largest divisor ≤ 32 of the rows one of `shards` shards holds (1 when they do not divide evenly)."""
    if rows == 0 or rows % shards:
        return 1
    local = rows // shards
    return max(b for b in range(1, min(local, _MAX_SPLIT) + 1) if local % b == 0)


def _row_major_index(shape: tuple[int, ...]) -> jax.Array:
    """uint32 array of `shape` holding each element's row-major position (mod 2³²)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def _fingerprint(x: jax.Array, shards: int = 1) -> jax.Array:
    """The fingerprint of `x` with the leading axis split for `shards` shards along it (see the module docstring)."""
    w = _words(jnp.asarray(x))
    w = w.reshape(1) if w.ndim == 0 else w
    rows, rest = w.shape[0], w.shape[1:]
    m_words = math.prod(rest)
    split = _split(rows, shards)
    w = w.reshape(rows // split, split, *rest)
    r = lax.broadcasted_iota(jnp.uint32, w.shape, 0)
    b = lax.broadcasted_iota(jnp.uint32, w.shape, 1)
    column = _row_major_index(rest) * jnp.uint32(_GOLDEN) + jnp.uint32(_OFFSET)  # G·m + O
    weights = (r * jnp.uint32(_GOLDEN * split * m_words % 2**32) + b * jnp.uint32(_GOLDEN * m_words % 2**32)
               + column) | jnp.uint32(1)
    partial = jnp.sum(w * weights, axis=1, dtype=jnp.uint32)
    # Without the barrier XLA merges the two sums into one long reduction, which writes the product first.
    return jnp.sum(lax.optimization_barrier(partial), dtype=jnp.uint32)


def _leading_shards(x: Any) -> int:
    """Into how many pieces a concrete array's sharding cuts its leading axis (1 for anything else)."""
    if not isinstance(x, jax.Array) or x.ndim == 0 or isinstance(x, jax.core.Tracer):
        return 1
    local = x.sharding.shard_shape(x.shape)[0]
    return x.shape[0] // local if local and x.shape[0] % local == 0 else 1


def fingerprint(x: jax.Array) -> jax.Array:
    """Position-weighted sum of the bits of `x`: Σ_i c_i w_i mod 2³² with odd c_i (see the module docstring).

    Works on sharded arrays without gathering them; also inside `jax.jit` (there the sharding of a traced array is
    unknown, and a leading axis sharded unevenly for the split may cost a resharding: `leaf_fingerprints` avoids it).

    Args:
      x: an array of a boolean, integer or real floating dtype of 8, 16, 32 or 64 bits.

    Returns:
      A uint32 scalar.

    Raises:
      TypeError: complex or sub-byte dtypes (the message names the dtype).

    Example:
      >>> import jax.numpy as jnp
      >>> int(fingerprint(jnp.array([1, 0], jnp.uint32)))  # c_0 = 0x7F4A7C15
      2135587861
    """
    return _fingerprint(x, _leading_shards(x))


_fingerprints = jax.jit(lambda leaves, shards: [_fingerprint(x, s) for x, s in zip(leaves, shards)],
                        static_argnums=1)


def _device_order(x: Any) -> tuple[int, ...] | None:
    """The devices a committed array lives on, in mesh order for a NamedSharding (None when uncommitted)."""
    if not getattr(x, "committed", False):
        return None
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        return tuple(int(d.id) for d in np.asarray(mesh.devices).flat)
    return tuple(sorted(d.id for d in x.sharding.device_set))


def leaf_fingerprints(leaves: Sequence[Any], names: Sequence[str] | None = None) -> list[int]:
    """`fingerprint` of many arrays; one jitted call per device assignment (a jit cannot mix them).

    Args:
      leaves: arrays (jax arrays, sharded or not, numpy arrays, scalars; the latter as jnp.asarray makes them).
      names: optional names of the leaves, for the message of an unsupported dtype.

    Returns:
      The fingerprints as Python ints, in the order of `leaves`.

    Raises:
      TypeError: a leaf of an unsupported dtype (the message names its dtype, and the leaf when `names` is given).
    """
    names = list(names) if names is not None else [""] * len(leaves)
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        _word_bits(jnp.result_type(x), names[i])  # here, where the leaf's name is known
        groups.setdefault(_device_order(x), []).append(i)
    result = [0] * len(leaves)
    for indices in groups.values():
        values = jax.device_get(_fingerprints([leaves[i] for i in indices],
                                              tuple(_leading_shards(leaves[i]) for i in indices)))
        for i, value in zip(indices, values):
            result[i] = int(value)
    return result


def tree_fingerprint(tree: Any) -> dict[str, int]:
    """{canonical path (`logra_jax.core.tree_paths.path_str`): fingerprint} of every leaf of `tree`, in tree order.

    Example:
      >>> tree_fingerprint({"w": jnp.array([1.0, 2.0])})
      {'w': 4118806528}
    """
    keyed = jax.tree_util.tree_leaves_with_path(tree)
    paths = [path_str(k) for k, _ in keyed]
    return dict(zip(paths, leaf_fingerprints([x for _, x in keyed], paths)))
