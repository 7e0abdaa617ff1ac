"""Predicted-KL step control (docs/method.md §5).

Before a low-rank update is merged, predict the per-token KL it will cause on a few probe responses and scale
it so that the prediction meets a budget:

  p = softmax(z/T), u = δz/T,   q_t = ½ Σ_v p_v (u_v − Σ_w p_w u_w)²        (KL(π_θ ‖ π_θ+αΔ) = α² q + O(α³))
  q = Σ_t q_t / #t over generated positions (sum and count reduced globally before dividing)
  budget(n) = b_final + (b_0 − b_final)·½(1 + cos(π·min(n, N−1)/(N−1)))     (cosine over N updates, then flat)
  budget_eff = max(budget − m, f·budget),  m ← (1 − w)·m + w·clip(gap, 0) from m = 0   (optional)
  α = min(α_max, sqrt(budget_eff / q));   q = 0 → α = 1
  q non-finite or < 0, or no probed position → the step is refused: α = 0, `kl_skipped` + 1, and
  `hold_if_skipped` keeps every other optimizer state (moments, counters) where it was

This module is the optax side: the transform that turns q into α, the budget schedule, and holding the other
optimizer states on a refused step. q itself comes from the model: `logra_jax.native.kl_probe` computes δz, the
JVP of the logits along the proposed update, in factored form through the sketch-native hooks (tangent mode):
δy = (X Aᵀ) Uᵀ at every target, never a dense ΔW.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.lowrank_scale import scale_updates


def kl_budget_schedule(count: jax.Array, kl_budget: float, kl_budget_final: float, schedule_steps: int
                       ) -> jax.Array:
    """Cosine from `kl_budget` at update 0 to `kl_budget_final` at update schedule_steps − 1, then flat."""
    span = max(schedule_steps - 1, 1)
    frac = jnp.minimum(count.astype(jnp.float32), span) / span
    return kl_budget_final + (kl_budget - kl_budget_final) * 0.5 * (1.0 + jnp.cos(math.pi * frac))


class PredictedKLState(NamedTuple):
    """kl_count: updates seen; kl_mismatch: EMA of the rollout/trainer gap (0 before the first measurement);
    kl_q, kl_alpha, kl_budget: last prediction, step scale and effective budget; kl_skipped: updates refused
    (bad q). Named uniquely in any optimizer state (optax.tree_utils.tree_get(state, "kl_alpha")); the train
    step reports them as metrics of the same names."""

    kl_count: jax.Array
    kl_mismatch: jax.Array
    kl_q: jax.Array
    kl_alpha: jax.Array
    kl_budget: jax.Array
    kl_skipped: jax.Array


def scale_by_predicted_kl(kl_budget: float = 2e-4, kl_budget_final: float = 2e-5, schedule_steps: int = 300,
                          alpha_max: float = 3.0, subtract_mismatch: bool = False, mismatch_weight: float = 0.3,
                          mismatch_floor: float = 0.5) -> optax.GradientTransformationExtraArgs:
    """Scale the proposed update by α so its predicted per-token KL meets the budget (module docstring).

    The prediction arrives as a keyword extra argument of `update`: either `kl_prediction=(q_sum, count)` or
    `kl_probe=fn(updates) -> (q_sum, count)` (called on the incoming updates; q is quadratic, so their sign does
    not matter). `rollout_mismatch=` (a scalar gap, ≥ 0 after clipping) feeds the optional mismatch subtraction.
    A non-finite or negative q, or a prediction over no position (count = 0), sets α = 0 (the update is
    refused) and increments `kl_skipped`; it never updates silently. The rest of this state still advances: a
    train step undoes that, and the other transforms' advance, with `hold_if_skipped`. Floating leaves of the
    updates are multiplied by α; integer leaves (e.g. a low-rank update's step) are left alone.

    Args:
      kl_budget, kl_budget_final, schedule_steps: the cosine budget schedule.
      alpha_max: largest step scale (the step may grow as well as shrink).
      subtract_mismatch: subtract the mismatch EMA from the budget.
      mismatch_weight: EMA weight of a new mismatch measurement.
      mismatch_floor: the effective budget never goes below this fraction of the budget.

    Raises:
      ValueError: a hyperparameter out of range (named), or `update` called without a prediction.

    Example:
      >>> import jax.numpy as jnp
      >>> tx = scale_by_predicted_kl(kl_budget=1e-4)
      >>> state = tx.init({"w": jnp.ones(3)})
      >>> upd, state = tx.update({"w": jnp.ones(3)}, state, kl_prediction=(jnp.float32(4e-4), jnp.float32(1)))
      >>> round(float(state.kl_alpha), 3)
      0.5
    """
    # Arrays (from optax.inject_hyperparams, possibly traced) cannot be checked here; Python numbers are.
    number = lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    for name, value in (("kl_budget", kl_budget), ("kl_budget_final", kl_budget_final), ("alpha_max", alpha_max)):
        if not (isinstance(value, jax.Array) or (number(value) and value > 0 and math.isfinite(value))):
            raise ValueError(f"scale_by_predicted_kl: {name} must be a finite number > 0, got {value!r}")
    if not isinstance(schedule_steps, int) or schedule_steps < 1:
        raise ValueError(f"scale_by_predicted_kl: schedule_steps must be a Python integer >= 1 (static with "
                         f"optax.inject_hyperparams), got {schedule_steps!r}")
    if number(mismatch_weight) and not 0 < mismatch_weight <= 1:
        raise ValueError(f"scale_by_predicted_kl: mismatch_weight must be in (0, 1], got {mismatch_weight!r}")
    if number(mismatch_floor) and not 0 <= mismatch_floor <= 1:
        raise ValueError(f"scale_by_predicted_kl: mismatch_floor must be in [0, 1], got {mismatch_floor!r}")

    def init(params: Any) -> PredictedKLState:
        del params
        f32 = lambda v: jnp.asarray(v, jnp.float32)
        return PredictedKLState(kl_count=jnp.zeros((), jnp.int32), kl_mismatch=f32(0.0), kl_q=f32(0.0),
                                kl_alpha=f32(1.0), kl_budget=f32(kl_budget), kl_skipped=jnp.zeros((), jnp.int32))

    def update(updates: Any, state: PredictedKLState, params: Any = None, *, kl_probe=None, kl_prediction=None,
               rollout_mismatch=None, **extra: Any):
        del params, extra
        if kl_prediction is None:
            if kl_probe is None:
                raise ValueError("scale_by_predicted_kl: update needs kl_prediction=(q_sum, count) or "
                                 "kl_probe=fn(updates) as a keyword extra argument")
            kl_prediction = kl_probe(updates)
        q_sum, count = kl_prediction
        count = jnp.asarray(count, jnp.float32)
        q = jnp.asarray(q_sum, jnp.float32) / jnp.maximum(count, 1.0)
        budget = kl_budget_schedule(state.kl_count, kl_budget, kl_budget_final, schedule_steps)
        mismatch = state.kl_mismatch
        if rollout_mismatch is not None:
            gap = jnp.maximum(jnp.asarray(rollout_mismatch, jnp.float32), 0.0)
            mismatch = (1 - mismatch_weight) * mismatch + mismatch_weight * gap
        if subtract_mismatch:
            budget = jnp.maximum(budget - mismatch, mismatch_floor * budget)
        bad = ~jnp.isfinite(q) | (q < 0) | (count <= 0)
        safe_q = jnp.where(bad | (q <= 0), 1.0, q)
        alpha = jnp.where(q > 0, jnp.minimum(alpha_max, jnp.sqrt(budget / safe_q)), 1.0)
        alpha = jnp.where(bad, 0.0, alpha).astype(jnp.float32)
        new_state = PredictedKLState(kl_count=state.kl_count + 1, kl_mismatch=mismatch, kl_q=q, kl_alpha=alpha,
                                     kl_budget=budget, kl_skipped=state.kl_skipped + bad.astype(jnp.int32))
        return scale_updates(updates, alpha, exact_zero=True), new_state

    return optax.GradientTransformationExtraArgs(init, update)


def hold_where(hold: jax.Array, updates: Any, old_state: Any, new_state: Any) -> tuple[Any, Any]:
    """(updates, state) with nothing advanced where `hold`: exact-zero updates (every transform's, also those
    outside the controller, e.g. non-target AdamW) and `old_state` again — RowAdam's moments, step counters, the
    controller's count and mismatch EMA — except the controller's record of what happened (kl_skipped, and the
    held step's q, alpha, budget). Hold the params, and any projection step kept outside the optax state, too."""
    is_kl = lambda x: isinstance(x, PredictedKLState)
    held = jax.tree.map(lambda o, n: jnp.where(hold, o, n), old_state, new_state)

    def keep_record(h: Any, n: Any) -> Any:
        return h._replace(kl_skipped=n.kl_skipped, kl_q=n.kl_q, kl_alpha=n.kl_alpha,
                          kl_budget=n.kl_budget) if is_kl(n) else h

    state = jax.tree.map(keep_record, held, new_state, is_leaf=is_kl)
    return scale_updates(updates, jnp.where(hold, 0.0, 1.0), exact_zero=True), state


def hold_if_skipped(updates: Any, old_state: Any, new_state: Any) -> tuple[Any, Any, jax.Array | None]:
    """(updates, state, refused) after an update that `scale_by_predicted_kl` may have refused: when a controller
    in `new_state` counted a refusal (its `kl_skipped` grew), `hold_where` holds the step. Without a controller in
    the state everything is returned unchanged with refused = None."""
    is_kl = lambda x: isinstance(x, PredictedKLState)
    new_kl = [s for s in jax.tree.leaves(new_state, is_leaf=is_kl) if is_kl(s)]
    if not new_kl:
        return updates, new_state, None
    old_kl = [s for s in jax.tree.leaves(old_state, is_leaf=is_kl) if is_kl(s)]
    refused = jnp.any(jnp.stack([n.kl_skipped > o.kl_skipped for n, o in zip(new_kl, old_kl, strict=True)]))
    return *hold_where(refused, updates, old_state, new_state), refused
