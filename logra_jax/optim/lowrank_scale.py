"""Low-rank-aware counterparts of optax.scale / add_decayed_weights / clip_by_global_norm, and the step to dense.

Generic optax transforms treat every leaf as a float and would also rescale a LowRankUpdate's int32 `step`;
these act on the factor U (and the decay coefficient c) of low-rank leaves and on plain leaves like optax does:
  scale_lowrank(η):                 U ← η U,  c ← η c,  u ← η u
  add_decayed_weights_lowrank(λ):   c ← c + λ (the dense term c·W of ΔW = U A + c W),  u ← u + λ p
  clip_by_global_norm_lowrank(m):   all of the above scaled by min(1, m / g),  g² = Σ ‖ΔW‖²_F + Σ ‖u‖²
                                    (‖U A‖² = ⟨U (A Aᵀ), U⟩: exact, ΔW never formed)
  densify_lowrank():                each LowRankUpdate → its dense float32 ΔW (`LowRankUpdate.to_dense`)
so chain(add_decayed_weights_lowrank(λ), scale_lowrank(−η)) gives W ← (1 − ηλ) W − η D A (NeMo variant), and
after densify_lowrank any optax transform and `optax.apply_updates` work on the updates.
All four are marked low-rank-aware (`mark_lowrank_aware`): logra accepts them as its successor in a chain.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.lowrank import LOWRANK_AWARE_ATTR, LowRankUpdate, is_lowrank


def _aware(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    """Mark a transform built here as taking LowRankUpdate leaves (see `mark_lowrank_aware`)."""
    setattr(tx.update, LOWRANK_AWARE_ATTR, True)
    return tx


def scale_updates(updates: Any, step_size: jax.Array | float, *, exact_zero: bool = False) -> Any:
    """η·updates, the one way an update tree is scaled: U ← η U and c ← η c on low-rank leaves (their int32 step
    untouched), u ← dtype_u(η u) on floating leaves; None and integer leaves pass unchanged. exact_zero: where
    η = 0 the result is exactly zero, even for non-finite updates (a refused or undone step)."""
    def mul(x: jax.Array) -> jax.Array:
        out = jnp.asarray(step_size * x).astype(x.dtype)
        return jnp.where(step_size == 0, jnp.zeros_like(out), out) if exact_zero else out

    def one(u: Any) -> Any:
        if isinstance(u, LowRankUpdate):
            return u.replace(factor=mul(u.factor), decay=None if u.decay is None else mul(u.decay))
        if u is None or not jnp.issubdtype(jnp.asarray(u).dtype, jnp.floating):
            return u
        return mul(u)

    return jax.tree.map(one, updates, is_leaf=lambda x: x is None or is_lowrank(x))


def scale_lowrank(step_size: float | jax.Array | optax.Schedule) -> optax.GradientTransformationExtraArgs:
    """Multiply updates by a constant or scheduled step size η: U ← η U (and c ← η c) on low-rank leaves.

    Args:
      step_size: a float/array, or an optax schedule evaluated at this transform's own step count.

    Returns:
      An optax.GradientTransformationExtraArgs (EmptyState for a constant, ScaleByScheduleState for a schedule).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> tx = optax.chain(scale_by_sketch(rank=2), scale_lowrank(-1.0))
      >>> u, _ = tx.update(params, tx.init(params))
      >>> s, _ = scale_by_sketch(rank=2).update(params, scale_by_sketch(rank=2).init(params))
      >>> bool(jnp.allclose(u["q_proj"]["kernel"].factor, -s["q_proj"]["kernel"].factor))
      True
    """
    if callable(step_size):
        schedule = step_size

        def init_fn(params: Any) -> optax.ScaleByScheduleState:
            del params
            return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

        def update_fn(updates: Any, state: optax.ScaleByScheduleState, params: Any = None, **extra_args: Any
                      ) -> tuple[Any, optax.ScaleByScheduleState]:
            del params, extra_args
            eta = jnp.asarray(schedule(state.count), jnp.float32)
            return scale_updates(updates, eta), optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

        return _aware(optax.GradientTransformationExtraArgs(init_fn, update_fn))

    def const_init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def const_update(updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
                     ) -> tuple[Any, optax.EmptyState]:
        del params, extra_args
        return scale_updates(updates, step_size), state

    return _aware(optax.GradientTransformationExtraArgs(const_init, const_update))


def add_decayed_weights_lowrank(weight_decay: float | jax.Array) -> optax.GradientTransformationExtraArgs:
    """Decoupled weight decay: c ← c + λ on low-rank leaves (ΔW = U A + c W), u ← u + λ p on plain leaves.

    Args:
      weight_decay: λ >= 0 (an array under inject_hyperparams).

    Returns:
      An optax.GradientTransformationExtraArgs with EmptyState; needs `params` for plain leaves.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> tx = optax.chain(scale_by_sketch(rank=2), add_decayed_weights_lowrank(0.1))
      >>> u, _ = tx.update(params, tx.init(params), params)
      >>> round(float(u["q_proj"]["kernel"].decay), 6)
      0.1
    """
    if isinstance(weight_decay, (int, float)) and not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")

    def init_fn(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, optax.EmptyState]:
        del extra_args
        lam = jnp.asarray(weight_decay, jnp.float32)

        def lowrank(u: LowRankUpdate) -> LowRankUpdate:
            return u.replace(decay=lam if u.decay is None else u.decay + lam)

        def one(u: Any, p: Any) -> Any:
            if u is None or isinstance(u, LowRankUpdate):
                return None if u is None else lowrank(u)
            return (u + weight_decay * p).astype(u.dtype)

        if params is None:
            if any(not is_lowrank(x) for x in jax.tree.leaves(updates, is_leaf=is_lowrank)):
                raise ValueError("add_decayed_weights_lowrank needs params for its plain (dense) leaves")
            return jax.tree.map(lowrank, updates, is_leaf=is_lowrank), state
        return jax.tree.map(one, updates, params, is_leaf=lambda x: x is None or is_lowrank(x)), state

    return _aware(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _empty_init(params: Any) -> optax.EmptyState:
    del params
    return optax.EmptyState()


def _map_with_weights(fn: Any, updates: Any, params: Any, where: str) -> Any:
    """fn(update, weight) over the leaves of `updates` (LowRankUpdate, None and MaskedNode are leaves); `params`
    may be None only when no low-rank leaf carries a decay term (the weight is then None)."""
    is_leaf = lambda x: x is None or is_lowrank(x) or isinstance(x, optax.MaskedNode)
    if params is None:
        if any(is_lowrank(u) and u.decay is not None for u in jax.tree.leaves(updates, is_leaf=is_lowrank)):
            raise ValueError(f"{where}: low-rank updates with a decay term need params: call "
                             "update(updates, state, params)")
        return jax.tree.map(lambda u: fn(u, None), updates, is_leaf=is_leaf)
    return jax.tree.map(fn, updates, params, is_leaf=is_leaf)


def clip_by_global_norm_lowrank(max_norm: float | jax.Array) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm on updates holding LowRankUpdate leaves, by the exact norm of their dense ΔW.

      g² = Σ_low-rank ‖ΔW‖²_F + Σ_plain ‖u‖²,   ΔW = bf16?(U)·A + c·W   (`LowRankUpdate.dense_norm_sq`:
                                                   ⟨U (A Aᵀ), U⟩ + 2c⟨U, W Aᵀ⟩ + c²‖W‖², never U·A)
      every update ← min(1, max_norm / g) · update    (U ← sU, c ← sc, u ← su)
    Unchanged (bit for bit) when g ≤ max_norm.

    Args:
      max_norm: the largest global norm let through, > 0 (an array under inject_hyperparams).

    Returns:
      An optax.GradientTransformationExtraArgs with EmptyState; needs `params` only for updates with a decay.

    Raises:
      ValueError: max_norm <= 0; at update, params missing while a low-rank update has a decay term.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> tx = optax.chain(scale_by_sketch(rank=2), clip_by_global_norm_lowrank(1e-3))
      >>> u, _ = tx.update(params, tx.init(params))
      >>> round(float(jnp.linalg.norm(u["q_proj"]["kernel"].to_dense())), 6)
      0.001
    """
    if isinstance(max_norm, (int, float)) and not max_norm > 0:
        raise ValueError(f"clip_by_global_norm_lowrank: max_norm must be > 0, got {max_norm!r}")

    def update_fn(updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, optax.EmptyState]:
        del extra_args
        def norm_sq(u: Any, w: Any) -> Any:
            if is_lowrank(u):
                return u.dense_norm_sq(w)
            if u is None or isinstance(u, optax.MaskedNode):
                return None
            return jnp.sum(jnp.square(jnp.asarray(u, jnp.float32)))

        pieces = jax.tree.leaves(_map_with_weights(norm_sq, updates, params, "clip_by_global_norm_lowrank"))
        g = jnp.sqrt(sum(pieces, jnp.zeros((), jnp.float32)))
        scale = jnp.where(g <= max_norm, 1.0, max_norm / jnp.where(g > 0, g, 1.0)).astype(jnp.float32)
        return scale_updates(updates, scale), state

    return _aware(optax.GradientTransformationExtraArgs(_empty_init, update_fn))


