"""Per-token log-probabilities (and entropies) from hidden states, in chunks: [B, T, V] is never materialised.

For hidden states h_t [D], output head W [D, V], temperature τ and target y_t:
  z_t = h_t W / τ,     log π(y_t) = z_t[y_t] − logsumexp(z_t),     H_t = logsumexp(z_t) − Σ_v softmax(z_t)_v z_t[v].
The B·T token rows are processed `chunk` at a time under `lax.map` with `jax.checkpoint` on each chunk, so the
forward keeps one [chunk, V] block of logits live and the backward recomputes each block instead of storing it:
memory O(chunk · V + B · T · D) rather than O(B · T · V). Logits are accumulated in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from logra_jax.models.decoder import Decoder


def _chunk_stats(h: jax.Array, y: jax.Array, head: jax.Array, temperature: float, with_entropy: bool
                 ) -> tuple[jax.Array, jax.Array | None]:
    z = jnp.einsum("nd,dv->nv", h, head.astype(h.dtype), preferred_element_type=jnp.float32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0] - lse
    if not with_entropy:
        return logp, None
    return logp, lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


def token_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, temperature: float = 1.0,
                   chunk: int = 1024, with_entropy: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log softmax(h W / τ)[y] for every token, computed `chunk` token rows at a time.

    Args:
      hidden: [B, T, D] hidden states (any float dtype; the head is cast to it).
      head: [D, V] output projection.
      targets: [B, T] int token ids whose log-probabilities are wanted.
      temperature: τ > 0.
      chunk: token rows (over the flattened B·T) per chunk; B·T is padded up to a multiple.
      with_entropy: also return the entropy of softmax(z/τ) per token.

    Returns:
      [B, T] float32 log-probs, or (log-probs, entropies) when with_entropy.

    Raises:
      ValueError: for mismatched shapes, temperature <= 0 or chunk < 1.

    Example:
      >>> h, w = jnp.ones((2, 3, 4)), jnp.zeros((4, 8))
      >>> token_logprobs(h, w, jnp.zeros((2, 3), jnp.int32), chunk=4)[0, 0]  # uniform over 8 tokens
      Array(-2.0794415, dtype=float32)
    """
    if hidden.ndim != 3 or head.ndim != 2 or hidden.shape[-1] != head.shape[0]:
        raise ValueError(f"token_logprobs: need hidden [B, T, D] and head [D, V], got {hidden.shape}, {head.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"token_logprobs: targets shape {targets.shape} != hidden [B, T] {hidden.shape[:2]}")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature!r}")
    if chunk < 1:
        raise ValueError(f"token_logprobs: chunk must be >= 1, got {chunk!r}")
    B, T, D = hidden.shape
    rows = B * T
    if rows == 0:
        empty = jnp.zeros((B, T), jnp.float32)
        return (empty, empty) if with_entropy else empty
    chunk = min(chunk, rows)
    num_chunks = -(-rows // chunk)
    pad = num_chunks * chunk - rows
    h = jnp.pad(hidden.reshape(rows, D), ((0, pad), (0, 0))).reshape(num_chunks, chunk, D)
    y = jnp.pad(targets.reshape(rows).astype(jnp.int32), (0, pad)).reshape(num_chunks, chunk)
    stats = jax.checkpoint(functools.partial(_chunk_stats, temperature=temperature, with_entropy=with_entropy))
    logp, entropy = jax.lax.map(lambda xs: stats(xs[0], xs[1], head), (h, y))
    logp = logp.reshape(-1)[:rows].reshape(B, T)
    if not with_entropy:
        return logp
    return logp, entropy.reshape(-1)[:rows].reshape(B, T)


def sequence_logprobs(model: Decoder, tokens: jax.Array, attention_mask: jax.Array, *, temperature: float = 1.0,
                      chunk: int = 1024, with_entropy: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Teacher-forced log π(tokens[:, t+1] | tokens[:, ≤t]) for t < T − 1: [B, T − 1] (and entropies).

    Valid for contiguous rows such as the sampler's [left-padded prompt | response]; entries whose target is
    padding are meaningless and must be masked by the caller (e.g. with `Rollout.response_mask`).

    Example:
      >>> from logra_jax.models.config import preset
      >>> from logra_jax.models.decoder import init_model
      >>> toks = jnp.array([[3, 4, 5, 6]])
      >>> sequence_logprobs(init_model(preset("tiny")), toks, toks > 0).shape
      (1, 3)
    """
    hidden = model.features(tokens, attention_mask=attention_mask)
    return token_logprobs(hidden[:, :-1], model.head_weight(), tokens[:, 1:], temperature=temperature, chunk=chunk,
                          with_entropy=with_entropy)
