"""Policy-gradient losses as pure per-token functions, plus their masked aggregation.

Notation per response token t: log π_θ (trainer, differentiated), log π_old (trainer at rollout parameters),
log μ (the rollout engine's log-prob of the sampled token), log π_ref (reference policy), advantage A, mask m.
  ratio            r = exp(clip(log π_θ − log π_old, ±20))       (every log-ratio is clamped before exp, as in verl)
  PPO-clip         ℓ = max(−A r, −A clip(r, 1 − ε_low, 1 + ε_high))                (ε_high > ε_low: clip-higher)
  dual clip (c>1)  ℓ ← min(ℓ, −c A)  where A < 0
  REINFORCE        ℓ = −A log π_θ
  TIS              w = sg(min(exp(log π_old − log μ), C))  multiplies ℓ              (paper: C = 2)
  reference KL     δ = log π_θ − log π_ref;  k1 = δ,  k2 = ½ δ²,  k3 = exp(−δ) + δ − 1;  clamped to [−κ, κ]
  total            L = agg(m, w ℓ + β k)
Aggregations over a batch [B, T]:
  token_mean                Σ m ℓ / Σ m
  seq_mean                  mean over sequences with Σ_t m > 0 of (Σ_t m ℓ / Σ_t m)
  seq_mean_token_sum_norm   Σ m ℓ / (B · T_max)          (Dr. GRPO: a constant, no length bias; T_max fixed)
Masked entries never contribute values or gradients, whatever their inputs (they are replaced before use).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

KLEstimator = Literal["k1", "k2", "k3"]
Aggregation = Literal["token_mean", "seq_mean", "seq_mean_token_sum_norm"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "seq_mean_token_sum_norm")
POLICIES: tuple[str, ...] = ("ppo", "reinforce")
# The aux-metric key under which a loss function reports its normaliser (`aggregation_denominator`): a
# microbatched train step sums it over microbatches and normalises once (logra_jax.job.train_step.accumulate_grads).
LOSS_DENOMINATOR = "loss_denominator"


def _per_token(advantages: jax.Array, like: jax.Array) -> jax.Array:
    """Advantages [B] (one per sequence) or [B, T] (per token), broadcast to [B, T] float32."""
    advantages = jnp.asarray(advantages, jnp.float32)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    return jnp.broadcast_to(advantages, like.shape)


# Bound on every log-ratio before exp (verl's ±20): exp(20) ≈ 4.9e8 is finite in float32, so one garbage or −inf
# log-prob cannot overflow a ratio into inf, whose 0·∞ = NaN gradient would poison the whole step even on
# clipped tokens. Ratios that far from 1 are clipped or capped anyway.
LOG_RATIO_CLAMP = 20.0


def _log_ratio(numerator: jax.Array, denominator: jax.Array, mask: jax.Array) -> jax.Array:
    """clip(log numerator − log denominator, ±LOG_RATIO_CLAMP) [B, T] float32 at mask, 0 elsewhere."""
    diff = jnp.where(mask, numerator.astype(jnp.float32) - denominator.astype(jnp.float32), 0.0)
    return jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ppo_clip_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *,
                  eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None) -> jax.Array:
    """Per-token PPO-clip loss ℓ [B, T] with asymmetric clipping and optional dual clip (0 where mask is 0).

      r = exp(clip(log π_θ − log π_old, ±20));  ℓ = max(−A r, −A clip(r, 1 − ε_low, 1 + ε_high));
      A < 0: ℓ ← min(ℓ, −c A)

    Example:
      >>> lp = jnp.log(jnp.array([[1.5]]))
      >>> ppo_clip_loss(lp, jnp.zeros((1, 1)), jnp.array([1.0]), jnp.ones((1, 1)), eps_high=0.28)
      Array([[-1.28]], dtype=float32)
    """
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"ppo_clip_loss: need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"ppo_clip_loss: dual_clip must be > 1 (or None), got {dual_clip!r}")
    mask = mask.astype(bool)
    adv = _per_token(advantages, logp)
    ratio = jnp.exp(_log_ratio(logp, old_logp, mask))
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    return jnp.where(mask, loss, 0.0)


def reinforce_loss(logp: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token REINFORCE loss ℓ = −A log π_θ [B, T] (0 where mask is 0).

    Example:
      >>> reinforce_loss(jnp.array([[-0.5, -1.0]]), jnp.array([2.0]), jnp.array([[1, 0]]))
      Array([[1., 0.]], dtype=float32)
    """
    mask = mask.astype(bool)
    adv = _per_token(advantages, logp)
    return jnp.where(mask, -adv * jnp.where(mask, logp.astype(jnp.float32), 0.0), 0.0)


