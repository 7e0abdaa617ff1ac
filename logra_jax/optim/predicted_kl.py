"""Predicted-KL step control (LOGRA.md §5).

Before a low-rank update is merged, predict the per-token KL it will cause on a few probe responses and scale
it so that the prediction meets a budget:

  p = softmax(z/T), u = δz/T,   q_t = ½ Σ_v p_v (u_v − Σ_w p_w u_w)²        (KL(π_θ ‖ π_θ+αΔ) = α² q + O(α³))
  q = Σ_t q_t / #t over generated positions (sum and count reduced globally before dividing)
  budget(n) = b_final + (b_0 − b_final)·½(1 + cos(π·min(n, N−1)/(N−1)))     (cosine over N updates, then flat)
  budget_eff = max(budget − m, f·budget),  m ← (1 − w)·m + w·clip(gap, 0) from m = 0   (optional)
  α = min(α_max, sqrt(budget_eff / q));   q = 0 → α = 1
  q non-finite or < 0, or no probed position → the step is refused: α = 0, `skipped` + 1, and
  `hold_if_skipped` keeps every other optimizer state (moments, counters) where it was

δz is the JVP of the logits along the proposed update, computed in factored form by
`logra_jax.optim.sketch_native` (tangent mode): δy = (X Aᵀ) Uᵀ at every target, never a dense ΔW.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from logra_jax.optim.lowrank import LowRankUpdate, apply_updates
from logra_jax.optim.sketch_native import SketchProbe, sketching


def kl_quadratic(logits: jax.Array, dlogits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Per-position q_t = ½ Σ_v p_v (u_v − E_p[u])² with p = softmax(z/T), u = δz/T; float32 [...]."""
    z = logits.astype(jnp.float32) / temperature
    u = dlogits.astype(jnp.float32) / temperature
    p = jax.nn.softmax(z, axis=-1)
    mean_u = jnp.sum(p * u, axis=-1, keepdims=True)
    return 0.5 * jnp.sum(p * jnp.square(u - mean_u), axis=-1)


