"""What a rollout samples and returns: the sampling settings, the `Rollout` rows, and the per-token draw.

Per step t, with logits z_t of the last token and temperature τ > 0:
  π_t = softmax(z_t / τ) restricted to the top-k logits and then to the top-p nucleus (the smallest set of
        most likely tokens whose mass reaches p), renormalised;     y_t ~ π_t;     τ = 0: y_t = argmax z_t.
Returned log-probs are log softmax(z_t / τ)[y_t] (τ = 0: log softmax(z_t)[y_t]): the tempered distribution
before top-k/top-p truncation, i.e. the quantity a trainer recomputes from the same tokens at the same
temperature (importance ratios compare like with like).

Row r of a rollout is sample r mod n of prompt ⌊r / n⌋ (n = num_samples); its token t is drawn with the key
fold_in(fold_in(fold_in(key, ⌊r / n⌋), r mod n), t), so a row's tokens depend on the step's key, its prompt and its
sample index only — not on which engine slot decodes it, nor when (logra_jax.rollout.engine schedules the rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Static sampling settings (hashable: part of the compilation key).

    Attributes:
      max_new_tokens: N, the response budget.
      eos_id: token that ends a response (included in it).
      pad_id: token written after the end of a response.
      num_samples: n responses per prompt.
      temperature: τ; 0 means greedy decoding (top_k and top_p are then ignored).
      top_k: keep the k largest logits (0 = off).
      top_p: keep the nucleus of mass p (1.0 = off).
      slots: S, rows decoded at once by the engine (its KV cache holds S rows); a finished row's slot takes the
        next waiting row. 0: one slot per row (all rows at once).
      decode_steps: D, decode steps the engine runs between two looks at which slots finished (refills happen at
        those points).
      length_buckets: the decode step attends over the first P + ⌈N·j / length_buckets⌉ cache positions, the
        smallest j that holds every active row (one compiled decode step per bucket used).
    """

    max_new_tokens: int
    eos_id: int
    pad_id: int
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    slots: int = 0
    decode_steps: int = 8
    length_buckets: int = 4

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "num_samples", "decode_steps", "length_buckets"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SamplingConfig.{name} must be a positive integer, got {value!r}")
        for name in ("eos_id", "pad_id", "top_k", "slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SamplingConfig.{name} must be a non-negative integer, got {value!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")


class Rollout(NamedTuple):
    """Sampler output for B prompts × n samples (row b·n + j = sample j of prompt b).

    Attributes:
      tokens: [B·n, P + N] int32, the left-padded prompt followed by the response (pad_id after its end).
      prompt_mask: [B·n, P] bool, real prompt tokens (always a suffix of the row: left padding).
      response_mask: [B·n, N] bool, 1 up to and including EOS.
      logprobs: [B·n, N] float32, log softmax(z/τ) at the sampled tokens (0 outside response_mask).
      lengths: [B·n] int32, response lengths (EOS included).
      finished: [B·n] bool, the response ended with EOS (False: cut at max_new_tokens).
      experts: [B·n, P + N, MoE layers, k] (uint8 up to 256 experts, `models.moe.expert_id_dtype`), the experts
        the engine's routers chose for tokens[:, t] in each MoE layer (for routing replay); None from a dense model
        or an engine that does not record them (vLLM). Recorded where the engine ran the token: real prompt tokens
        (its prefill) and every response token but the last; 0, …, k − 1 elsewhere (padding, the last token: no
        response log-prob depends on their routing).
    """

    tokens: jax.Array
    prompt_mask: jax.Array
    response_mask: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    finished: jax.Array
    experts: jax.Array | None = None

    def attention_mask(self) -> jax.Array:
        """[B·n, P + N] bool: real prompt and response tokens (the mask for a teacher-forced forward)."""
        return jnp.concatenate([self.prompt_mask, self.response_mask], axis=1)

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Rollout:
        """The rollout an engine process sent back (its fields as host arrays, by name; `experts` optional)."""
        return cls(**{name: jnp.asarray(arrays[name]) for name in cls._fields if name in arrays or name != "experts"})


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Logits [..., V] with tokens outside the top-k and then outside the top-p nucleus set to −inf.

    Nucleus: sort probabilities p₍₁₎ ≥ p₍₂₎ ≥ …; keep token (i) iff Σ_{j<i} p₍ⱼ₎ < top_p (the most likely token is
    always kept). Tokens tied with the last kept one are kept too.

    Example:
      >>> filter_logits(jnp.log(jnp.array([0.5, 0.3, 0.2])), top_p=0.7)
      Array([-0.6931472, -1.2039728,       -inf], dtype=float32)
    """
    neg_inf = jnp.asarray(-jnp.inf, logits.dtype)
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, neg_inf)
    if top_p < 1.0:
        probs = jax.nn.softmax(logits, axis=-1)
        sorted_probs = jnp.flip(jnp.sort(probs, axis=-1), axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_probs, num_kept - 1, axis=-1)
        logits = jnp.where(probs >= threshold, logits, neg_inf)
    return logits


def row_keys(key: jax.Array, rows: jax.Array, steps: jax.Array, num_samples: int) -> jax.Array:
    """The sampling key of token `steps[i]` of rollout row `rows[i]` (see the module docstring)."""
    def one(row, t):
        prompt_key = jax.random.fold_in(key, row // num_samples)
        return jax.random.fold_in(jax.random.fold_in(prompt_key, row % num_samples), t)
    return jax.vmap(one)(rows, steps)


def sample_tokens(logits: jax.Array, keys: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """One draw per row from logits [B, V] with that row's key (keys [B]): (tokens [B] int32, log softmax(z/τ) at
    them [B] float32). τ = 0 takes the argmax and ignores the keys.

    Example:
      >>> cfg = SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0, temperature=0.0)
      >>> sample_tokens(jnp.array([[0.0, 2.0, 1.0]]), jax.random.split(jax.random.key(0), 1), cfg)[0]
      Array([1], dtype=int32)
    """
    logits = logits.astype(jnp.float32)
    if config.temperature == 0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / config.temperature
        logp = jax.nn.log_softmax(scaled, axis=-1)
        filtered = filter_logits(scaled, top_k=config.top_k, top_p=config.top_p)
        tokens = jax.vmap(lambda k, z: jax.random.categorical(k, z))(keys, filtered).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