def truncated_is_weights(old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, *,
                         cap: float = 2.0) -> jax.Array:
    """Truncated importance weights w = sg(min(exp(clip(log π_old − log μ, ±20)), C)) [B, T] correcting
    rollout/trainer mismatch (0 where mask is 0; no gradient flows through them).

    Example:
      >>> truncated_is_weights(jnp.log(jnp.array([[0.5, 0.9]])), jnp.log(jnp.array([[0.4, 0.3]])), jnp.ones((1, 2)))
      Array([[1.25, 2.  ]], dtype=float32)
    """
    if not cap > 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap!r}")
    mask = mask.astype(bool)
    w = jnp.minimum(jnp.exp(_log_ratio(old_logp, rollout_logp, mask)), cap)
    return jax.lax.stop_gradient(jnp.where(mask, w, 0.0))


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, *, estimator: str = "k3",
               clamp: float | None = 10.0) -> jax.Array:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled tokens [B, T], clamped to [−clamp, clamp].

    With δ = clip(log π_θ − log π_ref, ±20):  k1 = δ,  k2 = ½ δ²,  k3 = exp(−δ) + δ − 1  (unbiased, ≥ 0, low
    variance). The log-ratio clamp keeps exp(−δ) finite and, with the value clamp, every gradient finite when a
    log-prob is ±inf; it changes nothing for |δ| ≤ 20.

    Example:
      >>> kl_penalty(jnp.array([[0.0]]), jnp.array([[-1.0]]), jnp.ones((1, 1)), estimator="k2")
      Array([[0.5]], dtype=float32)
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty: unknown estimator {estimator!r}; known: {KL_ESTIMATORS}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"kl_penalty: clamp must be > 0 or None, got {clamp!r}")
    mask = mask.astype(bool)
    delta = _log_ratio(logp, ref_logp, mask)
    if estimator == "k1":
        kl = delta
    elif estimator == "k2":
        kl = 0.5 * delta**2
    else:
        kl = jnp.exp(-delta) + delta - 1.0
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    return jnp.where(mask, kl, 0.0)


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str = "token_mean", *,
              max_len: int | None = None) -> jax.Array:
    """Reduce a per-token quantity [B, T] to a scalar (see the module docstring for the three modes).

    Args:
      per_token: [B, T] values.
      mask: [B, T] 1 at response tokens.
      mode: "token_mean", "seq_mean" or "seq_mean_token_sum_norm".
      max_len: T_max of seq_mean_token_sum_norm (default T); keep it fixed across steps.

    Returns:
      A float32 scalar; 0 when the mask is empty.

    Example:
      >>> x, m = jnp.array([[1.0, 3.0], [5.0, 0.0]]), jnp.array([[1, 1], [1, 0]])
      >>> aggregate(x, m, "token_mean"), aggregate(x, m, "seq_mean"), aggregate(x, m, "seq_mean_token_sum_norm")
      (Array(3., dtype=float32), Array(3.5, dtype=float32), Array(2.25, dtype=float32))
    """
    if per_token.ndim != 2 or mask.shape != per_token.shape:
        raise ValueError(f"aggregate: need per_token and mask [B, T] of one shape, got {per_token.shape}, {mask.shape}")
    denominator = aggregation_denominator(mask, mode, max_len=max_len)
    values = jnp.where(mask.astype(bool), per_token.astype(jnp.float32), 0.0)
    if mode == "seq_mean":
        values = values / jnp.maximum(mask.astype(jnp.float32).sum(axis=1, keepdims=True), 1.0)
    return values.sum() / jnp.maximum(denominator, 1.0)


