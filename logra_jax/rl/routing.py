"""Routing mismatch between the rollout engine and the trainer (MoE models): which response tokens' experts differ,
and what that does to the log-probs the importance weights see.

For a rollout row [prompt of P | response of N] and MoE layer l, the engine recorded S^μ_{t,l} (the k experts its
router chose for token t: prefill for the prompt, decode for the response) and the trainer's teacher-forced
forward chose S^π_{t,l}. Response token j's log-prob comes from position P + j − 1, so per response token j:

    differs_j   = ∃ l: S^μ_{P+j−1,l} ≠ S^π_{P+j−1,l}                  (sets: the order within the top-k is ignored)
    affected_j  = ∃ t ≤ P + j − 1 recorded, ∃ l: S^μ_{t,l} ≠ S^π_{t,l}  (a difference at or before it: through the
                                                                        KV cache every later log-prob sees it)
    gap_j       = |log μ_j − log π_j|,      w_j = min(exp(log π_j − log μ_j), C)     (the TIS weight)

Recorded positions are the engine's real prompt tokens and its response tokens but the last (`Rollout.experts`).
With routing replay the trainer routes by S^μ, so these metrics then measure the decisions replay overrode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logra_jax.rl.losses import aggregate

# The per-step routing metrics (`routing_metrics`), logged under these names.
ROUTING_METRICS = ("routing/mismatch_share", "routing/layer_mismatch_share", "routing/affected_share",
                   "routing/logprob_gap_affected", "routing/logprob_gap_unaffected", "routing/tis_weight_affected",
                   "routing/tis_weight_unaffected")


def set_differs(engine_ids: jax.Array, trainer_ids: jax.Array) -> jax.Array:
    """Whether two top-k expert sets differ, per token and layer: ids [..., k] (any integer dtypes) → [...] bool.

    Example:
      >>> set_differs(jnp.array([[0, 2], [1, 3]]), jnp.array([[2, 0], [1, 2]]))
      Array([False,  True], dtype=bool)
    """
    if engine_ids.shape != trainer_ids.shape:
        raise ValueError(f"set_differs: engine ids {engine_ids.shape} and trainer ids {trainer_ids.shape} differ "
                         "in shape")
    a = jnp.sort(engine_ids.astype(jnp.int32), axis=-1)
    b = jnp.sort(trainer_ids.astype(jnp.int32), axis=-1)
    return jnp.any(a != b, axis=-1)


def recorded_positions(prompt_mask: jax.Array, response_mask: jax.Array) -> jax.Array:
    """[B, P + N] bool: the positions whose experts the engine recorded (it ran the token): real prompt tokens and
    every response token but the last (`Rollout.experts`)."""
    response = response_mask.astype(bool)
    fed = jnp.concatenate([response[:, 1:], jnp.zeros_like(response[:, :1])], axis=1)
    return jnp.concatenate([prompt_mask.astype(bool), fed], axis=1)


def response_routing(engine_ids: jax.Array, trainer_ids: jax.Array, prompt_mask: jax.Array,
                     response_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per response token j, from the position P + j − 1 that predicts it (module docstring):
    (layer differences [B, N, L] bool, affected [B, N] bool).

    Args:
      engine_ids, trainer_ids: [B, P + N, L, k] expert ids (`Rollout.experts`, `Decoder.routed_features`).
      prompt_mask: [B, P] real prompt tokens; response_mask: [B, N].
    """
    B, P = prompt_mask.shape
    if engine_ids.shape[:2] != (B, P + response_mask.shape[1]):
        raise ValueError(f"response_routing: expert ids {engine_ids.shape} do not cover [B, P + N] = "
                         f"{(B, P + response_mask.shape[1])}")
    recorded = recorded_positions(prompt_mask, response_mask)
    layers = set_differs(engine_ids, trainer_ids) & recorded[:, :, None]  # [B, T, L]
    upstream = jnp.cumsum(jnp.any(layers, axis=-1).astype(jnp.int32), axis=1) > 0  # a difference at or before t
    return layers[:, P - 1:-1], upstream[:, P - 1:-1]


def routing_metrics(engine_ids: jax.Array, trainer_ids: jax.Array, prompt_mask: jax.Array, response_mask: jax.Array,
                    logp: jax.Array, rollout_logp: jax.Array, tis_cap: float | None = None) -> dict[str, jax.Array]:
    """The step's routing metrics (`ROUTING_METRICS`), token means over the response tokens (0 where a group is
    empty): mismatch_share (tokens whose predicting position's experts differ in some MoE layer),
    layer_mismatch_share (the same per (token, layer)), affected_share, and over affected / unaffected tokens
    the mean |log μ − log π| and the mean TIS weight min(exp(log π − log μ), C) (C = tis_cap; none: uncapped).

    Args:
      engine_ids, trainer_ids: [B, P + N, L, k]; prompt_mask [B, P]; response_mask [B, N].
      logp, rollout_logp: [B, N] the trainer's and the engine's log-probs of the response tokens.
      tis_cap: the TIS cap C.

    Returns:
      {name: float32 scalar}, no gradient.
    """
    layers, affected = response_routing(engine_ids, trainer_ids, prompt_mask, response_mask)
    mask = response_mask.astype(jnp.float32)
    logp, rollout_logp = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(rollout_logp)
    gap = jnp.abs(rollout_logp - logp)
    weight = jnp.exp(jnp.clip(logp - rollout_logp, -20.0, 20.0))
    if tis_cap is not None:
        weight = jnp.minimum(weight, tis_cap)
    hit, clean = mask * affected, mask * ~affected
    per_layer = jnp.broadcast_to(mask[..., None], layers.shape).reshape(mask.shape[0], -1)
    return {
        "routing/mismatch_share": aggregate(jnp.any(layers, axis=-1).astype(jnp.float32), mask),
        "routing/layer_mismatch_share": aggregate(layers.astype(jnp.float32).reshape(per_layer.shape), per_layer),
        "routing/affected_share": aggregate(affected.astype(jnp.float32), mask),
        "routing/logprob_gap_affected": aggregate(gap, hit),
        "routing/logprob_gap_unaffected": aggregate(gap, clean),
        "routing/tis_weight_affected": aggregate(weight, hit),
        "routing/tis_weight_unaffected": aggregate(weight, clean),
    }
