"""The low-rank merge: K ← K + (U A)ᵀ = K + Aᵀ Uᵀ, tiled so that only one block of ΔW exists at a time.

LoGRA notation: W [d, k] = Kᵀ with K the Flax kernel [k, d]; U [d, r] the update factor; A [r, k] the projection.
Optax convention: updates are added, so the caller passes the already-negated factor (U = −α D for docs/method.md §5).
With `round_bf16` U is rounded to bfloat16 first, the "wire" format the rollout engine receives (docs/method.md §6);
the product is accumulated in float32 either way and the sum rounded once to K's dtype:
  K_new = cast_K( K + Aᵀ · round(U)ᵀ ).

The Pallas kernel (TPU; gpu.py's `merge_gpu` on NVIDIA GPUs) walks a grid of (k, d) blocks; each step reads one
K block, the matching rows of U and columns of A, and writes the updated block over the input
(`input_output_aliases`), so under buffer donation the merge is in place and the dense ΔW [k, d] is never
materialised. The XLA implementation is the same formula as one expression (XLA may build the whole ΔW of the
layer in a temporary).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from logra_jax.kernels import gpu
from logra_jax.kernels.backend import (
    KernelTarget,
    block_or,
    check_block,
    check_implementation,
    compiler_params,
    cost_estimate,
    current_mesh,
    current_target,
    fit_block,
    num_blocks,
    pallas_target,
    per_device,
    round_factor,
    split,
    warn_once,
)

_NT = (((1,), (1,)), ((), ()))  # a · bᵀ


def merge_reference(kernel: jax.Array, factor: jax.Array, a: jax.Array, *, round_bf16: bool = False) -> jax.Array:
    """Plain jnp: K + Aᵀ · round(U)ᵀ in float32, cast to K's dtype. kernel [k, d], factor [d, r], a [r, k]."""
    delta = jnp.einsum("rk,dr->kd", a.astype(jnp.float32), round_factor(factor, round_bf16),
                       preferred_element_type=jnp.float32)
    return (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)


def _merge_kernel(k_ref, u_ref, at_ref, o_ref, *, round_bf16: bool):
    u = round_factor(u_ref[...], round_bf16)
    delta = jax.lax.dot_general(at_ref[...].astype(jnp.float32), u, _NT, preferred_element_type=jnp.float32)
    o_ref[...] = (k_ref[...].astype(jnp.float32) + delta).astype(o_ref.dtype)


def _merge_pallas(kernel: jax.Array, factor: jax.Array, a: jax.Array, *, round_bf16: bool, interpret: bool,
                  block_d: int, block_k: int, chip: KernelTarget) -> jax.Array:
    (k, d), (_, r) = kernel.shape, factor.shape
    bk, bd = fit_block(k, block_k), fit_block(d, block_d)
    # Aᵀ [k, r] costs one pass over k·r elements and turns the block product into the native a·bᵀ form.
    a_t = a.T
    vmem = 2 * (2 * bk * bd * kernel.dtype.itemsize + bd * r * factor.dtype.itemsize + bk * r * a.dtype.itemsize)
    # Every block is read and written exactly once, and only r (never split) is contracted: edge blocks need no
    # mask, their out-of-range rows and columns are dropped on the write-back.
    return pl.pallas_call(
        functools.partial(_merge_kernel, round_bf16=round_bf16),
        out_shape=jax.ShapeDtypeStruct(kernel.shape, kernel.dtype),
        grid=(num_blocks(k, bk), num_blocks(d, bd)),
        in_specs=[
            pl.BlockSpec((bk, bd), lambda ki, di: (ki, di)),
            pl.BlockSpec((bd, r), lambda ki, di: (di, 0)),
            pl.BlockSpec((bk, r), lambda ki, di: (ki, 0)),
        ],
        out_specs=pl.BlockSpec((bk, bd), lambda ki, di: (ki, di)),
        input_output_aliases={0: 0},
        compiler_params=compiler_params(("parallel", "parallel"), vmem, chip),
        interpret=interpret,
        name="logra_merge",
        cost_estimate=cost_estimate(2 * k * d * r + k * d, kernel, factor, a_t, kernel),
    )(kernel, factor, a_t)


