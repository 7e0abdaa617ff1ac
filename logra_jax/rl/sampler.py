"""Batched autoregressive sampling with the decoder's KV cache, in one jitted decode loop.

Per step t, with logits z_t of the last token and temperature τ > 0:
  π_t = softmax(z_t / τ) restricted to the top-k logits and then to the top-p nucleus (the smallest set of
        most likely tokens whose mass reaches p), renormalised;     y_t ~ π_t;     τ = 0: y_t = argmax z_t.
Returned log-probs are log softmax(z_t / τ)[y_t] (τ = 0: log softmax(z_t)[y_t]): the tempered distribution
before top-k/top-p truncation, i.e. the quantity a trainer recomputes from the same tokens at the same
temperature (importance ratios compare like with like).

Layout: prompts [B, P] (left- or right-padded, `prompt_mask` 1 = real token) are first re-packed to left padding,
prefilled once, and the cache is repeated n = num_samples times, so row b·n + j is sample j of prompt b. The
decode loop is a `lax.while_loop` over at most N = max_new_tokens steps that stops early once every row has
emitted EOS; finished rows are fed padding (masked out of attention) and emit `pad_id` with log-prob 0.
The jitted function is keyed on (graphdef, config, shapes) only: new parameters (a fresh `state`), prompts or
keys never recompile. Pad prompts to a few fixed lengths to bound the number of compilations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from logra_jax.models.decoder import KV_AXES, Decoder
from logra_jax.sharding import constrain, use_rules


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
      prompt_chunks: C, generate the B prompts in C sequential chunks of B / C (the KV cache holds one chunk).
    """

    max_new_tokens: int
    eos_id: int
    pad_id: int
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    prompt_chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "num_samples", "prompt_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SamplingConfig.{name} must be a positive integer, got {value!r}")
        for name in ("eos_id", "pad_id", "top_k"):
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
    """

    tokens: jax.Array
    prompt_mask: jax.Array
    response_mask: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    finished: jax.Array

    def attention_mask(self) -> jax.Array:
        """[B·n, P + N] bool: real prompt and response tokens (the mask for a teacher-forced forward)."""
        return jnp.concatenate([self.prompt_mask, self.response_mask], axis=1)


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


def sample_tokens(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """One draw per row from logits [B, V]: (tokens [B] int32, log softmax(z/τ) at them [B] float32).

    Example:
      >>> cfg = SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0, temperature=0.0)
      >>> sample_tokens(jnp.array([[0.0, 2.0, 1.0]]), jax.random.key(0), cfg)[0]
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
        tokens = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _left_pack(prompts: jax.Array, prompt_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Move each row's real tokens (in order) to the end of the row: any padding becomes left padding."""
    order = jnp.argsort(prompt_mask.astype(jnp.int32), axis=1, stable=True)
    return jnp.take_along_axis(prompts, order, axis=1), jnp.take_along_axis(prompt_mask, order, axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "mesh"))
