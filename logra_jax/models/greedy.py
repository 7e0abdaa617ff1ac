"""Greedy decoding for checks and demos: a small batched greedy decoder over `Decoder.forward_cached`.

Left-padded prefill, then one argmax token per step; the RL sampler (temperature, top-p, log-probs) lives in
logra_jax/rollout/sampling.py.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logra_jax.models.decoder import Decoder


def greedy_generate(model: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    stop_ids: Collection[int], pad_id: int = 0) -> list[list[int]]:
    """Greedy continuations (argmax each step) of a batch of token prompts of any lengths.

    Prompts are left-padded into one batch and prefilled with their attention mask; each step feeds the
    previous argmax. A continuation ends after its first stop id (included) or after max_new_tokens.

    Args:
      model: the decoder.
      prompts: token ids per sequence (each non-empty).
      max_new_tokens: generation budget per sequence (> 0).
      stop_ids: ids that end a continuation (e.g. tokenizer.eos_id).
      pad_id: id placed in padding slots (never attended to).

    Returns:
      The generated ids per prompt.

    Raises:
      ValueError: an empty prompt or max_new_tokens <= 0.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"greedy_generate: max_new_tokens must be > 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate: every prompt needs at least one token")
    batch, length = len(prompts), max(len(p) for p in prompts)
    tokens = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    for b, prompt in enumerate(prompts):
        tokens[b, length - len(prompt):] = prompt
        mask[b, length - len(prompt):] = True
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, mask, cache):
        logits, cache = nnx.merge(graphdef, state).forward_cached(tokens, cache, attention_mask=mask)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    @jax.jit
    def step(state, token, cache):
        logits, cache = nnx.merge(graphdef, state).forward_cached(token[:, None], cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    cache = model.init_cache(batch, length + max_new_tokens)
    token, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(mask), cache)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    stops = set(stop_ids)
    for i in range(max_new_tokens):
        host = np.asarray(token)
        for b in np.flatnonzero(~done):
            outputs[b].append(int(host[b]))
            done[b] = int(host[b]) in stops
        if done.all() or i == max_new_tokens - 1:
            break
        token, cache = step(state, token, cache)
    return outputs
