"""The sketched linear layer: y = x·K whose weight cotangent is replaced by the LoGRA sketch.

LoGRA notation: W [d, k] = Kᵀ (K is the Flax kernel [k, d]); X [T, k]; H = ∂L/∂y [T, d]; A [r, k].
Forward keeps P = X Aᵀ [T, r] as the residual (never X for the weight's sake); backward returns
  ∂L/∂x = H Kᵀ,   ∂L/∂probe = Hᵀ P = (Hᵀ X) Aᵀ = G Aᵀ = S   [d, r] (float32),
and zero cotangents for K and A: the dense gradient G = Hᵀ X is never formed. `probe` is a zero [d, r] input
whose only purpose is to receive S: `jax.grad` with respect to the probes yields the sketches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _project(x: jax.Array, a: jax.Array) -> jax.Array:
    """P = X Aᵀ: [..., k] x [r, k] → [..., r], accumulated in float32 and kept in x's dtype."""
    return jnp.einsum("...k,rk->...r", x, a.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


@jax.custom_vjp
def sketched_linear(x: jax.Array, kernel: jax.Array, a: jax.Array, probe: jax.Array) -> jax.Array:
    """y = x · kernel, with ∂L/∂probe = Hᵀ (X Aᵀ) = G Aᵀ and no dense weight gradient.

    Args:
      x: inputs [..., k] (compute dtype).
      kernel: weight in Flax layout [k, d]; cast to x's dtype. Its cotangent is zero (it is not trained densely).
      a: projection A [r, k].
      probe: zeros [d, r] float32; its cotangent is the sketch S [d, r] summed over all leading axes of x.

    Returns:
      y [..., d] in x's dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x, k = jnp.ones((4, 8)), jnp.ones((8, 3))
      >>> a = jnp.ones((2, 8))
      >>> s = jax.grad(lambda p: sketched_linear(x, k, a, p).sum())(jnp.zeros((3, 2)))
      >>> s.shape
      (3, 2)
    """
    del a, probe
    return jnp.einsum("...k,kd->...d", x, kernel.astype(x.dtype))


def _fwd(x, kernel, a, probe):
    y = jnp.einsum("...k,kd->...d", x, kernel.astype(x.dtype))
    return y, (_project(x, a), kernel, a, probe)


def _bwd(res, h):
    p, kernel, a, probe = res
    dx = jnp.einsum("...d,kd->...k", h, kernel.astype(h.dtype))
    s = jnp.einsum("...d,...r->dr", h, p, preferred_element_type=jnp.float32)
    return dx, jnp.zeros_like(kernel), jnp.zeros_like(a), s.astype(probe.dtype)


sketched_linear.defvjp(_fwd, _bwd)