@functools.partial(jax.jit, static_argnames=("round_bf16", "implementation", "interpret", "block_d", "block_k",
                                              "target", "chip"))
def _merge(kernel, factor, a, *, round_bf16, implementation, interpret, block_d, block_k, target, chip):
    if implementation == "xla":
        return merge_reference(kernel, factor, a, round_bf16=round_bf16)
    if target == "gpu":
        return gpu.merge_gpu(kernel, factor, a, round_bf16=round_bf16, interpret=interpret,
                             block_d=block_or(block_d, 64), block_k=block_or(block_k, 64))
    return _merge_pallas(kernel, factor, a, round_bf16=round_bf16, interpret=interpret,
                         block_d=block_or(block_d, 512), block_k=block_or(block_k, 512), chip=chip)


def merge(kernel: jax.Array, factor: jax.Array, a: jax.Array, *, round_bf16: bool = False,
          implementation: str = "xla", interpret: bool = False, block_d: int | None = None,
          block_k: int | None = None) -> jax.Array:
    """K_new = K + Aᵀ Uᵀ (the low-rank update ΔW = U A added to W = Kᵀ), tiled over blocks of d and k.

    Args:
      kernel: K [k, d] in Flax layout (any float dtype; the result keeps it).
      factor: U [d, r], already carrying the sign and step size (optax adds updates).
      a: projection A [r, k].
      round_bf16: round U to bfloat16 before the product (the wire format of docs/method.md §6).
      implementation: "xla" (one expression) or "pallas" (block-tiled kernel, K aliased in → out).
      interpret: Pallas only: run the kernel in the Pallas interpreter (required on CPU).
      block_d, block_k: Pallas only: block sizes along d and k (None: 512 on TPU, clipped to the array; 64 on
        GPU, where they must be powers of 2 ≥ 16).

    Returns:
      The merged kernel [k, d] in kernel's dtype. Donate `kernel` in the enclosing jit to merge in place.

    Raises:
      ValueError: unknown implementation, non-positive block sizes, shapes that do not chain, or compiled
        Pallas on CPU.
      NotImplementedError: compiled Pallas on a platform with no kernels (see logra_jax.kernels.backend).

    Example:
      >>> import jax.numpy as jnp
      >>> merge(jnp.zeros((3, 2)), jnp.ones((2, 1)), jnp.ones((1, 3))).tolist()
      [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    check_implementation(implementation, "merge")
    block_d = None if block_d is None else check_block("block_d", block_d, "merge")
    block_k = None if block_k is None else check_block("block_k", block_k, "merge")
    target = pallas_target("merge", interpret) if implementation == "pallas" else None
    if kernel.ndim != 2 or factor.ndim != 2 or a.ndim != 2:
        raise ValueError(f"merge: expected kernel [k, d], factor [d, r], a [r, k]; got shapes kernel {kernel.shape}, "
                         f"factor {factor.shape}, a {a.shape}")
    (k, d), (r, ka) = kernel.shape, a.shape
    if factor.shape != (d, r) or ka != k:
        raise ValueError(f"merge: shapes do not chain (kernel [k, d], factor [d, r], a [r, k]): kernel "
                         f"{kernel.shape}, factor {factor.shape}, a {a.shape}")
    def run(kernel, factor, a):
        return _merge(kernel, factor, a, round_bf16=bool(round_bf16), implementation=implementation,
                      interpret=bool(interpret), block_d=block_d, block_k=block_k, target=target,
                      chip=current_target() if implementation == "pallas" else None)

    # Inside a sharded step the kernel runs per device on a slice of d (each column of K needs only its row of U).
    mesh = current_mesh() if implementation == "pallas" else None
    if mesh is not None and d % mesh.size == 0:
        return per_device(run, mesh, (split(mesh, 2, 1), split(mesh, 2, 0), PartitionSpec()), split(mesh, 2, 1))(
            kernel, factor, a)
    if mesh is not None and mesh.size > 1:
        warn_once(f"merge: implementation='pallas' in a step sharded over {mesh.size} devices splits K [k, d] along "
                  f"d, but d = {d} does not divide: every device merges the whole K [{k}, {d}] (gathered)")
    return per_device(run, mesh, (PartitionSpec(),) * 3, PartitionSpec())(kernel, factor, a)
