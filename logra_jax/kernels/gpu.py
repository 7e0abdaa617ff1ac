"""LoGRA's three kernels for NVIDIA GPUs: Pallas lowered through Triton, written for how GPUs run a grid.

Why Triton-via-Pallas (`pl.pallas_call` with `jax.experimental.pallas.triton.CompilerParams`), for all three:
- These passes are memory-bound (merge, row moment) or skinny matmuls whose cost is reading X, H and K once
  (r = 256 ≪ k, d): what matters is a K loop with masked, coalesced tiles, which Triton schedules and pipelines
  (`num_stages`) on Ampere and Hopper alike; Mosaic GPU (`plgpu` wgmma on swizzled shared-memory tiles) is
  Hopper-only and pays off for compute-bound tiles, which these are not.
- The jax on accelerator machines may be newer than our pin: the Triton backend of `pallas_call` ships in
  jax 0.10.x and, deprecated but present, in 0.11.x (`experiments/device/check.sh` lowers and runs every kernel
  under whatever jax the machine has; `experiments/kernels/lower_newest.sh` lowers them under the newest jax a
  registry offers).

How they differ from the TPU kernels (merge.py, row_moment.py, project.py):
- GPU grids run their programs in parallel and in no order, so no output block is revisited along a sequential
  grid axis: every reduction is a K loop inside one program (`lax.fori_loop`), and S = Hᵀ P, a reduction over
  tokens, is a second pass split over token chunks whose float32 partials are summed afterwards.
- Triton tensors must have power-of-2 sizes: tiles are power-of-2 blocks, every load and store is masked at the
  array's edge (`plgpu.load(..., mask=, other=0)`), and the rank axis is padded to a power of 2 (≥ 16, the
  smallest tensor-core tile) with zeros, which leave every product unchanged.
- Arrays are whole refs indexed by program id (no BlockSpecs), as in jax's own Triton ops.
- float32 operands are multiplied at full precision (3-pass TF32 on the GPU, ≈ fp32; exact float32 in the
  interpreter); bfloat16 operands on bf16 tensor cores; every accumulation is float32.

Each public function takes `interpret=True` to run in the Pallas interpreter (how CPU tests check them against
the jnp references); `merge`, `row_moment` and `sketched_linear` call them when `implementation="pallas"` runs
compiled on a GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Triton-via-Pallas: in jax 0.10.x, and deprecated but present in 0.11.x
    from jax.experimental.pallas import triton as plgpu
except ImportError as _err:  # a jax without it: the TPU and XLA paths still work; these kernels say why not
    plgpu = None
    _TRITON_MISSING = f"this jax ({jax.__version__}) has no Pallas Triton backend: {_err}"

from logra_jax.kernels.backend import round_factor

_NT = (((1,), (1,)), ((), ()))  # a · bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ · b
_MIN_DOT = 16  # smallest tensor-core tile side Triton accepts for tl.dot


def next_pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of 2 that is ≥ max(n, at_least)."""
    return max(at_least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def check_pow2_block(name: str, value: int, where: str) -> int:
    """`value` if it is a power of 2 ≥ 16 (Triton tensor sides); raises ValueError naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < _MIN_DOT or value & (value - 1):
        raise ValueError(f"{where}: {name} must be a power of 2 >= {_MIN_DOT} on GPU, got {value!r}")
    return value


def _params(num_warps: int, num_stages: int, interpret: bool):
    if plgpu is None:
        raise NotImplementedError(_TRITON_MISSING)
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# How float32 operands are multiplied on the GPU: 3-pass TF32 or 3-pass bf16 (both ≈ float32, ~1e-6 relative)
# instead of plain TF32 (~1e-3), Triton's default for a float32 dot; "bf16" casts both operands to bf16 (exact for
# the merge when round_bf16 and A is Rademacher ±1/√r with r a power of 4, e.g. 256); "tf32" is one TF32 pass
# (XLA's default for float32 on GPUs; also exact for that merge).
FP32_DOTS: tuple[str, ...] = ("tf32x3", "bf16x3", "bf16", "tf32")
_PRESETS = {"tf32x3": "TF32_TF32_F32_X3", "bf16x3": "BF16_BF16_F32_X3", "tf32": "TF32_TF32_F32"}


def _dot(a: jax.Array, b: jax.Array, dims, interpret: bool, fp32_dot: str = "tf32x3") -> jax.Array:
    """float32-accumulated a·b with `dims` (one contracting axis each); ≈ full precision for float32 operands."""
    precision = None
    if a.dtype == jnp.float32 and fp32_dot == "bf16":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    elif a.dtype == jnp.float32:
        # The interpreter runs on CPU, where only the exact float32 product exists.
        precision = (jax.lax.Precision.HIGHEST if interpret
                     else getattr(jax.lax.DotAlgorithmPreset, _PRESETS[fp32_dot]))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _iota(n: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _tile(ref, rows: jax.Array, cols: jax.Array, n_rows: int, n_cols: int) -> jax.Array:
    """ref[rows, cols] as a [len(rows), len(cols)] tile, zero outside the [n_rows, n_cols] array."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)


def _put(ref, rows: jax.Array, cols: jax.Array, n_rows: int, n_cols: int, value: jax.Array) -> None:
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    plgpu.store(ref.at[rows[:, None], cols[None, :]], value.astype(ref.dtype), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# merge: K ← K + Aᵀ round(U)ᵀ, one [bk, bd] tile of K per program, in place (K aliased in → out).


def _merge_kernel(k_ref, u_ref, at_ref, o_ref, *, shape, rp, br, bk, bd, round_bf16, interpret, fp32_dot):
    (k, d) = shape
    rows = pl.program_id(0) * bk + _iota(bk)
    cols = pl.program_id(1) * bd + _iota(bd)

    def body(i, acc):  # the rank in chunks of br: tiles stay small whatever r is
        ranks = i * br + _iota(br)
        u = round_factor(_tile(u_ref, cols, ranks, d, rp), round_bf16)
        a_t = _tile(at_ref, rows, ranks, k, rp).astype(jnp.float32)
        return acc + _dot(a_t, u, _NT, interpret, fp32_dot)

    delta = jax.lax.fori_loop(0, rp // br, body, jnp.zeros((bk, bd), jnp.float32))
    _put(o_ref, rows, cols, k, d, _tile(k_ref, rows, cols, k, d).astype(jnp.float32) + delta)


@functools.partial(jax.jit, static_argnames=("round_bf16", "interpret", "block_d", "block_k", "num_warps",
                                              "num_stages", "fp32_dot"))
def merge_gpu(kernel: jax.Array, factor: jax.Array, a: jax.Array, *, round_bf16: bool = False,
              interpret: bool = False, block_d: int = 64, block_k: int = 64, num_warps: int = 4,
              num_stages: int = 1, fp32_dot: str = "tf32x3") -> jax.Array:
    """K [k, d] + Aᵀ [k, r] · round(U)ᵀ [r, d] for factor U [d, r], a A [r, k]; the result in K's dtype.

    Reads K once and writes it once (aliased: in place under donation); U and Aᵀ, zero-padded to a power-of-2
    rank, are re-read per tile (d·r + k·r floats, small next to K) in rank chunks of ≤ 64. Blocks: powers of
    2 ≥ 16. `fp32_dot`: one of FP32_DOTS (ignored by the interpreter, which multiplies in exact float32).
    """
    if fp32_dot not in FP32_DOTS:
        raise ValueError(f"merge: fp32_dot must be one of {FP32_DOTS}, got {fp32_dot!r}")
    (k, d), (_, r) = kernel.shape, factor.shape
    bk = check_pow2_block("block_k", block_k, "merge")
    bd = check_pow2_block("block_d", block_d, "merge")
    rp = next_pow2(r, _MIN_DOT)
    br = min(rp, 64)
    factor_p = jnp.pad(factor, ((0, 0), (0, rp - r)))
    a_t = jnp.pad(a.T, ((0, 0), (0, rp - r)))
    return pl.pallas_call(
        functools.partial(_merge_kernel, shape=(k, d), rp=rp, br=br, bk=bk, bd=bd, round_bf16=round_bf16,
                          interpret=interpret, fp32_dot=fp32_dot),
        out_shape=jax.ShapeDtypeStruct(kernel.shape, kernel.dtype),
        grid=(pl.cdiv(k, bk), pl.cdiv(d, bd)),
        input_output_aliases={0: 0},
        compiler_params=_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="logra_merge_gpu",
    )(kernel, factor_p, a_t)


# ----------------------------------------------------------------------------------------------------------------
# row moment: one block of rows of S per program (rows are independent; r fits one tile).


def _row_stats_kernel(s_ref, v_ref, hyper_ref, *out_refs, d, r, rp, bd, variant):
    rows = pl.program_id(0) * bd + _iota(bd)
    ranks = _iota(rp)
    row_ok = rows < d
    b2, bias_correction, eps = hyper_ref[0], hyper_ref[1], hyper_ref[2]
    s = _tile(s_ref, rows, ranks, d, r).astype(jnp.float32)
    rowsq = jnp.sum(s * s, axis=1)
    v = plgpu.load(v_ref.at[rows], mask=row_ok, other=0.0)
    v_new = b2 * v + (1.0 - b2) * (rowsq * (1.0 / r))
    rho = jnp.sqrt(v_new * bias_correction)
    if variant == "nemo":
        v_out, d_out = out_refs
        _put(d_out, rows, ranks, d, r, s / (rho + eps)[:, None])
    else:
        v_out, rho_out, rowsq_out = out_refs
        plgpu.store(rho_out.at[rows], rho, mask=row_ok)
        plgpu.store(rowsq_out.at[rows], rowsq, mask=row_ok)
    plgpu.store(v_out.at[rows], v_new, mask=row_ok)


def _row_scale_kernel(s_ref, c_ref, d_ref, *, d, r, rp, bd):
    rows = pl.program_id(0) * bd + _iota(bd)
    ranks = _iota(rp)
    c = plgpu.load(c_ref.at[rows], mask=rows < d, other=0.0)
    _put(d_ref, rows, ranks, d, r, _tile(s_ref, rows, ranks, d, r).astype(jnp.float32) * c[:, None])


def row_moment_gpu(s: jax.Array, v: jax.Array, hyper: jax.Array, *, variant: str, interpret: bool = False,
                   block_d: int | None = None, num_warps: int = 4, num_stages: int = 1):
    """RowAdam's row pass on S [d, r] (see row_moment.py): (v_new [d], D [d, r]) for "nemo", and for "paper"
    (v_new [d], ρ [d], Σ_j S_ij² [d]) whose O(d) global part the caller finishes (`_paper_row_scale`).

    `hyper` = [β₂, 1/(1 − β₂^t), ε, 0] float32 (traced: schedules cost no recompile). `block_d` rows per program
    (power of 2 ≥ 16; default: as many as keep a tile at 8192 elements).
    """
    d, r = s.shape
    rp = next_pow2(r)
    bd = check_pow2_block("block_d", block_d if block_d is not None else max(_MIN_DOT, 8192 // rp), "row_moment")
    vec = jax.ShapeDtypeStruct((d,), jnp.float32)
    out_shape = (vec, jax.ShapeDtypeStruct((d, r), jnp.float32)) if variant == "nemo" else (vec, vec, vec)
    return pl.pallas_call(
        functools.partial(_row_stats_kernel, d=d, r=r, rp=rp, bd=bd, variant=variant),
        out_shape=out_shape,
        grid=(pl.cdiv(d, bd),),
        compiler_params=_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="logra_row_moment_gpu",
    )(s, v.astype(jnp.float32), hyper)


def row_scale_gpu(s: jax.Array, c: jax.Array, *, interpret: bool = False, block_d: int | None = None,
                  num_warps: int = 4, num_stages: int = 1) -> jax.Array:
    """D = c[:, None] ⊙ S for S [d, r], c [d]; float32."""
    d, r = s.shape
    rp = next_pow2(r)
    bd = check_pow2_block("block_d", block_d if block_d is not None else max(_MIN_DOT, 8192 // rp), "row_moment")
    return pl.pallas_call(
        functools.partial(_row_scale_kernel, d=d, r=r, rp=rp, bd=bd),
        out_shape=jax.ShapeDtypeStruct((d, r), jnp.float32),
        grid=(pl.cdiv(d, bd),),
        compiler_params=_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="logra_row_scale_gpu",
    )(s, c)


# ----------------------------------------------------------------------------------------------------------------
# Sketched projection. Forward: y = X K and P = X Aᵀ in one launch; backward: dX = H Kᵀ, then S = Hᵀ P.


def _forward_kernel(x_ref, k_ref, a_ref, y_ref, p_ref, *, t, k, d, r, bt, bn, bk, n_y, interpret):
    # bn: tile width along d (and along r for the P tiles); bk: step of the loop over k
    """Grid (token blocks, n_y + n_p column blocks): columns < n_y are tiles of y, the rest tiles of P."""
    col = pl.program_id(1)
    rows = pl.program_id(0) * bt + _iota(bt)
    n_k = pl.cdiv(k, bk)

    def k_loop(load_rhs):
        def body(i, acc):
            ks = i * bk + _iota(bk)
            x = _tile(x_ref, rows, ks, t, k)
            return acc + _dot(x, load_rhs(ks).astype(x.dtype), (((1,), (0,)), ((), ())), interpret)
        return jax.lax.fori_loop(0, n_k, body, jnp.zeros((bt, bn), jnp.float32))

    @pl.when(col < n_y)
    def _():
        cols = col * bn + _iota(bn)
        _put(y_ref, rows, cols, t, d, k_loop(lambda ks: _tile(k_ref, ks, cols, k, d)))

    @pl.when(col >= n_y)
    def _():
        ranks = (col - n_y) * bn + _iota(bn)
        # A [r, k] read as Aᵀ tiles [bk, bn]
        _put(p_ref, rows, ranks, t, r, k_loop(lambda ks: _tile(a_ref, ranks, ks, r, k).T))


def fused_forward_gpu(x: jax.Array, kernel: jax.Array, a: jax.Array, *, interpret: bool = False,
                      block_t: int = 64, block_d: int = 64, block_k: int = 64, num_warps: int = 4,
                      num_stages: int = 3) -> tuple[jax.Array, jax.Array]:
    """(y, P) = (X K, X Aᵀ) for X [T, k], K [k, d], A [r, k], in x's dtype, float32 accumulation, one launch.

    Each program owns a [block_t, block_d] tile of y (or of P, block_d wide along r) and loops over k in steps
    of block_k; the P tiles are extra columns of the grid: they cost r/d of the y work and no second launch.
    """
    (t, k), (_, d), (r, _) = x.shape, kernel.shape, a.shape
    bt = check_pow2_block("block_t", block_t, "fused_forward")
    bn = check_pow2_block("block_d", block_d, "fused_forward")
    bk = check_pow2_block("block_k", block_k, "fused_forward")
    n_y, n_p = pl.cdiv(d, bn), pl.cdiv(r, bn)
    return pl.pallas_call(
        functools.partial(_forward_kernel, t=t, k=k, d=d, r=r, bt=bt, bn=bn, bk=bk, n_y=n_y, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((t, d), x.dtype), jax.ShapeDtypeStruct((t, r), x.dtype)),
        grid=(pl.cdiv(t, bt), n_y + n_p),
        compiler_params=_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="logra_fused_forward_gpu",
    )(x, kernel, a)


def _dx_kernel(h_ref, k_ref, dx_ref, *, t, k, d, bt, bk, bd, interpret):
    """Grid (token blocks, k blocks): dX tile [bt, bk] = Σ over d blocks of H tile · K tileᵀ."""
    rows = pl.program_id(0) * bt + _iota(bt)
    ks = pl.program_id(1) * bk + _iota(bk)

    def body(i, acc):
        ds = i * bd + _iota(bd)
        h = _tile(h_ref, rows, ds, t, d)
        return acc + _dot(h, _tile(k_ref, ks, ds, k, d).astype(h.dtype), _NT, interpret)

    _put(dx_ref, rows, ks, t, k, jax.lax.fori_loop(0, pl.cdiv(d, bd), body, jnp.zeros((bt, bk), jnp.float32)))


def _sketch_kernel(h_ref, p_ref, s_ref, *, t, d, r, rp, bt, bd, br, blocks_per_split, interpret):
    """Grid (d blocks, rank blocks, token splits): partial S [bd, br] = Σ over the split's token blocks of
    H tileᵀ · P tile."""
    ds = pl.program_id(0) * bd + _iota(bd)
    ranks = pl.program_id(1) * br + _iota(br)
    split = pl.program_id(2)

    def body(i, acc):
        rows = (split * blocks_per_split + i) * bt + _iota(bt)
        h = _tile(h_ref, rows, ds, t, d)
        return acc + _dot(h, _tile(p_ref, rows, ranks, t, r).astype(h.dtype), _TN, interpret)

    acc = jax.lax.fori_loop(0, blocks_per_split, body, jnp.zeros((bd, br), jnp.float32))
    out_rows = split * d + ds  # partials stored as [splits · d, rp]
    mask = (ds[:, None] < d) & (ranks[None, :] < rp)
    plgpu.store(s_ref.at[out_rows[:, None], ranks[None, :]], acc, mask=mask)


def fused_backward_gpu(h: jax.Array, p: jax.Array, kernel: jax.Array, *, interpret: bool = False,
                       block_t: int = 64, block_d: int = 64, block_k: int = 64, num_warps: int = 4,
                       num_stages: int = 3, target_programs: int = 264) -> tuple[jax.Array, jax.Array]:
    """(dX, S) = (H Kᵀ, Hᵀ P) for H [T, d], P [T, r], K [k, d]: dX [T, k] in h's dtype, S [d, r] float32.

    dX: programs own [block_t, block_k] tiles and loop over d in steps of block_d. S: a second launch over
    (d blocks of block_d, rank blocks of ≤ 128, token splits), each program summing its split's token blocks
    (block_t) into a float32 partial; the splits (enough programs to fill `target_programs`, twice an
    H100/H200's 132 SMs by default) are summed afterwards — deterministic, no atomics.
    """
    (t, d), (_, r), (k, _) = h.shape, p.shape, kernel.shape
    bt = check_pow2_block("block_t", block_t, "fused_backward")
    bd = check_pow2_block("block_d", block_d, "fused_backward")
    bk = check_pow2_block("block_k", block_k, "fused_backward")
    params = _params(num_warps, num_stages, interpret)
    dx = pl.pallas_call(
        functools.partial(_dx_kernel, t=t, k=k, d=d, bt=bt, bk=bk, bd=bd, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((t, k), h.dtype),
        grid=(pl.cdiv(t, bt), pl.cdiv(k, bk)),
        compiler_params=params,
        interpret=interpret,
        name="logra_fused_backward_dx_gpu",
    )(h, kernel)
    rp = next_pow2(r, _MIN_DOT)
    br = min(rp, 128)
    d_blocks, t_blocks = pl.cdiv(d, bd) * (rp // br), pl.cdiv(t, bt)
    splits = max(1, min(t_blocks, -(-target_programs // d_blocks)))
    blocks_per_split = -(-t_blocks // splits)
    splits = -(-t_blocks // blocks_per_split)  # no empty split
    partials = pl.pallas_call(
        functools.partial(_sketch_kernel, t=t, d=d, r=r, rp=rp, bt=bt, bd=bd, br=br,
                          blocks_per_split=blocks_per_split, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((splits * d, rp), jnp.float32),
        grid=(pl.cdiv(d, bd), rp // br, splits),
        compiler_params=params,
        interpret=interpret,
        name="logra_sketch_gpu",
    )(h, p)
    return dx, partials.reshape(splits, d, rp).sum(axis=0)[:, :r]
