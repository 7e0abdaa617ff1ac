"""Continuous batching in fixed slots: the decode engine's scheduler (host) and its fixed-shape programs (device).

B prompts × n samples make R = B·n rows (row r = sample r mod n of prompt ⌊r / n⌋). The engine decodes S slots at
once, each holding one row's KV cache of P + N positions (prompt, then response). The host loop:
  1. refill: the free slots (all of them at the start; later once a quarter are free, or as many as rows wait)
     take the next waiting rows in order; their prompts are prefilled once each ([K, P], K = the most prompts a
     refill of S rows can touch) and each row's slot receives its prompt's keys and values (a scatter);
  2. decode: D steps over all S slots in one jitted `while_loop` (stopping early once every slot is done), each
     active slot drawing its row's token t with the key of (step key, prompt, sample, t) (logra_jax.rollout.
     sampling), writing token and log-prob into the output rows, and ending at EOS or N tokens;
  3. repeat until every row is done.
Every array has a fixed shape (S, K, R, N, P are static), so each program compiles once, and the decode step of a
length bucket once: attention reads only the first P + ⌈N·j / length_buckets⌉ cache positions (the smallest bucket
holding every active row's next D tokens), sliced out of the cache once per D steps. The host reads only S flags and
counters per D steps (all processes read the same replicated values, so the schedule is the same everywhere).
Because a row's draws do not depend on its slot, the result does not depend on S, D or the bucket: with S = R every
row starts at once, as in a classic batched sampler.
An MoE model's rows also record the experts each token was routed to (`Rollout.experts`, [R, P + N, MoE layers, k]
uint8 up to 256 experts; 384 bytes per token at Qwen3-30B-A3B's 48 layers × top-8): the prefill's for the prompt
(written to each row its refill starts), each decode step's for the token it feeds; the trainer replays or
compares them (logra_jax.rl.routing).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from logra_jax.models.config import ModelConfig
from logra_jax.models.decoder import Decoder, KVCache, constrain_kv
from logra_jax.models.moe import expert_id_dtype
from logra_jax.parallel.multihost import host_array
from logra_jax.parallel.sharding import constrain, use_rules
from logra_jax.rollout.sampling import Rollout, SamplingConfig, row_keys, sample_tokens

REFILL_FRACTION = 0.25  # refill once this share of the slots is free (each refill costs a [K, P] prefill)
# Logical axes of the recorded expert ids [R, P + N, MoE layers, k]: rows over the batch axes, like the rollout's.
EXPERT_AXES = ("batch", None, None, None)


class Slots(NamedTuple):
    """The engine's device state: S slots and the R output rows.

    cache: the slots' KV cache ([L, S, P + N, Hkv, hd], per-slot write index); logits: [S, V] float32, each slot's
    next-token logits; row: [S] int32, the row a slot decodes (−1: never filled); t: [S] int32, tokens that row has
    produced; done: [S] bool, slot idle (row finished, or never filled). tokens / logprobs: [R, N] by row;
    lengths: [R] int32; finished: [R] bool (ended with EOS); experts: [R, P + N, MoE layers, k] by row, the
    experts each token's routers chose (`Rollout.experts`; None for a dense model)."""

    cache: KVCache
    logits: jax.Array
    row: jax.Array
    t: jax.Array
    done: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    finished: jax.Array
    experts: jax.Array | None = None


def unrecorded_experts(config: ModelConfig, shape: tuple[int, ...]) -> jax.Array:
    """Expert ids [*shape, MoE layers, k] for tokens the engine did not run (padding, a response's last token):
    0, …, k − 1 in every layer, in `moe.expert_id_dtype` (no response log-prob depends on their routing)."""
    k, layers = config.experts_per_token, config.num_layers // config.moe_layer_step
    ids = jnp.arange(k, dtype=expert_id_dtype(config.num_experts))
    return jnp.broadcast_to(ids, (*shape, layers, k))


