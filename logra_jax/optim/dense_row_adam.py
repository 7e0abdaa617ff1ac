"""scale_by_dense_row_adam: LoGRA's preconditioner and step-size rule on the full gradient, no sketch (an ablation).

Per target layer with dense gradient G [d, k] (rows = output features), row moment v [d] and t = updates + 1:
  v ← β₂ v + (1 − β₂) · mean_j G_ij²;  D = RowAdam(G)  (exactly `row_adam_direction` with S replaced by G)
  factor = ratio · sqrt(Σ_l ‖W_l‖²_F / Σ_l ‖D_l‖²_F),  D_l ← factor · D_l
It is LoGRA with the projection A = I_k (S = G Iᵀ): what remains when the sketch is taken away, so a comparison
of the two measures what sketching costs, and one of this against AdamW on the same weights what the row-wise
preconditioner and the norm-relative step size cost. Dense gradient and [d] moments per target; no first moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from logra_jax.core.tree_paths import path_str
from logra_jax.optim.row_adam import VARIANTS, Variant, row_adam_direction
from logra_jax.optim.targets import (
    DEFAULT_TARGET_RULES,
    DeclaredTargets,
    MatrixDims,
    Target,
    TargetRule,
    check_rules,
    find_targets,
    place_replicated,
    zero_row_moments,
)
from logra_jax.optim.update_ratio import ratio_factor


class DenseRowAdamState(NamedTuple):
    """count: completed updates; row_moment: {target path: v (*batch_shape, *rows_shape) float32}, placed like
    the weight rows (`zero_row_moments`) when init gets concretely sharded parameters; targets: the rules that key the
    moments (static, no leaves), so that shardings follow the targets' declared dims."""

    count: jax.Array
    row_moment: dict[str, jax.Array]
    targets: DeclaredTargets


def _rows_first(g: jax.Array, t: Target) -> jax.Array:
    """Kernel [...] → [num_slices, d, k] (batch axes, then row axes, then width axes)."""
    order = (*t.batch_axes, *t.dims.rows, *t.dims.width)
    return jnp.moveaxis(g, order, tuple(range(len(order)))).reshape(t.num_slices, t.d, t.k)


def _from_rows_first(x: jax.Array, t: Target) -> jax.Array:
    """Inverse of `_rows_first`."""
    order = (*t.batch_axes, *t.dims.rows, *t.dims.width)
    x = x.reshape(*t.batch_shape, *t.rows_shape, *t.width_shape)
    return jnp.moveaxis(x, tuple(range(len(order))), order)


# row_adam_direction reads only the number of batch and row axes of its target: [num_slices, d, k].
_SLICES_ROWS_WIDTH = Target(path="", keys=(), shape=(1, 1, 1), dims=MatrixDims(rows=(1,), width=(2,)),
                            batch_axes=(0,))


def scale_by_dense_row_adam(update_ratio: float = 6e-5, variant: Variant = "paper", b2: float = 0.95,
                            eps: float = 1e-8, rules: Sequence[TargetRule] = DEFAULT_TARGET_RULES
                            ) -> optax.GradientTransformation:
    """RowAdam + the global update ratio on the dense gradients of the targets (module docstring); non-target
    leaves pass through unchanged (route them elsewhere with optax.partition). The result is the step's
    direction scaled to norm `update_ratio` relative to the targets' weights: follow it with a negation.

    Args:
      update_ratio: ‖ΔW‖ / ‖W‖ over all targets together.
      variant: "paper" or "sgd" (see scale_by_row_adam; "nemo" has no norm-relative step).
      b2, eps: RowAdam's β₂ and relative ε.
      rules: the TargetRule sequence choosing the targets.

    Raises:
      ValueError: a hyperparameter out of range (named); at init, no target in the params; at update,
        no params.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> tx = scale_by_dense_row_adam(update_ratio=1e-2)
      >>> upd, _ = tx.update({"q_proj": {"kernel": jnp.ones((8, 4))}}, tx.init(params), params)
      >>> round(float(jnp.linalg.norm(upd["q_proj"]["kernel"]) / jnp.linalg.norm(params["q_proj"]["kernel"])), 4)
      0.01
    """
    if not (isinstance(update_ratio, int | float) and update_ratio > 0):
        raise ValueError(f"scale_by_dense_row_adam: update_ratio must be > 0, got {update_ratio!r}")
    if variant not in VARIANTS or variant == "nemo":
        raise ValueError(f"scale_by_dense_row_adam: variant must be 'paper' or 'sgd', got {variant!r}")
    if not 0 <= b2 < 1:
        raise ValueError(f"scale_by_dense_row_adam: b2 must be in [0, 1), got {b2!r}")
    if not eps >= 0:
        raise ValueError(f"scale_by_dense_row_adam: eps must be >= 0, got {eps!r}")
    rules = check_rules(rules)

    def init(params: Any) -> DenseRowAdamState:
        moments = zero_row_moments(params, find_targets(params, rules))
        return DenseRowAdamState(place_replicated(jnp.zeros((), jnp.int32), params), moments, DeclaredTargets(rules))

    def update(updates: Any, state: DenseRowAdamState, params: Any = None) -> tuple[Any, DenseRowAdamState]:
        if params is None:
            raise ValueError("scale_by_dense_row_adam: update needs params (the step is relative to ‖W‖)")
        targets = find_targets(params, rules)
        flat_u = dict(jax.tree_util.tree_leaves_with_path(updates))
        flat_w = dict(jax.tree_util.tree_leaves_with_path(params))
        by_path = {path_str(k): k for k in flat_u}
        directions, moments = {}, {}
        weight_sq = update_sq = jnp.zeros((), jnp.float32)
        for path, t in targets.items():
            key = by_path[path]
            g = _rows_first(flat_u[key].astype(jnp.float32), t)
            v = state.row_moment[path]
            d, v_new = row_adam_direction(g, v.reshape(t.num_slices, t.d), state.count, _SLICES_ROWS_WIDTH,
                                          variant, b2, eps)
            moments[path] = v_new.reshape(v.shape)
            directions[key] = (d, t)
            weight_sq += jnp.sum(jnp.square(flat_w[key].astype(jnp.float32)))
            update_sq += jnp.sum(jnp.square(d))
        factor = ratio_factor(update_ratio, weight_sq, update_sq)

        def one(keypath: Any, u: Any) -> Any:
            if keypath not in directions:
                return u
            d, t = directions[keypath]
            return _from_rows_first(factor * d, t).astype(u.dtype)

        new = jax.tree_util.tree_map_with_path(one, updates)
        return new, DenseRowAdamState(state.count + 1, moments, state.targets)

    return optax.GradientTransformation(init, update)
