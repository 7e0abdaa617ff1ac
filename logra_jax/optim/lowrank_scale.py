"""Low-rank-aware counterparts of optax.scale / scale_by_learning_rate / add_decayed_weights.

Generic optax transforms treat every leaf as a float and would also rescale a LowRankUpdate's int32 `step`;
these act on the factor U (and the decay coefficient c) of low-rank leaves and on plain leaves like optax does:
  scale_lowrank(η):             U ← η U,  c ← η c,  u ← η u
  add_decayed_weights_lowrank(λ): c ← c + λ (the dense term c·W of ΔW = U A + c W),  u ← u + λ p
so chain(add_decayed_weights_lowrank(λ), scale_lowrank(−η)) gives W ← (1 − ηλ) W − η D A (NeMo variant).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.lowrank import LowRankUpdate, is_lowrank


def _scale_tree(updates: Any, step_size: jax.Array | float) -> Any:
    def one(u: Any) -> Any:
        if isinstance(u, LowRankUpdate):
            decay = None if u.decay is None else step_size * u.decay
            return u.replace(factor=step_size * u.factor, decay=decay)
        return None if u is None else jnp.asarray(step_size * u).astype(u.dtype)

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
            return _scale_tree(updates, eta), optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

        return optax.GradientTransformationExtraArgs(init_fn, update_fn)

    def const_init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def const_update(updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
                     ) -> tuple[Any, optax.EmptyState]:
        del params, extra_args
        return _scale_tree(updates, step_size), state

    return optax.GradientTransformationExtraArgs(const_init, const_update)


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

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
