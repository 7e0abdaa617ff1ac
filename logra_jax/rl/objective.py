"""The policy-gradient objective on a batch of rollouts, as a loss function for logra_jax.job.train_step.

Batch fields (rows = responses, fixed prompt length P):
  tokens [N, P + G] int32 ([left-padded prompt | response]), attention_mask [N, P + G],
  response_mask [N, G], advantages [N], rollout_logprobs [N, G] (the sampler's log μ), finished [N],
  and ref_logprobs [N, G] when a reference-KL penalty is used; for an MoE model served by the JAX engine, experts
  [N, P + G, MoE layers, k] (`Rollout.experts`: the experts the engine chose for each token).
The trainer's log π_θ of the response tokens comes from chunked log-probs at the sampling temperature (the
[N, G, V] logits are never materialised whole). With routing replay the trainer's MoE layers route each token by
the engine's experts (`Decoder.routed_features`); with experts in the batch, replayed or not, the step reports the
routing mismatch (`logra_jax.rl.routing`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logra_jax.rl.logprobs import token_logprobs
from logra_jax.rl.losses import (
    LOSS_DENOMINATOR,
    LossConfig,
    aggregate,
    aggregation_denominator,
    kl_penalty,
    policy_loss,
)
from logra_jax.rl.routing import routing_metrics


def rl_batch_shapes(rows: int, prompt_length: int, new_tokens: int, *, with_ref: bool = False,
                    experts: tuple[int, int, jnp.dtype] | None = None,
                    with_tis_cap: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch this objective reads, as ShapeDtypeStructs (fixed per run: shardings and compile-only analysis
    are built from it). `with_ref`: include ref_logprobs (reference-KL penalty); experts: (MoE layers, k, dtype)
    of the engine's recorded expert ids, included when given; with_tis_cap: tis_cap [N], each row's cap of its
    importance weights (a stale batch's lower cap, `policy_loss`'s tis_cap_rows)."""
    sds, length = jax.ShapeDtypeStruct, prompt_length + new_tokens
    batch = {"tokens": sds((rows, length), jnp.int32), "attention_mask": sds((rows, length), jnp.bool_),
             "response_mask": sds((rows, new_tokens), jnp.bool_), "advantages": sds((rows,), jnp.float32),
             "rollout_logprobs": sds((rows, new_tokens), jnp.float32), "finished": sds((rows,), jnp.bool_)}
    if with_ref:
        batch["ref_logprobs"] = sds((rows, new_tokens), jnp.float32)
    if experts is not None:
        layers, k, dtype = experts
        batch["experts"] = sds((rows, length, layers, k), dtype)
    if with_tis_cap:
        batch["tis_cap"] = sds((rows,), jnp.float32)
    return batch