def left_pack(prompts: jax.Array, prompt_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Move each row's real tokens (in order) to the end of the row: any padding becomes left padding."""
    order = jnp.argsort(prompt_mask.astype(jnp.int32), axis=1, stable=True)
    return jnp.take_along_axis(prompts, order, axis=1), jnp.take_along_axis(prompt_mask, order, axis=1)


def _rules(mesh: Mesh | None):
    return contextlib.nullcontext() if mesh is None else use_rules(mesh)


def init_slots(model: Decoder, prompt_len: int, config: SamplingConfig, num_slots: int, rows: int) -> Slots:
    """Empty slots (all idle) and output rows filled with pad_id / 0 (traced inside the engine's first program)."""
    N = config.max_new_tokens
    cache = model.init_cache(num_slots, prompt_len + N)
    experts = (constrain(unrecorded_experts(model.config, (rows, prompt_len + N)), EXPERT_AXES)
               if model.config.moe else None)
    return Slots(cache=cache, logits=jnp.zeros((num_slots, model.config.vocab_size), jnp.float32),
                 row=jnp.full((num_slots,), -1, jnp.int32), t=jnp.zeros((num_slots,), jnp.int32),
                 done=jnp.ones((num_slots,), bool), tokens=jnp.full((rows, N), config.pad_id, jnp.int32),
                 logprobs=jnp.zeros((rows, N), jnp.float32), lengths=jnp.zeros((rows,), jnp.int32),
                 finished=jnp.zeros((rows,), bool), experts=experts)


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "num_slots", "mesh"))
def start(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array, prompt_mask: jax.Array, *,
           config: SamplingConfig, num_slots: int, mesh: Mesh | None) -> tuple[Slots, jax.Array, jax.Array]:
    """Idle slots, empty output rows, and the prompts left-packed (int32, bool)."""
    with _rules(mesh):
        prompts, prompt_mask = left_pack(constrain(prompts.astype(jnp.int32), ("batch", "length")),
                                         constrain(prompt_mask.astype(bool), ("batch", "length")))
        rows = prompts.shape[0] * config.num_samples
        slots = init_slots(nnx.merge(graphdef, state), prompts.shape[1], config, num_slots, rows)
        return slots, prompts, prompt_mask


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "mesh"), donate_argnums=(2,))
def refill(graphdef: nnx.GraphDef, state: nnx.State, slots: Slots, prompts: jax.Array, prompt_mask: jax.Array,
            prompt_ids: jax.Array, src: jax.Array, dest: jax.Array, new_rows: jax.Array, *, config: SamplingConfig,
            mesh: Mesh | None) -> Slots:
    """Prefill prompts[prompt_ids] ([K, P], left-packed) once each, then give slot dest[i] the prompt src[i]'s
    cache and logits and the row new_rows[i] (lanes with dest[i] = S write nothing); an MoE model's rows
    new_rows[i] record the experts the prefill chose for their prompt's real tokens."""
    with _rules(mesh):
        model = nnx.merge(graphdef, state)
        K, P = prompt_ids.shape[0], prompts.shape[1]
        cache = model.init_cache(K, P)
        real = prompt_mask[prompt_ids]
        logits, cache, ids = model.routed_forward_cached(prompts[prompt_ids], cache, attention_mask=real)
        experts = slots.experts
        if experts is not None:
            ids = jnp.where(real[:, :, None, None], ids.astype(experts.dtype), unrecorded_experts(model.config,
                                                                                                (K, P)))
            rows = jnp.where(dest < slots.row.shape[0], new_rows, experts.shape[0])  # idle lanes write nowhere
            experts = constrain(experts.at[rows, :P].set(ids[src], mode="drop"), EXPERT_AXES)
        total = slots.cache.valid.shape[1]
        put = lambda buf, new: buf.at[dest].set(new[src].astype(buf.dtype), mode="drop")

        def put_kv(buf, new):  # stacked [L, S, P + N, ...] or per-layer buffers [S, Hkv, P + N, hd]
            if isinstance(buf, tuple):
                return tuple(b.at[dest, :, :P].set(n[src].astype(b.dtype), mode="drop") for b, n in zip(buf, new))
            return buf.at[:, dest, :P].set(new[:, src].astype(buf.dtype), mode="drop")

        valid = jnp.concatenate([cache.valid, jnp.zeros((K, total - P), bool)], axis=1)
        lane = jnp.arange(dest.shape[0])
        c = slots.cache
        new_cache = KVCache(k=constrain_kv(put_kv(c.k, cache.k)), v=constrain_kv(put_kv(c.v, cache.v)),
                            valid=put(c.valid, valid), positions=put(c.positions, cache.positions),
                            index=put(c.index, jnp.full((K,), P, jnp.int32)))
        return slots._replace(cache=new_cache, logits=put(slots.logits, logits[:, -1]), experts=experts,
                              row=slots.row.at[dest].set(new_rows, mode="drop"),
                              t=slots.t.at[dest].set(jnp.zeros_like(lane), mode="drop"),
                              done=slots.done.at[dest].set(jnp.zeros(lane.shape, bool), mode="drop"))