def generate(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array, prompt_mask: jax.Array,
             key: jax.Array, config: SamplingConfig, mesh: Mesh | None = None) -> Rollout:
    """Sample `config.num_samples` responses per prompt (jitted; see the module docstring for the maths).

    Args:
      graphdef, state: the decoder split with `nnx.split` (pass new `state` each step without recompiling).
      prompts: [B, P] int32 token ids, left- or right-padded.
      prompt_mask: [B, P], 1 at real tokens; every row needs at least one.
      key: a PRNG key; the same key gives the same samples.
      config: static sampling settings. With prompt_chunks C > 1 the prompts are generated in C sequential chunks
        (`lax.map`, chunk c with key fold_in(key, c)), each taking B / C prompts spread over the mesh's batch
        shards, so the KV cache and decode temporaries hold one chunk; rows come back in prompt order.
      mesh: the device mesh whose logical-axis rules shard the activations and KV cache (rows over the batch
        axes, KV heads over tensor); None: no constraints.

    Returns:
      A `Rollout` with B·n rows.

    Raises:
      ValueError: B is not a multiple of config.prompt_chunks.
    """
    with contextlib.nullcontext() if mesh is None else use_rules(mesh):
        C = config.prompt_chunks
        if C == 1:
            return _generate_chunk(graphdef, state, prompts, prompt_mask, key, config)
        B = prompts.shape[0]
        if B % C:
            raise ValueError(f"generate: {B} prompts do not split into prompt_chunks = {C}")
        shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
        D = shards if (B // C) % shards == 0 else 1  # chunk c takes rows from every batch shard alike
        b, n = B // (C * D), config.num_samples
        split = lambda x: x.reshape(D, C, b, *x.shape[1:]).swapaxes(0, 1).reshape(C, D * b, *x.shape[1:])
        outs = jax.lax.map(lambda a: _generate_chunk(graphdef, state, a[1], a[2], jax.random.fold_in(key, a[0]),
                                                     config),
                           (jnp.arange(C), split(prompts), split(prompt_mask)))
        return jax.tree.map(lambda x: x.reshape(C, D, b * n, *x.shape[2:]).swapaxes(0, 1).reshape(
            B * n, *x.shape[2:]), outs)


def _generate_chunk(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array, prompt_mask: jax.Array,
                    key: jax.Array, config: SamplingConfig) -> Rollout:
    """`generate` for one chunk of prompts (traced inside it)."""
    B, P = prompts.shape
    n, N = config.num_samples, config.max_new_tokens
    prompts, prompt_mask = _left_pack(constrain(prompts.astype(jnp.int32), ("batch", "length")),
                                      constrain(prompt_mask.astype(bool), ("batch", "length")))
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(B, P + N)
    logits, cache = model.forward_cached(prompts, cache, attention_mask=prompt_mask)
    repeat = functools.partial(jnp.repeat, repeats=n, total_repeat_length=B * n)
    cache = cache._replace(k=repeat(cache.k, axis=1), v=repeat(cache.v, axis=1), valid=repeat(cache.valid, axis=0),
                           positions=repeat(cache.positions, axis=0))
    cache = cache._replace(k=constrain(cache.k, KV_AXES), v=constrain(cache.v, KV_AXES))
    last_logits = repeat(logits[:, -1], axis=0)

    def cond(carry):
        t, _, _, _, _, done, _ = carry
        return (t < N) & ~jnp.all(done)

    def body(carry):
        t, cache, logits, tokens, logprobs, done, lengths = carry
        tok, logp = sample_tokens(logits, jax.random.fold_in(key, t), config)
        active = ~done
        tok = jnp.where(active, tok, config.pad_id)
        tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, t))
        logprobs = jax.lax.dynamic_update_slice(logprobs, jnp.where(active, logp, 0.0)[:, None], (0, t))
        lengths = lengths + active.astype(jnp.int32)
        done = done | (tok == config.eos_id)
        step_logits, cache = nnx.merge(graphdef, state).forward_cached(tok[:, None], cache,
                                                                       attention_mask=active[:, None])
        return t + 1, cache, step_logits[:, 0], tokens, logprobs, done, lengths

    init = (jnp.zeros((), jnp.int32), cache, last_logits, jnp.full((B * n, N), config.pad_id, jnp.int32),
            jnp.zeros((B * n, N), jnp.float32), jnp.zeros((B * n,), bool), jnp.zeros((B * n,), jnp.int32))
    _, _, _, response, logprobs, done, lengths = jax.lax.while_loop(cond, body, init)
    return Rollout(tokens=jnp.concatenate([repeat(prompts, axis=0), response], axis=1),
                   prompt_mask=repeat(prompt_mask, axis=0), response_mask=jnp.arange(N)[None, :] < lengths[:, None],
                   logprobs=logprobs, lengths=lengths, finished=done)


class Sampler:
    """The decoder split once into (graphdef, state), sampled with `generate` under a fixed `SamplingConfig`.

    Example:
      >>> from logra_jax.models.config import preset
      >>> from logra_jax.models.decoder import init_model
      >>> sampler = Sampler(init_model(preset("tiny")), SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0))
      >>> out = sampler(jnp.array([[5, 6, 7]]), jnp.array([[1, 1, 1]]), jax.random.key(0))
      >>> out.tokens.shape, out.logprobs.shape
      ((1, 7), (1, 4))
    """

    def __init__(self, model: Decoder, config: SamplingConfig, mesh: Mesh | None = None):
        if not isinstance(config, SamplingConfig):
            raise TypeError(f"Sampler: config must be a SamplingConfig, got {type(config).__name__}")
        vocab = model.config.vocab_size
        for name in ("eos_id", "pad_id"):
            if getattr(config, name) >= vocab:
                raise ValueError(f"Sampler: SamplingConfig.{name}={getattr(config, name)} >= vocab_size={vocab}")
        self.config = config
        self.mesh = mesh  # rows and KV cache sharded by its rules (`generate`)
        self.max_seq_len = model.config.max_seq_len
        self.graphdef, self.state = nnx.split(model)

    def __call__(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                 state: nnx.State | None = None) -> Rollout:
        """Sample with the current parameters, or with `state` (same structure as `nnx.split(model)[1]`).

        Raises:
          ValueError: for non-2-D or mismatched prompts/mask, P + max_new_tokens beyond the model's max_seq_len,
            or (for concrete masks) a prompt without real tokens.
        """
        if prompts.ndim != 2 or prompt_mask.shape != prompts.shape:
            raise ValueError(f"Sampler: prompts [B, P] and prompt_mask of the same shape required, got "
                             f"{prompts.shape} and {prompt_mask.shape}")
        total = prompts.shape[1] + self.config.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"Sampler: prompt length {prompts.shape[1]} + max_new_tokens {self.config.max_new_tokens}"
                             f" = {total} exceeds the model's max_seq_len {self.max_seq_len}")
        # Nothing to inspect under a transformation, nor in a global array spanning processes (its rows were
        # checked where they were made).
        empty = np.zeros(0, int)
        if getattr(prompt_mask, "is_fully_addressable", True):
            with contextlib.suppress(jax.errors.TracerArrayConversionError):
                empty = np.flatnonzero(~np.asarray(prompt_mask).astype(bool).any(axis=1))
        if empty.size:
            raise ValueError(f"Sampler: prompt_mask rows {empty.tolist()} have no real token")
        return generate(self.graphdef, self.state if state is None else state, prompts, prompt_mask, key,
                        config=self.config, mesh=self.mesh)
