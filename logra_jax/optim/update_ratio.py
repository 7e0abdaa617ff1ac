"""scale_by_update_ratio: the global, weight-norm-relative LoGRA step size (docs/method.md §4).

  factor = ratio · sqrt(Σ_l ‖W_l‖²_F / Σ_l ‖D_l A_l‖²_F),   D_l ← factor · D_l
The sums run over the layers l of all targets that carry a low-rank update (every batch slice of every target
weight): non-target parameters (embeddings, norms, lm head, biases) are not in Σ‖W‖². ‖D A‖²_F = ⟨D (A Aᵀ), D⟩
uses the r×r Gram matrix of each projection, never D·A. With Σ‖D A‖² = 0 the factor is 0 (nothing to step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.lowrank import LowRankUpdate, is_lowrank, to_slices

_HIGHEST = jax.lax.Precision.HIGHEST
SCOPES: tuple[str, ...] = ("global", "layer")


def _lowrank_pairs(updates: Any, params: Any) -> list[tuple[LowRankUpdate, Any]]:
    """(LowRankUpdate, its weight) for every low-rank leaf of `updates`; ValueError when there is none."""
    pairs = []

    def collect(u: Any, w: Any) -> None:
        if isinstance(u, LowRankUpdate):
            pairs.append((u, w))

    jax.tree.map(collect, updates, params, is_leaf=lambda x: x is None or is_lowrank(x))
    if not pairs:
        raise ValueError("scale_by_update_ratio: the updates hold no LowRankUpdate; place it after scale_by_sketch")
    return pairs


def _norms_sq(u: LowRankUpdate, weight: Any, per_layer: bool) -> tuple[jax.Array, jax.Array]:
    """(‖W‖², ‖D A‖²) of one target, as scalars or per layer (batch slice, [num_slices]); ‖D A‖² = ⟨D (A Aᵀ), D⟩."""
    u.check_step()
    t = u.target
    w = jnp.asarray(weight, jnp.float32)
    d = u.factor.astype(jnp.float32).reshape(t.num_slices, t.d, u.rank)
    if per_layer:
        weight_sq = jnp.sum(jnp.square(to_slices(w, t)).reshape(t.num_slices, -1), axis=1)
    else:
        weight_sq = jnp.sum(jnp.square(w))
    update_sq = jnp.einsum("biz,bzy,biy->b" if per_layer else "biz,bzy,biy->", d, u.projection_gram(), d,
                           precision=_HIGHEST)
    return weight_sq, update_sq


def ratio_factor(ratio: float | jax.Array, weight_sq: jax.Array, update_sq: jax.Array) -> jax.Array:
    """ratio · sqrt(weight_sq / update_sq), 0 where update_sq = 0 (nothing to step): the step size's one formula,
    also used on dense directions (`scale_by_dense_row_adam`).

    Example:
      >>> float(ratio_factor(0.5, jnp.float32(16.0), jnp.float32(4.0))), float(ratio_factor(0.5, 1.0, 0.0))
      (1.0, 0.0)
    """
    safe = jnp.where(update_sq > 0, update_sq, 1.0)
    return jnp.where(update_sq > 0, ratio * jnp.sqrt(weight_sq / safe), 0.0)


def update_ratio_factor(updates: Any, params: Any, ratio: float | jax.Array) -> jax.Array:
    """ratio · sqrt(Σ‖W‖² / Σ‖D A‖²) over the LowRankUpdate leaves of `updates` and their `params` weights.

    Raises:
      ValueError: `updates` holds no LowRankUpdate.

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> updates, _ = scale_by_sketch(rank=2).update(params, scale_by_sketch(rank=2).init(params))
      >>> float(update_ratio_factor(updates, params, 0.0))
      0.0
    """
    weight_sq = jnp.zeros((), jnp.float32)
    update_sq = jnp.zeros((), jnp.float32)
    for u, w in _lowrank_pairs(updates, params):
        w_sq, u_sq = _norms_sq(u, w, per_layer=False)
        weight_sq += w_sq
        update_sq += u_sq
    return ratio_factor(ratio, weight_sq, update_sq)


def layer_ratio_factor(u: LowRankUpdate, weight: Any, ratio: float | jax.Array) -> jax.Array:
    """Per layer (batch slice) l of one target: ratio · ‖W_l‖ / ‖D_l A_l‖, shaped to multiply u.factor
    ([*batch, 1, ..., 1]); 0 where ‖D_l A_l‖ = 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((3, 8, 4))}}
      >>> updates, _ = scale_by_sketch(rank=2).update(params, scale_by_sketch(rank=2).init(params))
      >>> layer_ratio_factor(updates["q_proj"]["kernel"], params["q_proj"]["kernel"], 0.01).shape
      (3, 1, 1)
    """
    factor = ratio_factor(ratio, *_norms_sq(u, weight, per_layer=True))
    t = u.target
    return factor.reshape(*t.batch_shape, *(1,) * (u.factor.ndim - len(t.batch_shape)))


def scale_by_update_ratio(ratio: float = 6e-5, scope: str = "global") -> optax.GradientTransformationExtraArgs:
    """Scale every low-rank factor so the whole step has norm `ratio` relative to the target weights.

    scope "global" (docs/method.md): D_l ← ratio · sqrt(Σ_l ‖W_l‖²_F / Σ_l ‖D_l A_l‖²_F) · D_l, one factor for all
    layers, which then move in proportion to their sketches' norms. scope "layer" (a LARS-style trust ratio, not
    in the paper): D_l ← ratio · ‖W_l‖_F / ‖D_l A_l‖_F · D_l, every layer (batch slice of every target) moves by
    the same fraction of its own norm, so layers with small gradients are not starved.
    Other leaves pass through unchanged; a decay term (if any) is not scaled. Needs `params`.

    Args:
      ratio: the update-to-weight norm ratio (docs/method.md: 6e-5); may be an array under inject_hyperparams.
      scope: "global" or "layer".

    Returns:
      An optax.GradientTransformationExtraArgs with optax.EmptyState.

    Raises:
      ValueError: ratio < 0; at update, params missing or no LowRankUpdate in the updates.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> tx = optax.chain(scale_by_sketch(rank=2), scale_by_update_ratio(0.01))
      >>> updates, _ = tx.update(params, tx.init(params), params)
      >>> delta = updates["q_proj"]["kernel"].to_dense()
      >>> round(float(jnp.linalg.norm(delta) / jnp.linalg.norm(params["q_proj"]["kernel"])), 4)
      0.01
    """
    if isinstance(ratio, (int, float)) and not ratio >= 0:
        raise ValueError(f"ratio must be >= 0, got {ratio!r}")
    if scope not in SCOPES:
        raise ValueError(f"scale_by_update_ratio: scope must be one of {SCOPES}, got {scope!r}")

    def init_fn(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, optax.EmptyState]:
        del extra_args
        if params is None:
            raise ValueError("scale_by_update_ratio needs params: call update(updates, state, params)")
        if scope == "layer":
            _lowrank_pairs(updates, params)  # no low-rank leaf is an error, as in the global scope
            factor_of = lambda u, w: layer_ratio_factor(u, w, ratio)
        else:
            factor = update_ratio_factor(updates, params, ratio)
            factor_of = lambda u, w: factor
        scaled = jax.tree.map(lambda u, w: u.replace(factor=factor_of(u, w) * u.factor) if is_lowrank(u) else u,
                              updates, params, is_leaf=lambda x: x is None or is_lowrank(x))
        return scaled, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