def _decode(graphdef: nnx.GraphDef, state: nnx.State, slots: Slots, key: jax.Array, *, config: SamplingConfig,
            bucket: int, mesh: Mesh | None) -> Slots:
    """Up to config.decode_steps decode steps over every slot, attending over the first `bucket` positions."""
    with _rules(mesh):
        model = nnx.merge(graphdef, state)
        full = slots.cache
        per_layer = isinstance(full.k, tuple)  # read in place up to the bucket (Attention); stacked: a window
        window = full._replace(valid=full.valid[:, :bucket]) if per_layer else full._replace(
            k=full.k[:, :, :bucket], v=full.v[:, :, :bucket], valid=full.valid[:, :bucket])
        R, N = slots.tokens.shape

        def cond(carry):
            i, s = carry
            return (i < config.decode_steps) & ~jnp.all(s.done)

        def body(carry):
            i, s = carry
            active = ~s.done
            tok, logp = sample_tokens(s.logits, row_keys(key, s.row, s.t, config.num_samples), config)
            tok = jnp.where(active, tok, config.pad_id)
            out_row = jnp.where(active, s.row, R)  # idle slots write nowhere (dropped)
            ended = active & ((tok == config.eos_id) | (s.t + 1 >= N))
            s = s._replace(tokens=s.tokens.at[out_row, s.t].set(tok, mode="drop"),
                           logprobs=s.logprobs.at[out_row, s.t].set(logp, mode="drop"),
                           lengths=s.lengths.at[out_row].set(s.t + 1, mode="drop"),
                           finished=s.finished.at[out_row].set(tok == config.eos_id, mode="drop"),
                           t=s.t + active.astype(jnp.int32), done=s.done | ended)
            logits, cache, ids = model.routed_forward_cached(tok[:, None], s.cache,
                                                             attention_mask=(~s.done)[:, None])
            cache = cache._replace(k=constrain_kv(cache.k), v=constrain_kv(cache.v))
            if s.experts is not None:  # the token just fed, response token t − 1 at position P + t − 1
                fed_row = jnp.where(~s.done, s.row, R)
                P = s.experts.shape[1] - N
                experts = s.experts.at[fed_row, P + s.t - 1].set(ids[:, 0].astype(s.experts.dtype), mode="drop")
                s = s._replace(experts=constrain(experts, EXPERT_AXES))
            return i + 1, s._replace(cache=cache, logits=logits[:, 0])

        _, out = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), slots._replace(cache=window)))
        w = out.cache
        valid = jax.lax.dynamic_update_slice_in_dim(full.valid, w.valid, 0, 1)
        cache = w._replace(valid=valid) if per_layer else w._replace(
            k=jax.lax.dynamic_update_slice_in_dim(full.k, w.k, 0, 2),
            v=jax.lax.dynamic_update_slice_in_dim(full.v, w.v, 0, 2), valid=valid)
        return out._replace(cache=cache)


_DECODE_JIT = dict(static_argnames=("graphdef", "config", "bucket", "mesh"), donate_argnums=(2,))
decode = jax.jit(_decode, **_DECODE_JIT)
# The GPU engine's program (per-layer weights and KV cache, `ModelConfig.decode_unroll`, which XLA:GPU reads in
# place) compiles without XLA:GPU's dot merger. The merger joins the dots that share an input (a layer's gate and
# up projections; q, k and v) into one GEMM over the weights concatenated: at Qwen2.5-72B's widths on 8 × H100 it
# copies the weights to concatenate them (a decode step 57.98 GB per device against 38.98 GB without it), while on
# the other five planned H100 cells it changes a step's bytes by −3.3% to +0.4% (`experiments/rollout/README.md`).
GPU_DECODE_OPTIONS = {"xla_disable_hlo_passes": "dot-merger"}
decode_gpu = jax.jit(_decode, compiler_options=GPU_DECODE_OPTIONS, **_DECODE_JIT)


def decode_program(slots: Slots):
    """The jitted decode chunk (`decode`'s signature) for these slots: `decode_gpu` for a per-layer cache (the
    engine's layout on GPUs, `ModelConfig.decode_unroll`), else `decode`."""
    return decode_gpu if isinstance(slots.cache.k, tuple) else decode


@functools.partial(jax.jit, static_argnames=("config",))
def finish(slots: Slots, prompts: jax.Array, prompt_mask: jax.Array, *, config: SamplingConfig) -> Rollout:
    n, N = config.num_samples, config.max_new_tokens
    repeat = functools.partial(jnp.repeat, repeats=n, total_repeat_length=prompts.shape[0] * n, axis=0)
    return Rollout(tokens=jnp.concatenate([repeat(prompts), slots.tokens], axis=1), prompt_mask=repeat(prompt_mask),
                   response_mask=jnp.arange(N)[None, :] < slots.lengths[:, None], logprobs=slots.logprobs,
                   lengths=slots.lengths, finished=slots.finished, experts=slots.experts)


def num_slots(config: SamplingConfig, rows: int) -> int:
    """S: config.slots, at most one per row (0: one per row)."""
    return min(config.slots or rows, rows)


