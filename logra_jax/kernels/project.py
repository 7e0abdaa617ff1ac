"""The sketched linear layer: y = x·K whose weight cotangent is replaced by the LoGRA sketch.

LoGRA notation: W [d, k] = Kᵀ (K is the Flax kernel [k, d]); X [T, k]; H = ∂L/∂y [T, d]; A [r, k].
Forward keeps P = X Aᵀ [T, r] as the residual (never X for the weight's sake); backward returns
  ∂L/∂x = H Kᵀ,   ∂L/∂probe = Hᵀ P = (Hᵀ X) Aᵀ = G Aᵀ = S   [d, r] (float32),
and zero cotangents for K and A: the dense gradient G = Hᵀ X is never formed. `probe` is a zero [d, r] input
whose only purpose is to receive S: `jax.grad` with respect to the probes yields the sketches.

Two implementations with the same semantics, chosen by `implementation=`:
- "xla": einsums; XLA schedules them.
- "pallas": on TPU two fused kernels (below; on NVIDIA GPUs gpu.py's `fused_forward_gpu` / `fused_backward_gpu`,
  written for parallel GPU grids). Forward: one sweep over (T, d, k) blocks computes y = X K and, on the first column
  of d blocks, P = X Aᵀ from the same X tiles. Backward: one sweep over (T, k, d) blocks computes dX = H Kᵀ and,
  on the first column of k blocks, accumulates S += Hᵀ P from the same H tiles into a VMEM-resident float32
  S [d, r] (written to HBM once at the end). All accumulations are float32.
Without differentiation both compute the plain y = x·K with XLA: the fused forward only pays off when P is kept.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
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
    split,
    warn_once,
    zero_outside,
)

_NT = (((1,), (1,)), ((), ()))  # contract the last axis of both operands: a · bᵀ
_TN = (((0,), (0,)), ((), ()))  # contract the first axis of both operands: aᵀ · b


def _project(x: jax.Array, a: jax.Array) -> jax.Array:
    """P = X Aᵀ: [..., k] x [r, k] → [..., r], accumulated in float32 and kept in x's dtype."""
    return jnp.einsum("...k,rk->...r", x, a.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def _linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jnp.einsum("...k,kd->...d", x, kernel.astype(x.dtype))


# ----------------------------------------------------------------------------------------------------------------
# XLA implementation (also the reference semantics of the Pallas one).


@jax.custom_vjp
def _sketched_linear_xla(x: jax.Array, kernel: jax.Array, a: jax.Array, probe: jax.Array) -> jax.Array:
    del a, probe
    return _linear(x, kernel)


SKETCH_PROJECTION = "sketch_projection"  # checkpoint name of P = X Aᵀ (remat policy "save_sketch" keeps it)


def _xla_fwd(x, kernel, a, probe):
    return _linear(x, kernel), (checkpoint_name(_project(x, a), SKETCH_PROJECTION), kernel, a, probe)


def _xla_bwd(res, h):
    p, kernel, a, probe = res
    dx = jnp.einsum("...d,kd->...k", h, kernel.astype(h.dtype))
    s = jnp.einsum("...d,...r->dr", h, p, preferred_element_type=jnp.float32)
    return dx, jnp.zeros_like(kernel), jnp.zeros_like(a), s.astype(probe.dtype)


_sketched_linear_xla.defvjp(_xla_fwd, _xla_bwd)


# ----------------------------------------------------------------------------------------------------------------
# Plain-jnp references of the two fused kernels.


def fused_forward_reference(x: jax.Array, kernel: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(y, P) = (X K, X Aᵀ) for X [T, k], K [k, d], A [r, k]; both in x's dtype, accumulated in float32."""
    y = jnp.einsum("tk,kd->td", x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype), _project(x, a)


def fused_backward_reference(h: jax.Array, p: jax.Array, kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dX, S) = (H Kᵀ, Hᵀ P) for H [T, d], P [T, r], K [k, d]: dX [T, k] in h's dtype, S [d, r] float32."""
    dx = jnp.einsum("td,kd->tk", h, kernel.astype(h.dtype), preferred_element_type=jnp.float32)
    return dx.astype(h.dtype), jnp.einsum("td,tr->dr", h, p, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernels.


def _forward_kernel(x_ref, k_ref, a_ref, y_ref, p_ref, y_acc, p_acc, *, bk: int, k: int):
    """Grid (T blocks ti, d blocks di, k blocks ki); ki is the reduction. P's block ti stays resident."""
    di, ki = pl.program_id(1), pl.program_id(2)
    last_k = ki == pl.num_programs(2) - 1
    x = zero_outside(x_ref[...], 1, ki, bk, k)
    kernel = zero_outside(k_ref[...].astype(x.dtype), 0, ki, bk, k)

    @pl.when(ki == 0)
    def _():
        y_acc[...] = jnp.zeros_like(y_acc)

    y_acc[...] += jnp.dot(x, kernel, preferred_element_type=jnp.float32)

    @pl.when(last_k)
    def _():
        y_ref[...] = y_acc[...].astype(y_ref.dtype)

    @pl.when(di == 0)
    def _():
        @pl.when(ki == 0)
        def _():
            p_acc[...] = jnp.zeros_like(p_acc)

        a = zero_outside(a_ref[...].astype(x.dtype), 1, ki, bk, k)
        p_acc[...] += jax.lax.dot_general(x, a, _NT, preferred_element_type=jnp.float32)

        @pl.when(last_k)
        def _():
            p_ref[...] = p_acc[...].astype(p_ref.dtype)


def _backward_kernel(h_ref, p_ref, k_ref, dx_ref, s_ref, dx_acc, *, bt: int, bd: int, t: int, d: int):
    """Grid (T blocks ti, k blocks ki, d blocks di): di reduces dX; (ti, di) at ki = 0 reduce S (resident)."""
    ti, ki, di = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h = zero_outside(h_ref[...], 1, di, bd, d)
    kernel = zero_outside(k_ref[...].astype(h.dtype), 1, di, bd, d)

    @pl.when(di == 0)
    def _():
        dx_acc[...] = jnp.zeros_like(dx_acc)

    dx_acc[...] += jax.lax.dot_general(h, kernel, _NT, preferred_element_type=jnp.float32)

    @pl.when(di == pl.num_programs(2) - 1)
    def _():
        dx_ref[...] = dx_acc[...].astype(dx_ref.dtype)

    @pl.when((ti == 0) & (ki == 0) & (di == 0))
    def _():
        s_ref[...] = jnp.zeros_like(s_ref)

    @pl.when(ki == 0)
    def _():
        h_rows = zero_outside(h, 0, ti, bt, t)
        p = zero_outside(p_ref[...], 0, ti, bt, t)
        rows = pl.ds(pl.multiple_of(di * bd, bd), bd)
        s_ref[rows, :] += jax.lax.dot_general(h_rows, p, _TN, preferred_element_type=jnp.float32)


def _itemsize(x: jax.Array) -> int:
    return jnp.dtype(x.dtype).itemsize


def _check_tpu_kernel(where: str, interpret: bool) -> None:
    if pallas_target(where, interpret) != "tpu":
        raise NotImplementedError(f"{where} is the TPU kernel; on GPUs use logra_jax.kernels.gpu.{where}_gpu, or "
                                  "sketched_linear(..., implementation='pallas'), which picks it")


# ----------------------------------------------------------------------------------------------------------------
# VMEM footprints and block choice. The TPU compiler keeps two buffers of every pipelined block (the next one is
# fetched while the current one is used), one of an output block whose index never changes (S), and the scratch:
# these formulas reproduce its report exactly (21.25 MiB for the backward at T 4096, d 18944, k 3584, r 256 bf16
# with blocks 256/512/512; experiments/kernels/aot/README.md).

DEFAULT_BLOCKS = (256, 512, 512)  # (block_t, block_d, block_k): the largest blocks tried first
_MIN_BLOCKS = (16, 128, 128)  # below these, tiles stop matching the TPU's (16, 128) bf16 / (8, 128) f32 layout


def forward_vmem_bytes(bt: int, bd: int, bk: int, r: int, x_bytes: int, k_bytes: int, a_bytes: int) -> int:
    """VMEM of `fused_forward` with blocks (bt, bd, bk): X, K, A, y and P blocks twice, y and P accumulators."""
    return 2 * (bt * bk * x_bytes + bk * bd * k_bytes + r * bk * a_bytes + (bt * bd + bt * r) * x_bytes) \
        + 4 * (bt * bd + bt * r)


def backward_vmem_bytes(bt: int, bd: int, bk: int, d: int, r: int, h_bytes: int, p_bytes: int,
                        k_bytes: int) -> int:
    """VMEM of `fused_backward`: H, P, K and dX blocks twice, the resident float32 S [d_pad, r], the dX scratch."""
    d_pad = num_blocks(d, bd) * bd
    return 2 * (bt * bd * h_bytes + bt * r * p_bytes + bk * bd * k_bytes + bt * bk * h_bytes) + d_pad * r * 4 \
        + 4 * bt * bk


def choose_blocks(vmem: Callable[[int, int, int], int], shape: tuple[int, int, int],
                  budget: int) -> tuple[int, int, int] | None:
    """The largest (block_t, block_d, block_k) whose footprint `vmem(bt, bd, bk)` fits `budget` bytes, or None.

    Starts from `DEFAULT_BLOCKS` (each clipped to its axis of `shape` = (T, d, k)) and halves block_k, then
    block_d, then block_t, down to (16, 128, 128); None when even those do not fit (e.g. S alone is larger).

    Example:
      >>> vmem = lambda bt, bd, bk: bt * bd * bk
      >>> choose_blocks(vmem, (4096, 4096, 4096), 256 * 256 * 256)  # block_k halved twice: 256·512·128
      (256, 512, 128)
    """
    blocks = [fit_block(size, block) for size, block in zip(shape, DEFAULT_BLOCKS)]
    while vmem(*blocks) > budget:
        for axis in (2, 1, 0):
            if blocks[axis] // 2 >= _MIN_BLOCKS[axis]:
                blocks[axis] //= 2
                break
        else:
            return None
    return blocks[0], blocks[1], blocks[2]


_UNLISTED_TPU_VMEM = 64 << 20  # planned for on a TPU missing from backend.TPU_VMEM_BYTES: the least of v5e/v5p/v6e


def vmem_budget(target: KernelTarget) -> int:
    """Bytes of VMEM the kernels plan for on `target`: 7/8 of the chip's, the rest left to Mosaic's own scratch."""
    return (target.vmem_bytes or _UNLISTED_TPU_VMEM) * 7 // 8


def _blocks_or_chosen(where: str, given: tuple[int | None, int | None, int | None],
                      vmem: Callable[[int, int, int], int], shape: tuple[int, int, int],
                      target: KernelTarget) -> tuple[int, int, int]:
    """Blocks the caller gave (clipped to the axes), or those `choose_blocks` picks for the target's VMEM.

    Raises:
      ValueError: no blocks fit (naming `where`, the shapes, the smallest footprint and the chip's budget): the
        caller asked for the Pallas kernel, so it is never swapped for XLA behind its back.
    """
    if any(block is not None for block in given):
        return tuple(fit_block(size, block_or(block, default))  # type: ignore[return-value]
                     for size, block, default in zip(shape, given, DEFAULT_BLOCKS))
    budget = vmem_budget(target)
    blocks = choose_blocks(vmem, shape, budget)
    if blocks is None:
        smallest = tuple(fit_block(size, block) for size, block in zip(shape, _MIN_BLOCKS))
        chip = target.device_kind or target.platform
        raise ValueError(
            f"{where}: no blocks fit the VMEM of {chip} for (T, d, k) = {shape}: even blocks {smallest} need "
            f"{vmem(*smallest) / 2**20:.2f} MiB, {budget / 2**20:.2f} MiB are available (backward: S [d, r] float32 "
            "stays resident). Use implementation='xla' for this model, or a smaller rank.")
    return blocks


def fused_forward(x: jax.Array, kernel: jax.Array, a: jax.Array, *, interpret: bool = False,
                  block_t: int | None = None, block_d: int | None = None,
                  block_k: int | None = None, target: KernelTarget | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas: (y, P) = (X K, X Aᵀ) in one sweep, X tiles read once for both products.

    Args:
      x: X [T, k] (compute dtype).
      kernel: K [k, d], cast to x's dtype block by block.
      a: A [r, k], cast to x's dtype block by block.
      interpret: run the kernel in the Pallas interpreter (required on CPU).
      block_t, block_d, block_k: block sizes along T, d and k (clipped to the array; TPU wants multiples of
        (8 or 16, 128) for sublane/lane axes unless a block spans the whole axis). None (all three): chosen by
        `choose_blocks` for the VMEM of the chip compiled for.
      target: the chip compiled for (default `backend.current_target()`).

    Returns:
      y [T, d] and P [T, r], both in x's dtype (float32 accumulation).

    Raises:
      ValueError: blocks left to the choice and none fit the chip's VMEM (the XLA reference is never used instead).

    Example:
      >>> import jax.numpy as jnp
      >>> y, p = fused_forward(jnp.ones((4, 8)), jnp.ones((8, 3)), jnp.ones((2, 8)), interpret=True)
      >>> y.shape, p.shape
      ((4, 3), (4, 2))
    """
    _check_tpu_kernel("fused_forward", interpret)
    (t, k), (_, d), (r, _) = x.shape, kernel.shape, a.shape
    target = current_target() if target is None else target
    vmem = functools.partial(forward_vmem_bytes, r=r, x_bytes=_itemsize(x), k_bytes=_itemsize(kernel),
                             a_bytes=_itemsize(a))
    blocks = _blocks_or_chosen("fused_forward", (block_t, block_d, block_k), vmem, (t, d, k), target)
    return _fused_forward(x, kernel, a, interpret=interpret, blocks=blocks, vmem_bytes=vmem(*blocks), target=target)


@functools.partial(jax.jit, static_argnames=("interpret", "blocks", "vmem_bytes", "target"))
def _fused_forward(x, kernel, a, *, interpret, blocks, vmem_bytes, target):
    (t, k), (_, d), (r, _) = x.shape, kernel.shape, a.shape
    bt, bd, bk = blocks
    return pl.pallas_call(
        functools.partial(_forward_kernel, bk=bk, k=k),
        out_shape=(jax.ShapeDtypeStruct((t, d), x.dtype), jax.ShapeDtypeStruct((t, r), x.dtype)),
        grid=(num_blocks(t, bt), num_blocks(d, bd), num_blocks(k, bk)),
        in_specs=[
            pl.BlockSpec((bt, bk), lambda ti, di, ki: (ti, ki)),
            pl.BlockSpec((bk, bd), lambda ti, di, ki: (ki, di)),
            pl.BlockSpec((r, bk), lambda ti, di, ki: (0, ki)),
        ],
        out_specs=[
            pl.BlockSpec((bt, bd), lambda ti, di, ki: (ti, di)),
            pl.BlockSpec((bt, r), lambda ti, di, ki: (ti, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((bt, bd), jnp.float32), pltpu.VMEM((bt, r), jnp.float32)],
        compiler_params=compiler_params(("parallel", "arbitrary", "arbitrary"), vmem_bytes, target),
        interpret=interpret,
        name="logra_fused_forward",
        cost_estimate=cost_estimate(2 * t * k * (d + r), x, kernel, a, jax.ShapeDtypeStruct((t, d), x.dtype),
                                    jax.ShapeDtypeStruct((t, r), x.dtype)),
    )(x, kernel, a)


def fused_backward(h: jax.Array, p: jax.Array, kernel: jax.Array, *, interpret: bool = False,
                   block_t: int | None = None, block_d: int | None = None,
                   block_k: int | None = None, target: KernelTarget | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas: (dX, S) = (H Kᵀ, Hᵀ P) in one sweep, H tiles read once for both products.

    S [d, r] stays resident in VMEM (float32, d rounded up to a multiple of block_d) for the whole sweep, so the
    kernel's grid runs in order; its VMEM footprint grows with d·r (18.5 MiB at d = 18944, r = 256: above the
    16 MiB a TPU kernel gets by default, so a larger limit is requested, up to the chip's VMEM).

    Args:
      h: H = ∂L/∂y [T, d] (compute dtype).
      p: P = X Aᵀ [T, r] (the forward residual).
      kernel: K [k, d], cast to h's dtype block by block.
      interpret: run the kernel in the Pallas interpreter (required on CPU).
      block_t, block_d, block_k: block sizes along T, d and k (clipped to the array). None (all three): chosen
        by `choose_blocks` for the VMEM of the chip compiled for.
      target: the chip compiled for (default `backend.current_target()`).

    Returns:
      dX [T, k] in h's dtype and S [d, r] float32.

    Raises:
      ValueError: blocks left to the choice and S with the smallest blocks does not fit the chip's VMEM (TPU v4's
        16 MiB at d·r ≥ 4 Mi): use implementation='xla' there (the XLA reference is never used instead).

    Example:
      >>> import jax.numpy as jnp
      >>> dx, s = fused_backward(jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.ones((8, 3)), interpret=True)
      >>> dx.shape, s.shape
      ((4, 8), (3, 2))
    """
    _check_tpu_kernel("fused_backward", interpret)
    (t, d), (_, r), (k, _) = h.shape, p.shape, kernel.shape
    target = current_target() if target is None else target
    vmem = functools.partial(backward_vmem_bytes, d=d, r=r, h_bytes=_itemsize(h), p_bytes=_itemsize(p),
                             k_bytes=_itemsize(kernel))
    blocks = _blocks_or_chosen("fused_backward", (block_t, block_d, block_k), vmem, (t, d, k), target)
    return _fused_backward(h, p, kernel, interpret=interpret, blocks=blocks, vmem_bytes=vmem(*blocks),
                           target=target)


@functools.partial(jax.jit, static_argnames=("interpret", "blocks", "vmem_bytes", "target"))
def _fused_backward(h, p, kernel, *, interpret, blocks, vmem_bytes, target):
    (t, d), (_, r), (k, _) = h.shape, p.shape, kernel.shape
    bt, bd, bk = blocks
    d_pad = num_blocks(d, bd) * bd
    dx, s = pl.pallas_call(
        functools.partial(_backward_kernel, bt=bt, bd=bd, t=t, d=d),
        out_shape=(jax.ShapeDtypeStruct((t, k), h.dtype), jax.ShapeDtypeStruct((d_pad, r), jnp.float32)),
        grid=(num_blocks(t, bt), num_blocks(k, bk), num_blocks(d, bd)),
        in_specs=[
            pl.BlockSpec((bt, bd), lambda ti, ki, di: (ti, di)),
            pl.BlockSpec((bt, r), lambda ti, ki, di: (ti, 0)),
            pl.BlockSpec((bk, bd), lambda ti, ki, di: (ki, di)),
        ],
        out_specs=[
            pl.BlockSpec((bt, bk), lambda ti, ki, di: (ti, ki)),
            pl.BlockSpec((d_pad, r), lambda ti, ki, di: (0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((bt, bk), jnp.float32)],
        compiler_params=compiler_params(("arbitrary", "arbitrary", "arbitrary"), vmem_bytes, target),
        interpret=interpret,
        name="logra_fused_backward",
        cost_estimate=cost_estimate(2 * t * d * (k + r), h, p, kernel, jax.ShapeDtypeStruct((t, k), h.dtype),
                                    jax.ShapeDtypeStruct((d, r), jnp.float32)),
    )(h, p, kernel)
    return dx, s[:d]


@dataclasses.dataclass(frozen=True)
class _PallasConfig:
    """Static (hashable) configuration of the Pallas path, passed to the custom_vjp as a non-differentiable arg."""

    interpret: bool
    block_t: int | None
    block_d: int | None
    block_k: int | None
    target: str  # "tpu" (also interpreted) or "gpu"
    chip: KernelTarget  # the chip compiled for: the TPU kernels' blocks and VMEM limit follow it
    mesh: jax.sharding.Mesh | None = None  # inside a sharded step: the kernels run per device over token shards

    def forward(self, x, kernel, a):
        def run(x, kernel, a):
            if self.target == "gpu":
                return gpu.fused_forward_gpu(x, kernel, a, interpret=self.interpret, **self._blocks(64))
            return fused_forward(x, kernel, a, interpret=self.interpret, target=self.chip, **self._blocks(None))

        mesh = self._mesh(x)
        tokens, whole = split(mesh, 2, 0), PartitionSpec()
        return per_device(run, mesh, (tokens, whole, whole), (tokens, tokens))(x, kernel, a)

    def backward(self, h, p, kernel):
        mesh = self._mesh(h)

        def run(h, p, kernel):
            if self.target == "gpu":
                dx, s = gpu.fused_backward_gpu(h, p, kernel, interpret=self.interpret, **self._blocks(64))
            else:
                dx, s = fused_backward(h, p, kernel, interpret=self.interpret, target=self.chip,
                                       **self._blocks(None))
            return dx, s if mesh is None else jax.lax.psum(s, tuple(mesh.axis_names))  # S sums over all tokens

        tokens, whole = split(mesh, 2, 0), PartitionSpec()
        return per_device(run, mesh, (tokens, tokens, whole), (tokens, whole))(h, p, kernel)

    def _mesh(self, rows: jax.Array) -> jax.sharding.Mesh | None:
        """The mesh to run per device on: when there is one of > 1 device and the token rows split evenly (else
        the kernels run on whole arrays, which a warning says once)."""
        if self.mesh is None or self.mesh.size == 1:
            return None
        if rows.shape[0] % self.mesh.size:
            warn_once(f"sketched_linear: implementation='pallas' in a step sharded over {self.mesh.size} devices "
                      f"runs the kernels per device on token rows, but {rows.shape[0]} rows do not divide: they "
                      "run on the whole (gathered) arrays")
            return None
        return self.mesh

    def _blocks(self, default: int | None) -> dict:
        """The given blocks; unset ones are `default` on GPU and left to the TPU kernels' choice (None)."""
        names = ("block_t", "block_d", "block_k")
        return {name: getattr(self, name) if default is None else block_or(getattr(self, name), default)
                for name in names}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sketched_linear_pallas(x, kernel, a, probe, config: _PallasConfig):
    del a, probe, config
    return _linear(x, kernel)


def _pallas_fwd(x, kernel, a, probe, config: _PallasConfig):
    y, p = config.forward(x.reshape(-1, x.shape[-1]), kernel, a)
    return y.reshape(*x.shape[:-1], y.shape[-1]), (p, kernel, a, probe)


def _pallas_bwd(config: _PallasConfig, res, h):
    p, kernel, a, probe = res
    dx, s = config.backward(h.reshape(-1, h.shape[-1]), p, kernel)
    dx = dx.reshape(*h.shape[:-1], dx.shape[-1])
    return dx, jnp.zeros_like(kernel), jnp.zeros_like(a), s.astype(probe.dtype)


_sketched_linear_pallas.defvjp(_pallas_fwd, _pallas_bwd)


def sketched_linear(x: jax.Array, kernel: jax.Array, a: jax.Array, probe: jax.Array, *,
                    implementation: str = "xla", interpret: bool = False, block_t: int | None = None,
                    block_d: int | None = None, block_k: int | None = None) -> jax.Array:
    """y = x · kernel, with ∂L/∂probe = Hᵀ (X Aᵀ) = G Aᵀ and no dense weight gradient.

    Args:
      x: inputs [..., k] (compute dtype).
      kernel: weight in Flax layout [k, d]; cast to x's dtype. Its cotangent is zero (it is not trained densely).
      a: projection A [r, k].
      probe: zeros [d, r] float32; its cotangent is the sketch S [d, r] summed over all leading axes of x.
      implementation: "xla" (einsums) or "pallas" (the fused kernels `fused_forward` / `fused_backward`).
      interpret: Pallas only: run the kernels in the Pallas interpreter (required on CPU).
      block_t, block_d, block_k: Pallas only: block sizes along tokens, output and input features (None: on
        TPU chosen for the chip's VMEM, at most 256, 512, 512; 64 each on GPU, where they must be powers of 2 ≥ 16).

    Returns:
      y [..., d] in x's dtype.

    Raises:
      ValueError: unknown implementation, non-positive block sizes, shapes that do not chain
        (x [..., k], kernel [k, d], a [r, k], probe [d, r]), compiled Pallas on CPU, or (TPU, when traced) no
        blocks of `fused_forward` / `fused_backward` that fit the chip's VMEM.
      NotImplementedError: compiled Pallas on a platform with no kernels (see logra_jax.kernels.backend).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x, k = jnp.ones((4, 8)), jnp.ones((8, 3))
      >>> a = jnp.ones((2, 8))
      >>> s = jax.grad(lambda p: sketched_linear(x, k, a, p).sum())(jnp.zeros((3, 2)))
      >>> s.shape
      (3, 2)
    """
    check_implementation(implementation, "sketched_linear")
    if kernel.ndim != 2 or a.ndim != 2 or probe.ndim != 2 or x.ndim < 1:
        raise ValueError(f"sketched_linear: expected x [..., k], kernel [k, d], a [r, k], probe [d, r]; got shapes "
                         f"x {x.shape}, kernel {kernel.shape}, a {a.shape}, probe {probe.shape}")
    (k, d), (r, ka) = kernel.shape, a.shape
    if x.shape[-1] != k or ka != k or probe.shape != (d, r):
        raise ValueError(f"sketched_linear: shapes do not chain (x [..., k], kernel [k, d], a [r, k], probe [d, r]): "
                         f"x {x.shape}, kernel {kernel.shape}, a {a.shape}, probe {probe.shape}")
    if implementation == "xla":
        return _sketched_linear_xla(x, kernel, a, probe)
    target = pallas_target("sketched_linear", interpret)
    blocks = {name: None if value is None else check_block(name, value, "sketched_linear")
              for name, value in (("block_t", block_t), ("block_d", block_d), ("block_k", block_k))}
    config = _PallasConfig(bool(interpret), target=target, chip=current_target(), mesh=current_mesh(), **blocks)
    return _sketched_linear_pallas(x, kernel, a, probe, config)
