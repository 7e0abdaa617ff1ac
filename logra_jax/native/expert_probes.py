"""Sketch-native mode for grouped expert kernels (`logra_jax.models.moe.ExpertLinear`): each expert's sketch is
formed from its own tokens only, with the forward's grouping, and no dense [E, k, d] gradient is ever formed.

An expert layer multiplies tokens sorted by expert, x [M, k] with group sizes [E], by its kernels K [E, k, d].
Expert e is its own target matrix W_e = K_eᵀ [d, k] with its own projection A_e [r, k] (seed path
"<kernel>.{l·E + e}", the dense mode's slice path). In the sketch kind, per expert:

    forward:  y = ragged_dot(x, K),   keeps  P = ragged_dot(x, Aᵀ)  [M, r]   (P_e = X_e A_eᵀ)
    backward: dx = ragged_dot(H, Kᵀ), S_e = H_eᵀ P_e  [d, r]  (a ragged-contracting ragged_dot_general)

so S_e = Σ_{rows m of e} h_m (x_m A_eᵀ)ᵀ = G_e A_eᵀ with G_e = H_eᵀ X_e, the expert's gradient over its tokens;
an expert with no token gets S_e = 0. In the tangent kind, y = ragged_dot(x, K) + ragged_dot(P, Pᵣᵀ) with the
zero-valued probe Pᵣ [E, d, r]: its JVP along U gives δy_m = (x_m A_eᵀ) U_eᵀ, the factored form of ΔW_e = U_e A_e
on each token's own expert (the predicted-KL probe's tangent).

XLA:CPU lowers ragged_dot and ragged_dot_general to dense masked products ([E, M, ·] work, fine at test sizes);
the TPU and GPU kernels do not (`logra_jax.models.moe`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

# S [E, d, r] of H [M, d] and P [M, r], both ragged on the rows M: out[e] = H_eᵀ P_e.
_RAGGED_CONTRACT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)


def ragged_outer(h: jax.Array, p: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """out[e] = h_eᵀ p_e [E, d, r] (float32) of rows h [M, d] and p [M, r] grouped by `group_sizes` [E].

    Example:
      >>> ragged_outer(jnp.ones((3, 2)), jnp.ones((3, 1)), jnp.array([1, 0, 2], jnp.int32))[:, 0, 0]
      Array([1., 0., 2.], dtype=float32)
    """
    return jax.lax.ragged_dot_general(h, p.astype(h.dtype), group_sizes, _RAGGED_CONTRACT,
                                      preferred_element_type=jnp.float32)


@jax.custom_vjp
def sketched_ragged_linear(x: jax.Array, kernel: jax.Array, a: jax.Array, probe: jax.Array,
                           group_sizes: jax.Array) -> jax.Array:
    """y = ragged_dot(x, kernel) whose backward sends S_e = H_eᵀ(X_e A_eᵀ) [E, d, r] to `probe` (module docstring);
    x [M, k] sorted by expert, kernel [E, k, d], a [E, r, k], probe [E, d, r], group_sizes [E]. The kernel and
    `a` get zero cotangents (None: no dense [E, k, d] zeros either)."""
    del a, probe
    return _ragged(x, kernel, group_sizes)


def _sketch_fwd(x, kernel, a, probe, group_sizes):
    p = _ragged(x, jnp.swapaxes(a, -1, -2), group_sizes)  # [M, r]
    return _ragged(x, kernel, group_sizes), (p, kernel, probe, group_sizes)


def _sketch_bwd(res, h):
    p, kernel, probe, group_sizes = res
    dx = _ragged(h, jnp.swapaxes(kernel, -1, -2), group_sizes)
    s = ragged_outer(h, p, group_sizes)
    return dx, None, None, s.astype(probe.dtype), None


sketched_ragged_linear.defvjp(_sketch_fwd, _sketch_bwd)


@jax.custom_jvp
def tangent_ragged_linear(x: jax.Array, kernel: jax.Array, a: jax.Array, probe: jax.Array,
                          group_sizes: jax.Array) -> jax.Array:
    """y = ragged_dot(x, K) + ragged_dot(X Aᵀ, probeᵀ) for a zero-valued probe: the primal is ragged_dot(x, K);
    the JVP forms only the products whose tangents are not symbolic zeros."""
    del a, probe
    return _ragged(x, kernel, group_sizes)


def _tangent_jvp(primals, tangents):
    x, kernel, a, probe, group_sizes = primals
    dx, dkernel, _, dprobe, _ = tangents
    y = tangent_ragged_linear(x, kernel, a, probe, group_sizes)
    terms = []
    if not isinstance(dx, SymbolicZero):
        terms.append(_ragged(dx.astype(x.dtype), kernel, group_sizes))
    if not isinstance(dkernel, SymbolicZero):
        terms.append(_ragged(x, dkernel, group_sizes))
    if not isinstance(dprobe, SymbolicZero):
        p = _ragged(x, jnp.swapaxes(a, -1, -2), group_sizes)
        terms.append(_ragged(p, jnp.swapaxes(dprobe, -1, -2), group_sizes))
    return y, sum(terms[1:], terms[0]) if terms else jnp.zeros_like(y)


tangent_ragged_linear.defjvp(_tangent_jvp, symbolic_zeros=True)