def probe_batch_shapes(rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The predicted-KL probe batch a KL-controlled step reads (`probe=`), as ShapeDtypeStructs: `rows` whole
    sequences of `length` tokens with their attention mask and the mask of the positions whose logits are probed."""
    sds = jax.ShapeDtypeStruct
    return {"tokens": sds((rows, length), jnp.int32), "attention_mask": sds((rows, length), jnp.bool_),
            "kl_mask": sds((rows, length), jnp.bool_)}


def probe_rows(prompts: int, num_samples: int, count: int, seed: int | tuple[int, ...]) -> np.ndarray:
    """Rows of a rollout (row b·n + j = sample j of prompt b) for the predicted-KL probe: `count` responses
    spread over min(count, prompts) distinct prompts (docs/method.md §5: several samples of one prompt are not a
    representative probe), deterministic given `seed` (an int or a tuple such as (run seed, step)).

    The prompts are evenly spaced over the batch from a seeded offset; each gets a seeded sample. With count >
    prompts, further rounds take other samples of the same prompts, every prompt once per round.

    Example:
      >>> rows = probe_rows(prompts=16, num_samples=16, count=8, seed=3)
      >>> len(set(rows // 16))
      8
    """
    for name, value in (("prompts", prompts), ("num_samples", num_samples), ("count", count)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"probe_rows: {name} must be an integer >= 1, got {value!r}")
    if count > prompts * num_samples:
        raise ValueError(f"probe_rows: count={count} exceeds the rollout's {prompts} × {num_samples} responses")
    rng = np.random.default_rng(seed)
    start = int(rng.integers(prompts))
    spread = min(count, prompts)
    order = [(start + (i * prompts) // spread) % prompts for i in range(spread)]
    spread_set = set(order)
    order += [b for b in range(prompts) if b not in spread_set]  # the remaining prompts, for later rounds
    samples = np.stack([rng.permutation(num_samples) for _ in range(prompts)])  # [prompts, n]
    rows = [b * num_samples + int(samples[b, r]) for r in range(-(-count // prompts)) for b in order]
    return np.asarray(rows[:count], np.int64)


def response_logprobs(model: nnx.Module, tokens: jax.Array, attention_mask: jax.Array, prompt_length: int, *,
                      temperature: float = 1.0, chunk: int = 1024, with_entropy: bool = False,
                      experts: jax.Array | None = None):
    """log softmax(z/τ) of the response tokens tokens[:, P:] given everything before them: [N, G] (+ entropy);
    experts: replayed expert ids [N, P + G, MoE layers, k] (`routed_response_logprobs`)."""
    return routed_response_logprobs(model, tokens, attention_mask, prompt_length, temperature=temperature,
                                    chunk=chunk, with_entropy=with_entropy, experts=experts)[0]


def routed_response_logprobs(model: nnx.Module, tokens: jax.Array, attention_mask: jax.Array, prompt_length: int,
                             *, temperature: float = 1.0, chunk: int = 1024, with_entropy: bool = False,
                             experts: jax.Array | None = None):
    """(`response_logprobs`, the trainer's own expert ids [N, P + G, MoE layers, k] int32 or None for a dense
    model): the forward routes by `experts` when given (routing replay, `Decoder.routed_features`)."""
    hidden, ids = model.routed_features(tokens, attention_mask=attention_mask, experts=experts)
    stats = token_logprobs(hidden[:, prompt_length - 1:-1], model.head_weight(), tokens[:, prompt_length:],
                           temperature=temperature, chunk=chunk, with_entropy=with_entropy)
    return stats, ids


def make_policy_loss_fn(config: LossConfig, prompt_length: int, *, temperature: float = 1.0, chunk: int = 1024,
                        routing_replay: bool = False):
    """loss_fn(model, batch) -> (policy loss, metrics) for `make_train_step`.

    Metrics (token means over responses): pg_loss, clip_fraction, tis_weight, tis_capped, kl (with a reference),
    entropy, behaviour_kl (KL(μ ‖ π_θ) between the policy μ that sampled the batch and the one trained, by the
    k3 estimator r − 1 − log r, r = π_θ / μ: engine/trainer mismatch plus any staleness of the batch), and
    rollout_mismatch = mean over tokens of completed responses of (log μ − log π_θ) clipped at 0 — the
    measured rollout-vs-trainer gap that `scale_by_predicted_kl` can subtract from its budget; with
    batch["experts"] the routing metrics `logra_jax.rl.routing.ROUTING_METRICS`. routing_replay: the forward
    routes every token by batch["experts"] (which it then needs).
    The aggregation's normaliser is returned as train_step.LOSS_DENOMINATOR, so a microbatched step normalises
    once by the whole batch's (every microbatch, every data-parallel replica): the same loss and gradient
    whatever the number of microbatches.
    """
    if prompt_length < 1:
        raise ValueError(f"make_policy_loss_fn: prompt_length must be >= 1, got {prompt_length}")

    def loss_fn(model: nnx.Module, batch: Mapping[str, jax.Array]):
        engine_ids = batch.get("experts")
        if routing_replay and engine_ids is None:
            raise ValueError("make_policy_loss_fn: routing_replay needs batch['experts'] (the engine's expert ids)")
        (logp, entropy), own_ids = routed_response_logprobs(
            model, batch["tokens"], batch["attention_mask"], prompt_length, temperature=temperature, chunk=chunk,
            with_entropy=True, experts=engine_ids if routing_replay else None)
        mask = batch["response_mask"].astype(jnp.float32)
        loss, metrics = policy_loss(
            logp, batch["advantages"], mask, config=config,
            rollout_logp=batch["rollout_logprobs"] if config.tis_cap is not None else None,
            ref_logp=batch.get("ref_logprobs"), tis_cap_rows=batch.get("tis_cap"))
        completed = mask * batch["finished"].astype(jnp.float32)[:, None]
        gap = aggregate(jax.lax.stop_gradient(batch["rollout_logprobs"] - logp), completed)
        metrics = dict(metrics)
        metrics["entropy"] = jax.lax.stop_gradient(aggregate(entropy, mask))
        metrics["rollout_mismatch"] = jnp.maximum(gap, 0.0)
        metrics["behaviour_kl"] = aggregate(jax.lax.stop_gradient(kl_penalty(
            batch["rollout_logprobs"], logp, mask, estimator="k3", clamp=None)), mask)
        if engine_ids is not None:
            if own_ids is None:
                raise ValueError("make_policy_loss_fn: batch['experts'] given to a dense model (no router)")
            metrics.update(routing_metrics(engine_ids, own_ids, batch["attention_mask"][:, :prompt_length],
                                           batch["response_mask"], logp, batch["rollout_logprobs"],
                                           config.tis_cap))
        metrics[LOSS_DENOMINATOR] = aggregation_denominator(mask, config.aggregation, max_len=config.max_len)
        return loss, metrics

    return loss_fn