def densify_lowrank() -> optax.GradientTransformationExtraArgs:
    """Replace every LowRankUpdate by its dense float32 ΔW (`LowRankUpdate.to_dense`); plain leaves pass.

      ΔW = bf16?(U)·A                        (no decay)
      ΔW = float32(merge(W)) − float32(W)    (decay c; merge(W) = dtype_W((1 + c)·W + bf16?(U)·A))
    `optax.apply_updates(params, updates)` (and so `nnx.Optimizer.update`) then gives the weights that
    `logra_jax.optim.apply_updates` gives on the low-rank updates: bit for bit for float32 and bfloat16 weights
    (optax adds W + ΔW in float32 and casts to W's dtype, as the merge does; with a decay term wherever the new
    weight lies within [W/2, 2W]). Costs one float32 ΔW per target inside the step: see experiments/dropin.
    The last transform of `logra(..., dense_updates=True)`; any optax transform may follow it.

    Returns:
      An optax.GradientTransformationExtraArgs with EmptyState; needs `params` only for updates with a decay.

    Raises:
      ValueError: at update, params missing while a low-rank update has a decay term.
      TypeError: a broken LowRankUpdate (a generic transform ran before this one; see `check_step`).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> from logra_jax.optim.lowrank import apply_updates
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> low = optax.chain(scale_by_sketch(rank=2), scale_lowrank(-1e-3))
      >>> dense = optax.chain(low, densify_lowrank())
      >>> u_low, _ = low.update(params, low.init(params))
      >>> u_dense, _ = dense.update(params, dense.init(params))
      >>> bool((optax.apply_updates(params, u_dense)["q_proj"]["kernel"]
      ...       == apply_updates(params, u_low)["q_proj"]["kernel"]).all())
      True
    """

    def update_fn(updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, optax.EmptyState]:
        del extra_args
        dense = lambda u, w: u.to_dense(w) if is_lowrank(u) else u
        return _map_with_weights(dense, updates, params, "densify_lowrank"), state

    return _aware(optax.GradientTransformationExtraArgs(_empty_init, update_fn))
