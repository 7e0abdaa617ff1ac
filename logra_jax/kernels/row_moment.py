"""RowAdam's per-row second moment and row scaling (docs/method.md §4) in one pass over the sketch S [d, r].

For step t = count + 1 (count: completed updates, optax's state count) and row state v [d]:
  v_i ← β₂ v_i + (1 − β₂) · mean_j S_ij²
  ρ_i = sqrt(v_i / (1 − β₂^t))
Paper variant:  den_i = ρ_i + max(ε · mean_i ρ_i, tiny)   (relative ε; tiny = smallest normal float32)
                s_i ∝ 1/den_i with unit RMS over rows;  D̃ = diag(s) S;  D = D̃ · ‖S‖_F / ‖D̃‖_F
NeMo variant:   D = S / (ρ + ε)                          (absolute ε)
The paper variant only redistributes magnitude across rows (‖D‖_F = ‖S‖_F; D = 0 when S = 0).

Pallas: a first kernel reads each block of rows of S once and writes v_new, ρ and the row sums Σ_j S_ij²
(and, for NeMo, D itself: no global quantity is needed). For the paper variant the global reductions
(mean ρ, ‖S‖_F² = Σ_i rowsq_i, ‖D̃‖_F² = Σ_i s_i² rowsq_i) then cost O(d) in jnp, and a second kernel applies
D = c ⊙ S with c_i = s_i ‖S‖_F / ‖D̃‖_F. Row vectors travel as [d, 1] so every block is 2-D; β₂, ε and the
bias correction travel as one [1, 3] array, so traced (scheduled) hyperparameters cost no recompilation.
On NVIDIA GPUs the same two passes run as gpu.py's `row_moment_gpu` / `row_scale_gpu` (masked power-of-2 tiles).
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
)

VARIANTS: tuple[str, ...] = ("paper", "nemo")
_TINY = float(jnp.finfo(jnp.float32).tiny)


def _bias_correction(count: jax.Array, b2: jax.Array) -> jax.Array:
    """1 / (1 − β₂^t) with t = count + 1, as a float32 scalar."""
    t = jnp.asarray(count, jnp.float32) + 1.0
    return 1.0 / (1.0 - jnp.power(jnp.asarray(b2, jnp.float32), t))


def row_moment_reference(s: jax.Array, v: jax.Array, count: jax.Array, *, b2: float | jax.Array,
                         eps: float | jax.Array, variant: str) -> tuple[jax.Array, jax.Array]:
    """Plain jnp RowAdam step, written from docs/method.md §4: returns (v_new [d], D [d, r]), both float32."""
    s = s.astype(jnp.float32)
    v_new = b2 * v.astype(jnp.float32) + (1.0 - b2) * jnp.mean(s * s, axis=1)
    rho = jnp.sqrt(v_new * _bias_correction(count, b2))
    if variant == "nemo":
        return v_new, s / (rho + eps)[:, None]
    den = rho + jnp.maximum(eps * jnp.mean(rho), _TINY)
    # 1/den_i scaled by min_j den_j, which cancels in the unit-RMS normalisation but keeps 1/den² finite
    # when den is as small as `tiny` (an all-zero sketch).
    inv = jnp.min(den) / den
    row_scale = inv / jnp.sqrt(jnp.mean(inv * inv))
    d_tilde = row_scale[:, None] * s
    norm_s, norm_dt = jnp.linalg.norm(s), jnp.linalg.norm(d_tilde)
    return v_new, d_tilde * jnp.where(norm_dt > 0, norm_s / jnp.where(norm_dt > 0, norm_dt, 1.0), 0.0)


def _stats_kernel(s_ref, v_ref, hyper_ref, *out_refs, r: int, variant: str):
    hyper = hyper_ref[...]
    b2, bias_correction, eps = hyper[:, 0:1], hyper[:, 1:2], hyper[:, 2:3]
    s = s_ref[...].astype(jnp.float32)
    rowsq = jnp.sum(s * s, axis=1, keepdims=True)
    v_new = b2 * v_ref[...] + (1.0 - b2) * (rowsq * (1.0 / r))
    rho = jnp.sqrt(v_new * bias_correction)
    if variant == "nemo":
        v_out, d_out = out_refs
        d_out[...] = (s / (rho + eps)).astype(d_out.dtype)
    else:
        v_out, rho_out, rowsq_out = out_refs
        rho_out[...] = rho
        rowsq_out[...] = rowsq
    v_out[...] = v_new


def _scale_kernel(s_ref, c_ref, d_ref):
    d_ref[...] = (s_ref[...].astype(jnp.float32) * c_ref[...]).astype(d_ref.dtype)


def _paper_row_scale(rho: jax.Array, rowsq: jax.Array, eps: jax.Array) -> jax.Array:
    """c_i = s_i ‖S‖_F / ‖D̃‖_F from ρ [d, 1] and rowsq_i = Σ_j S_ij² [d, 1] (the global, O(d) part)."""
    den = rho + jnp.maximum(eps * jnp.mean(rho), _TINY)
    inv = jnp.min(den) / den
    row_scale = inv * jax.lax.rsqrt(jnp.mean(inv * inv))
    norm_s2, norm_dt2 = jnp.sum(rowsq), jnp.sum(row_scale * row_scale * rowsq)
    ratio = jnp.where(norm_dt2 > 0, jnp.sqrt(norm_s2 / jnp.where(norm_dt2 > 0, norm_dt2, 1.0)), 0.0)
    return row_scale * ratio


def _row_moment_pallas(s, v, count, *, b2, eps, variant, interpret, block_d, chip: KernelTarget):
    d, r = s.shape
    b2, eps = jnp.asarray(b2, jnp.float32), jnp.asarray(eps, jnp.float32)
    hyper = jnp.stack([b2, _bias_correction(count, b2), eps]).reshape(1, 3)
    bd = fit_block(d, block_d)
    grid = (num_blocks(d, bd),)
    rows, vec = pl.BlockSpec((bd, r), lambda i: (i, 0)), pl.BlockSpec((bd, 1), lambda i: (i, 0))
    vec_shape = jax.ShapeDtypeStruct((d, 1), jnp.float32)
    params = compiler_params(("parallel",), 4 * (2 * bd * r + 8 * bd), chip)
    # Rows are independent and r is never split: an edge block's out-of-range rows are dropped on write-back.
    if variant == "nemo":
        out_shape, out_specs = (vec_shape, jax.ShapeDtypeStruct((d, r), jnp.float32)), (vec, rows)
    else:
        out_shape, out_specs = (vec_shape,) * 3, (vec,) * 3
    outs = pl.pallas_call(
        functools.partial(_stats_kernel, r=r, variant=variant),
        out_shape=out_shape,
        grid=grid,
        in_specs=[rows, vec, pl.BlockSpec((1, 3), lambda i: (0, 0))],
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name="logra_row_moment",
        cost_estimate=cost_estimate(3 * d * r + 8 * d, s, v, *out_shape),
    )(s, v.astype(jnp.float32).reshape(d, 1), hyper)
    if variant == "nemo":
        v_new, d_out = outs
        return v_new.reshape(d), d_out
    v_new, rho, rowsq = outs
    d_out = pl.pallas_call(
        _scale_kernel,
        out_shape=jax.ShapeDtypeStruct((d, r), jnp.float32),
        grid=grid,
        in_specs=[rows, vec],
        out_specs=rows,
        compiler_params=params,
        interpret=interpret,
        name="logra_row_scale",
        cost_estimate=cost_estimate(d * r, s, s, vec_shape),
    )(s, _paper_row_scale(rho, rowsq, eps))
    return v_new.reshape(d), d_out


def _row_moment_gpu(s, v, count, *, b2, eps, variant, interpret, block_d, **launch):
    """The GPU kernels and the O(d) paper finish; `launch`: num_warps / num_stages for both kernels."""
    b2, eps = jnp.asarray(b2, jnp.float32), jnp.asarray(eps, jnp.float32)
    hyper = jnp.stack([b2, _bias_correction(count, b2), eps, jnp.zeros((), jnp.float32)])
    if variant == "nemo":
        return gpu.row_moment_gpu(s, v, hyper, variant="nemo", interpret=interpret, block_d=block_d, **launch)
    v_new, rho, rowsq = gpu.row_moment_gpu(s, v, hyper, variant="paper", interpret=interpret, block_d=block_d,
                                           **launch)
    scale = _paper_row_scale(rho[:, None], rowsq[:, None], eps)[:, 0]
    return v_new, gpu.row_scale_gpu(s, scale, interpret=interpret, block_d=block_d, **launch)


@functools.partial(jax.jit, static_argnames=("variant", "implementation", "interpret", "block_d", "target", "chip"))
def _row_moment(s, v, count, *, b2, eps, variant, implementation, interpret, block_d, target, chip):
    if implementation == "xla":
        return row_moment_reference(s, v, count, b2=b2, eps=eps, variant=variant)
    if target == "gpu":
        return _row_moment_gpu(s, v, count, b2=b2, eps=eps, variant=variant, interpret=interpret, block_d=block_d)
    return _row_moment_pallas(s, v, count, b2=b2, eps=eps, variant=variant, interpret=interpret,
                              block_d=block_or(block_d, 512), chip=chip)


def row_moment(s: jax.Array, v: jax.Array, count: jax.Array | int, *, b2: float | jax.Array = 0.95,
               eps: float | jax.Array = 1e-8,
               variant: str = "paper", implementation: str = "xla", interpret: bool = False,
               block_d: int | None = None) -> tuple[jax.Array, jax.Array]:
    """One RowAdam step on a sketch: the new row second moment and the row-scaled direction D.

    Args:
      s: sketch S [d, r] (float32).
      v: row second moment [d] before this step (float32; zeros at the start).
      count: completed updates before this one (optax's state count; step t = count + 1); may be traced.
      b2: β₂ in [0, 1) (a Python number is checked; an array may be traced).
      eps: ε ≥ 0; relative to mean ρ for "paper", absolute for "nemo" (likewise).
      variant: "paper" (norm-preserving row redistribution) or "nemo" (S / (ρ + ε)).
      implementation: "xla" (jnp) or "pallas" (one fused pass over S, plus the row scaling for "paper").
      interpret: Pallas only: run the kernels in the Pallas interpreter (required on CPU).
      block_d: Pallas only: rows per block (None: 512 on TPU, clipped to d; on GPU a power of 2 ≥ 16, by default
        as many rows as keep a tile at 8192 elements).

    Returns:
      (v_new [d], D [d, r]), both float32.

    Raises:
      ValueError: unknown variant or implementation, b2 outside [0, 1), negative eps, non-positive block_d,
        shapes other than s [d, r] with v [d], or compiled Pallas on CPU.
      NotImplementedError: compiled Pallas on a platform with no kernels (see logra_jax.kernels.backend).

    Example:
      >>> import jax.numpy as jnp
      >>> v, d = row_moment(2.0 * jnp.ones((3, 2)), jnp.zeros(3), 0, b2=0.75, variant="nemo", eps=0.0)
      >>> v.tolist(), d.tolist()
      ([1.0, 1.0, 1.0], [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    """
    check_implementation(implementation, "row_moment")
    if variant not in VARIANTS:
        raise ValueError(f"row_moment: variant must be one of {VARIANTS}, got {variant!r}")
    if isinstance(b2, (int, float)) and not 0.0 <= b2 < 1.0:
        raise ValueError(f"row_moment: b2 must lie in [0, 1), got {b2!r}")
    if isinstance(eps, (int, float)) and not eps >= 0.0:
        raise ValueError(f"row_moment: eps must be >= 0, got {eps!r}")
    block_d = None if block_d is None else check_block("block_d", block_d, "row_moment")
    target = pallas_target("row_moment", interpret) if implementation == "pallas" else None
    if s.ndim != 2 or v.shape != s.shape[:1]:
        raise ValueError(f"row_moment: expected s [d, r] and v [d]; got s {s.shape}, v {v.shape}")
    def run(s, v):
        return _row_moment(s, v, count, b2=b2, eps=eps, variant=variant, implementation=implementation,
                           interpret=bool(interpret), block_d=block_d, target=target,
                           chip=current_target() if implementation == "pallas" else None)

    # Inside a sharded step the kernels run per device, on the whole S (the paper variant's scale is global).
    mesh = current_mesh() if implementation == "pallas" else None
    return per_device(run, mesh, (PartitionSpec(), PartitionSpec()), (PartitionSpec(), PartitionSpec()))(s, v)