def prefill_lanes(config: SamplingConfig, prompts: int, rows: int) -> int:
    """K: the most prompts a refill of S consecutive rows can touch (its prefill batch)."""
    n = config.num_samples
    return min(prompts, -(-num_slots(config, rows) // n) + (1 if n > 1 else 0))


def bucket_length(config: SamplingConfig, prompt_len: int, longest: int) -> int:
    """Cache positions a decode chunk attends over when the furthest active row has produced `longest` tokens:
    P + ⌈N·j / length_buckets⌉ for the smallest j holding its next decode_steps tokens."""
    N, J = config.max_new_tokens, config.length_buckets
    need = min(longest + config.decode_steps, N)
    j = min(J, -(-need * J // N))
    return prompt_len + -(-N * j // J)


def generate(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array, prompt_mask: jax.Array,
             key: jax.Array, config: SamplingConfig, mesh: Mesh | None = None) -> Rollout:
    """Sample config.num_samples responses per prompt with continuous batching in config.slots slots.

    Args:
      graphdef, state: the decoder split with `nnx.split` (the engine's weights).
      prompts: [B, P] int32 token ids, left- or right-padded.
      prompt_mask: [B, P], 1 at real tokens; every row needs at least one.
      key: the step's PRNG key; row r's tokens depend only on (key, prompt, sample), not on the schedule.
      config: static sampling and scheduling settings.
      mesh: the mesh whose logical-axis rules shard the slots (over the batch axes) and the KV heads (tensor).

    Returns:
      A `Rollout` with B·n rows in row order.
    """
    B, P = prompts.shape
    n = config.num_samples
    R, S = B * n, num_slots(config, B * n)
    K = prefill_lanes(config, B, R)
    slots, prompts, prompt_mask = start(graphdef, state, prompts, prompt_mask, config=config, num_slots=S,
                                         mesh=mesh)
    step = decode_program(slots)
    waiting, done, t = 0, np.ones(S, bool), np.zeros(S, np.int64)
    while True:
        free = np.flatnonzero(done)
        if waiting < R and free.size >= min(max(1, int(S * REFILL_FRACTION)), R - waiting):
            dest = free[:R - waiting]
            rows = np.arange(waiting, waiting + dest.size)
            waiting += dest.size
            first = rows[0] // n
            ids = np.minimum(first + np.arange(K), B - 1)
            pad = lambda a, fill: np.concatenate([a, np.full(S - a.size, fill)]).astype(np.int32)
            slots = refill(graphdef, state, slots, prompts, prompt_mask, jnp.asarray(ids, jnp.int32),
                            jnp.asarray(pad(rows // n - first, 0)), jnp.asarray(pad(dest, S)),
                            jnp.asarray(pad(rows, -1)), config=config, mesh=mesh)
            done[dest], t[dest] = False, 0
        if done.all():
            break
        bucket = bucket_length(config, P, int(t[~done].max()))
        slots = step(graphdef, state, slots, key, config=config, bucket=bucket, mesh=mesh)
        done, t = np.array(host_array(slots.done)), np.array(host_array(slots.t))  # copies: refills write them
    return finish(slots, prompts, prompt_mask, config=config)


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
        self.mesh = mesh  # slots and KV cache sharded by its rules
        self.max_seq_len = model.config.max_seq_len
        self.graphdef, self.state = nnx.split(model)

    def __call__(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                 state: nnx.State | None = None, config: SamplingConfig | None = None) -> Rollout:
        """Sample with the current parameters, or with `state` (same structure as `nnx.split(model)[1]`), under
        the sampler's config or `config`.

        Raises:
          ValueError: for non-2-D or mismatched prompts/mask, P + max_new_tokens beyond the model's max_seq_len,
            or (for concrete masks) a prompt without real tokens.
        """
        if prompts.ndim != 2 or prompt_mask.shape != prompts.shape:
            raise ValueError(f"Sampler: prompts [B, P] and prompt_mask of the same shape required, got "
                             f"{prompts.shape} and {prompt_mask.shape}")
        config = config or self.config
        total = prompts.shape[1] + config.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"Sampler: prompt length {prompts.shape[1]} + max_new_tokens {config.max_new_tokens}"
                             f" = {total} exceeds the model's max_seq_len {self.max_seq_len}")
        # A global array spanning processes: its rows were checked where they were made.
        if getattr(prompt_mask, "is_fully_addressable", True):
            empty = np.flatnonzero(~np.asarray(prompt_mask).astype(bool).any(axis=1))
            if empty.size:
                raise ValueError(f"Sampler: prompt_mask rows {empty.tolist()} have no real token")
        return generate(self.graphdef, self.state if state is None else state, prompts, prompt_mask, key,
                        config=config, mesh=self.mesh)