def exact_kl(logits: jax.Array, new_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Per-position KL(softmax(z/T) ‖ softmax(z'/T)) in float32 [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logq = jax.nn.log_softmax(new_logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def _chunked_positions(fn: Callable[..., jax.Array], arrays: tuple[jax.Array, ...], mask: jax.Array,
                       chunk: int) -> tuple[jax.Array, jax.Array]:
    """Σ_t fn(chunk)·mask and Σ mask over T-chunks of [B, T, ...] arrays (temporaries bounded by the chunk)."""
    B, T = mask.shape
    chunk = min(chunk, T)
    n = -(-T // chunk)
    pad = n * chunk - T
    padded = [jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in arrays]
    maskp = jnp.pad(mask.astype(jnp.float32), ((0, 0), (0, pad)))
    split = [a.reshape(B, n, chunk, *a.shape[2:]).swapaxes(0, 1) for a in padded]
    masks = maskp.reshape(B, n, chunk).swapaxes(0, 1)

    def one(xs):
        *parts, m = xs
        return jnp.sum(fn(*parts) * m)

    sums = jax.lax.map(one, (*split, masks))
    return jnp.sum(sums), jnp.sum(maskp)


def predicted_kl_terms(hidden: jax.Array, dhidden: jax.Array, head: jax.Array, mask: jax.Array,
                       temperature: float = 1.0, chunk: int = 256) -> tuple[jax.Array, jax.Array]:
    """(Σ_t q_t, #t) over positions where mask is set, from final hidden states and their JVP.

    Args:
      hidden, dhidden: [B, T, D] final-norm hidden states and their tangent along the proposed update.
      head: the (frozen) output projection [D, V]; logits z = h·head, δz = δh·head.
      mask: [B, T] 1 at generated-token positions whose next-token distribution is probed.
      temperature: the sampling temperature T.
      chunk: positions per chunk, so the [B, chunk, V] temporaries stay bounded.

    Returns:
      (sum of q_t, count) as float32 scalars: reduce both across data-parallel shards before dividing.
    """
    def q_of(h, dh):
        z = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
        dz = jnp.einsum("btd,dv->btv", dh, head.astype(dh.dtype), preferred_element_type=jnp.float32)
        return kl_quadratic(z, dz, temperature)

    return _chunked_positions(q_of, (hidden, dhidden), mask, chunk)


def realised_kl_terms(hidden: jax.Array, new_hidden: jax.Array, head: jax.Array, mask: jax.Array,
                      temperature: float = 1.0, chunk: int = 256, *, new_head: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """(Σ_t KL_t, #t): exact KL between the policies before and after an update, chunked like the prediction
    (`new_head`: the output projection after the update when it was trained too; default `head`)."""
    head2 = head if new_head is None else new_head

    def kl_of(h, h2):
        z = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
        z2 = jnp.einsum("btd,dv->btv", h2, head2.astype(h2.dtype), preferred_element_type=jnp.float32)
        return exact_kl(z, z2, temperature)

    return _chunked_positions(kl_of, (hidden, new_hidden), mask, chunk)


def kl_budget_schedule(count: jax.Array, kl_budget: float, kl_budget_final: float, schedule_steps: int
                       ) -> jax.Array:
    """Cosine from `kl_budget` at update 0 to `kl_budget_final` at update schedule_steps − 1, then flat."""
    span = max(schedule_steps - 1, 1)
    frac = jnp.minimum(count.astype(jnp.float32), span) / span
    return kl_budget_final + (kl_budget - kl_budget_final) * 0.5 * (1.0 + jnp.cos(math.pi * frac))


class PredictedKLState(NamedTuple):
    """count: updates seen; mismatch: EMA of the rollout/trainer gap (0 before the first measurement);
    q, alpha, budget: last prediction, step scale and effective budget; skipped: updates refused (bad q)."""

    count: jax.Array
    mismatch: jax.Array
    q: jax.Array
    alpha: jax.Array
    budget: jax.Array
    skipped: jax.Array


def _scale_floats(tree: Any, alpha: jax.Array) -> Any:
    """α·x on floating leaves (exact zeros when α = 0, even where x is not finite); other leaves unchanged."""
    def scale(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jnp.where(alpha == 0, jnp.zeros_like(x), x * alpha.astype(x.dtype))
    return jax.tree.map(scale, tree)


def scale_by_predicted_kl(kl_budget: float = 2e-4, kl_budget_final: float = 2e-5, schedule_steps: int = 300,
                          alpha_max: float = 3.0, subtract_mismatch: bool = False, mismatch_weight: float = 0.3,
                          mismatch_floor: float = 0.5) -> optax.GradientTransformationExtraArgs:
    """Scale the proposed update by α so its predicted per-token KL meets the budget (module docstring).

    The prediction arrives as a keyword extra argument of `update`: either `kl_prediction=(q_sum, count)` or
    `kl_probe=fn(updates) -> (q_sum, count)` (called on the incoming updates; q is quadratic, so their sign does
    not matter). `rollout_mismatch=` (a scalar gap, ≥ 0 after clipping) feeds the optional mismatch subtraction.
    A non-finite or negative q, or a prediction over no position (count = 0), sets α = 0 (the update is
    refused) and increments `skipped`; it never updates silently. The rest of this state still advances: a
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
      >>> round(float(state.alpha), 3)
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
        return PredictedKLState(count=jnp.zeros((), jnp.int32), mismatch=f32(0.0), q=f32(0.0),
                                alpha=f32(1.0), budget=f32(kl_budget), skipped=jnp.zeros((), jnp.int32))

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
        budget = kl_budget_schedule(state.count, kl_budget, kl_budget_final, schedule_steps)
        mismatch = state.mismatch
        if rollout_mismatch is not None:
            gap = jnp.maximum(jnp.asarray(rollout_mismatch, jnp.float32), 0.0)
            mismatch = (1 - mismatch_weight) * mismatch + mismatch_weight * gap
        if subtract_mismatch:
            budget = jnp.maximum(budget - mismatch, mismatch_floor * budget)
        bad = ~jnp.isfinite(q) | (q < 0) | (count <= 0)
        safe_q = jnp.where(bad | (q <= 0), 1.0, q)
        alpha = jnp.where(q > 0, jnp.minimum(alpha_max, jnp.sqrt(budget / safe_q)), 1.0)
        alpha = jnp.where(bad, 0.0, alpha).astype(jnp.float32)
        new_state = PredictedKLState(count=state.count + 1, mismatch=mismatch, q=q, alpha=alpha, budget=budget,
                                     skipped=state.skipped + bad.astype(jnp.int32))
        return _scale_floats(updates, alpha), new_state

    return optax.GradientTransformationExtraArgs(init, update)


def hold_where(hold: jax.Array, updates: Any, old_state: Any, new_state: Any) -> tuple[Any, Any]:
    """(updates, state) with nothing advanced where `hold`: exact-zero updates (every transform's, also those
    outside the controller, e.g. non-target AdamW) and `old_state` again — RowAdam's moments, step counters, the
    controller's count and mismatch EMA — except the controller's record of what happened (skipped, and the
    held step's q, alpha, budget). Hold the params, and any projection step kept outside the optax state, too."""
    is_kl = lambda x: isinstance(x, PredictedKLState)
    held = jax.tree.map(lambda o, n: jnp.where(hold, o, n), old_state, new_state)

    def keep_record(h: Any, n: Any) -> Any:
        return h._replace(skipped=n.skipped, q=n.q, alpha=n.alpha, budget=n.budget) if is_kl(n) else h

    state = jax.tree.map(keep_record, held, new_state, is_leaf=is_kl)
    return _scale_floats(updates, jnp.where(hold, 0.0, 1.0)), state


def hold_if_skipped(updates: Any, old_state: Any, new_state: Any) -> tuple[Any, Any, jax.Array | None]:
    """(updates, state, refused) after an update that `scale_by_predicted_kl` may have refused: when a controller
    in `new_state` counted a refusal (its `skipped` grew), `hold_where` holds the step. Without a controller in
    the state everything is returned unchanged with refused = None."""
    is_kl = lambda x: isinstance(x, PredictedKLState)
    new_kl = [s for s in jax.tree.leaves(new_state, is_leaf=is_kl) if is_kl(s)]
    if not new_kl:
        return updates, new_state, None
    old_kl = [s for s in jax.tree.leaves(old_state, is_leaf=is_kl) if is_kl(s)]
    refused = jnp.any(jnp.stack([n.skipped > o.skipped for n, o in zip(new_kl, old_kl, strict=True)]))
    return *hold_where(refused, updates, old_state, new_state), refused


def lowrank_factors(updates: Any) -> dict[str, jax.Array]:
    """{target path: factor} of every LowRankUpdate in an update tree (masked and plain leaves skipped)."""
    leaves = jax.tree.leaves(updates, is_leaf=lambda x: isinstance(x, LowRankUpdate))
    return {u.target.path: u.factor for u in leaves if isinstance(u, LowRankUpdate)}


def make_kl_probe(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, step: jax.Array,
                  probe: Mapping[str, jax.Array], temperature: float = 1.0, chunk: int = 256
                  ) -> Callable[[Any], tuple[jax.Array, jax.Array]]:
    """kl_probe(updates) -> (Σ q_t, #t) for `scale_by_predicted_kl`, by one forward-mode JVP of the model.

    After a call, `kl_probe.hidden_before` holds the JVP's primal (the probe's final hidden states under
    `params`) for `realised_kl`, which then needs no copy of the old weights once the update is merged in place.

    The tangent of every target's sketch probe is its update factor U ([*batch, d, r]); in tangent mode the
    hooked layers add (X Aᵀ)·Pᵀ, so the JVP injects δy = (X Aᵀ) Uᵀ at every target output — the factored form of
    x·ΔWᵀ with ΔW = U·A, never built. Non-target updates are not part of the prediction (they are frozen in the
    paper's recipe).

    Args:
      graphdef, params, rest: the model split as `nnx.split(model, nnx.Param, ...)` with sketch probes attached.
      step: the update count whose projections the factors belong to.
      probe: 'tokens' [B, T], 'attention_mask' [B, T] and 'kl_mask' [B, T] (1 at the positions whose
        next-token distribution is probed: the positions that generated a response token).
      temperature: the sampling temperature.
      chunk: positions per chunk of the [B, chunk, V] temporaries.
    """
    probes, others = nnx.split_state(rest, SketchProbe, ...)
    probe_paths = [(k, ".".join(map(str, k[:-1])) + ".kernel") for k, _ in nnx.to_flat_state(probes)]

    def features(probe_values: nnx.State) -> jax.Array:
        with sketching(step, kind="tangent"):
            model = nnx.merge(graphdef, params, nnx.merge_state(probe_values, others))
            return model.features(probe["tokens"], attention_mask=probe["attention_mask"])

    def kl_probe(updates: Any) -> tuple[jax.Array, jax.Array]:
        factors = lowrank_factors(updates)
        flat = dict(nnx.to_flat_state(probes))
        tangent = nnx.from_flat_state([
            (k, flat[k].replace(factors[target].astype(jnp.float32) if target in factors
                                else jnp.zeros_like(flat[k][...])))
            for k, target in probe_paths])
        hidden, dhidden = jax.jvp(features, (probes,), (tangent,))
        kl_probe.hidden_before = hidden  # the JVP's primal: the realised KL reuses it (no second old forward)
        head = nnx.merge(graphdef, params, rest).head_weight()
        return predicted_kl_terms(hidden, dhidden, head, probe["kl_mask"], temperature, chunk)

    kl_probe.hidden_before = None
    return kl_probe


def realised_kl(graphdef: nnx.GraphDef, params: nnx.State, new_params: nnx.State, rest: nnx.State,
                probe: Mapping[str, jax.Array], temperature: float = 1.0, chunk: int = 256, *,
                hidden_before: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(Σ_t KL_t, #t): exact KL(π_params ‖ π_new_params) at the probed positions (probe as in `make_kl_probe`).

    hidden_before: the probe's final hidden states under `params` when already computed (`kl_probe.hidden_before`
    of `make_kl_probe`): then only the head of `params` is read, and the old weights need not outlive the merge.
    """
    old = nnx.merge(graphdef, params, rest)
    h_old = hidden_before
    if h_old is None:
        h_old = old.features(probe["tokens"], attention_mask=probe["attention_mask"])
    new = nnx.merge(graphdef, new_params, rest)
    h_new = new.features(probe["tokens"], attention_mask=probe["attention_mask"])
    return realised_kl_terms(h_old, h_new, old.head_weight(), probe["kl_mask"], temperature, chunk,
                             new_head=new.head_weight())


def predicted_and_realised_kl(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, step: jax.Array,
                              updates: Any, probe: Mapping[str, jax.Array], temperature: float = 1.0,
                              chunk: int = 256) -> tuple[jax.Array, jax.Array]:
    """(predicted q, realised KL) per probed token for applying `updates` (LowRankUpdates, apply_updates) to
    `params`: the quadratic prediction and the exact KL(π_before ‖ π_after) on the same positions."""
    q_sum, count = make_kl_probe(graphdef, params, rest, step, probe, temperature, chunk)(updates)
    kl_sum, _ = realised_kl(graphdef, params, apply_updates(params, updates), rest, probe, temperature, chunk)
    denom = jnp.maximum(count, 1.0)
    return q_sum / denom, kl_sum / denom