def aggregation_denominator(mask: jax.Array, mode: str = "token_mean", *, max_len: int | None = None) -> jax.Array:
    """The normaliser of `aggregate` (float32 scalar): Σ m (token_mean), the number of sequences with a response
    token (seq_mean) or B·T_max (seq_mean_token_sum_norm); `aggregate` = (its numerator) / max(denominator, 1).

    It depends only on the mask, and it adds over any split of the rows: a step over microbatches normalises once
    by the sum of their denominators (the whole batch's), so the split does not change the loss or its gradient.

    Example:
      >>> m = jnp.array([[1, 1], [1, 0], [0, 0]])
      >>> [float(aggregation_denominator(m, mode)) for mode in AGGREGATIONS]
      [3.0, 2.0, 6.0]
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregate: unknown mode {mode!r}; known: {AGGREGATIONS}")
    if mask.ndim != 2:
        raise ValueError(f"aggregate: need a mask [B, T], got shape {mask.shape}")
    m = mask.astype(jnp.float32)
    if mode == "token_mean":
        return m.sum()
    if mode == "seq_mean":
        return (m.sum(axis=1) > 0).sum().astype(jnp.float32)
    if max_len is None:
        max_len = mask.shape[1]
    if max_len < 1:
        raise ValueError(f"aggregate: max_len must be >= 1, got {max_len}")
    return jnp.float32(mask.shape[0] * max_len)


@dataclasses.dataclass(frozen=True, slots=True)
class LossConfig:
    """The policy loss L = agg(m, w ℓ + β k).

    Attributes:
      policy: "ppo" (clipped ratio against old_logp) or "reinforce" (−A log π_θ).
      eps_low, eps_high: PPO clip range [1 − eps_low, 1 + eps_high].
      dual_clip: c > 1 for dual-clip PPO, None for off.
      tis_cap: cap C of the truncated importance weights; None disables TIS.
      kl_beta: β of the reference-KL penalty (0 disables it).
      kl_estimator: "k1", "k2" or "k3"; kl_clamp: κ (None: no clamp).
      aggregation: "token_mean", "seq_mean" or "seq_mean_token_sum_norm"; max_len: its T_max.
    """

    policy: Literal["ppo", "reinforce"] = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    tis_cap: float | None = 2.0
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = 10.0
    aggregation: str = "token_mean"
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"LossConfig.policy must be 'ppo' or 'reinforce', got {self.policy!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"LossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_beta < 0:
            raise ValueError(f"LossConfig.kl_beta must be >= 0, got {self.kl_beta!r}")


def policy_loss(logp: jax.Array, advantages: jax.Array, mask: jax.Array, *, config: LossConfig,
                old_logp: jax.Array | None = None, rollout_logp: jax.Array | None = None,
                ref_logp: jax.Array | None = None, tis_cap_rows: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L = agg(m, w ℓ + β k) and token-mean diagnostics.

    Args:
      logp: [B, T] log π_θ of the response tokens (differentiated).
      advantages: [B] or [B, T].
      mask: [B, T] response mask.
      config: the loss settings.
      old_logp: log π_old; default sg(logp) (one update per batch: r = 1, gradient −A ∇log π_θ).
      rollout_logp: log μ from the rollout engine; required when config.tis_cap is set.
      ref_logp: log π_ref; required when config.kl_beta > 0.
      tis_cap_rows: [B] a lower cap for some rows' importance weights (each row's weights capped at
        min(config.tis_cap, tis_cap_rows[b]): a batch too far behind the policy, clipped harder); needs TIS on.

    Returns:
      (loss scalar, metrics): pg_loss, kl, clip_fraction (tokens where the clip binds: A > 0 and r > 1 + ε_high,
      or A < 0 and r < 1 − ε_low, as verl's and TRL's clipfrac), outside_clip_fraction (tokens whose ratio left
      the clip range, whatever the advantage), tis_weight (mean weight), tis_capped (tokens whose weight the cap
      truncated) — all token means.

    Raises:
      ValueError: when an input the config needs is missing.
    """
    if config.tis_cap is not None and rollout_logp is None:
        raise ValueError("policy_loss: rollout_logp is required when LossConfig.tis_cap is set")
    if config.kl_beta > 0 and ref_logp is None:
        raise ValueError("policy_loss: ref_logp is required when LossConfig.kl_beta > 0")
    if tis_cap_rows is not None and config.tis_cap is None:
        raise ValueError("policy_loss: tis_cap_rows lowers the importance weights' cap, but LossConfig.tis_cap is "
                         "None (TIS off)")
    old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    if config.policy == "ppo":
        per_token = ppo_clip_loss(logp, old, advantages, mask, eps_low=config.eps_low, eps_high=config.eps_high,
                                  dual_clip=config.dual_clip)
    else:
        per_token = reinforce_loss(logp, advantages, mask)
    metrics: dict[str, jax.Array] = {}
    weights = jnp.ones_like(per_token)
    if config.tis_cap is not None:
        weights = truncated_is_weights(old, rollout_logp, mask, cap=config.tis_cap)
        cap = jnp.full(weights.shape[:1], config.tis_cap, jnp.float32)
        if tis_cap_rows is not None:
            cap = jnp.minimum(cap, tis_cap_rows.astype(jnp.float32))
            weights = jnp.minimum(weights, cap[:, None])
        raw = jnp.exp(_log_ratio(old, rollout_logp, mask.astype(bool)))
        metrics["tis_weight"] = aggregate(weights, mask)
        metrics["tis_capped"] = aggregate((raw > cap[:, None]).astype(jnp.float32), mask)
    total = weights * per_token
    metrics["pg_loss"] = aggregate(total, mask, config.aggregation, max_len=config.max_len)
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, mask, estimator=config.kl_estimator, clamp=config.kl_clamp)
        metrics["kl"] = aggregate(kl, mask)
        total = total + config.kl_beta * kl
    ratio = jnp.exp(_log_ratio(logp, old, mask.astype(bool)))
    adv = _per_token(advantages, logp)
    low, high = ratio < 1.0 - config.eps_low, ratio > 1.0 + config.eps_high
    binds = ((adv > 0) & high) | ((adv < 0) & low)  # the clipped branch is the max: no gradient (verl, TRL)
    metrics["clip_fraction"] = aggregate(binds.astype(jnp.float32), mask)
    metrics["outside_clip_fraction"] = aggregate((low | high).astype(jnp.float32), mask)
    return aggregate(total, mask, config.aggregation, max_len=config.max_len), jax.lax.stop_gradient(metrics)
