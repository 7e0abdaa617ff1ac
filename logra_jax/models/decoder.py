"""The decoder-only transformer (Llama / Qwen2 / SmolLM2 / Qwen3 / Gemma 3) as a Flax NNX module.

Layers are stacked on a leading "layers" axis and run with `lax.scan` (one compiled block whatever the depth),
optionally rematerialised per block. `model(tokens)` returns float32 logits [B, T, V]; `forward_cached` runs
prefill and incremental decoding against a `KVCache` for batches of prompts of different lengths. An MoE model's
`routed_features` / `routed_forward_cached` also return the experts each router chose per token, and `experts=`
routes every MoE layer by given ids instead (routing replay, `logra_jax.models.moe.route`).

Parameter paths (canonical, "."-joined): embed.embedding [V, D]; blocks.attn_norm.scale [L, D];
blocks.attn.{q,k,v,o}_proj.kernel [L, in, out] (+ .bias for Qwen2 q/k/v); blocks.attn.{q,k}_norm.scale [L, hd]
(Qwen3, Gemma 3); blocks.post_attn_norm.scale [L, D] (Gemma 3); blocks.mlp_norm.scale [L, D];
blocks.mlp.{gate,up,down}_proj.kernel [L, in, out]; blocks.post_mlp_norm.scale [L, D] (Gemma 3);
final_norm.scale [D]; lm_head.kernel [D, V] when untied. Under `ModelConfig.decode_unroll` (the GPU rollout
engine's layout) the blocks are one module per layer: blocks.{i}.<path> holds layer i of blocks.<path>, without
the L axis (`layer_source`, `per_layer_state`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from logra_jax.core.tree_paths import flat_params, path_str
from logra_jax.models.config import ModelConfig
from logra_jax.models.layers import MLP, Attention, Linear, RMSNorm, write_rows
from logra_jax.models.moe import MoE
from logra_jax.parallel.sharding import constrain, param_shardings

# Logical axes of the cache's k / v [L, B, S, Hkv, hd]: rows over the batch axes, KV heads over tensor.
KV_AXES = ("layers", "batch", "length", "act_kv_heads", None)
# A per-layer cache's buffers [B, Hkv, S, hd]: heads before positions, the layout a decode step's batched attention
# reads in place (stored [B, S, Hkv, hd], XLA:GPU transposes every buffer into and out of the decode loop).
KV_LAYER_AXES = ("batch", "act_kv_heads", "length", None)


def constrain_kv(kv: jax.Array | tuple[jax.Array, ...]) -> jax.Array | tuple[jax.Array, ...]:
    """A cache's k or v (stacked, or a per-layer tuple) constrained to `KV_AXES`."""
    if isinstance(kv, tuple):
        return tuple(constrain(x, KV_LAYER_AXES) for x in kv)
    return constrain(kv, KV_AXES)


class KVCache(NamedTuple):
    """Decoding state. k, v: [L, B, S, Hkv, hd], or (a per-layer cache, `ModelConfig.decode_unroll`) tuples of L
    buffers [B, Hkv, S, hd]; valid: [B, S] slots holding real tokens;
    positions: [B] next RoPE position per sequence; index: [B] next slot to write, per sequence (a continuous-
    batching engine refills one row's slots while the others go on)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    positions: jax.Array
    index: jax.Array


class Block(nnx.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); y = h + mlp(norm(h)). With config.post_norms (Gemma 3) the
    attention and MLP outputs are normed too: h = x + norm(attn(norm(x))); y = h + norm(mlp(norm(h))). With
    config.num_experts the MLP is a mixture of experts (`logra_jax.models.moe.MoE`)."""

    def __init__(self, config: ModelConfig, *, stack: int | None = None, moe: bool | None = None,
                 rngs: nnx.Rngs):
        """moe: whether the MLP is a mixture of experts (default: config.moe)."""
        moe = config.moe if moe is None else moe
        norm = functools.partial(RMSNorm, config.hidden_size, config.rms_norm_eps, offset=config.norm_offset,
                                 stack=stack)
        self.attn_norm = norm()
        self.attn = Attention(config, stack=stack, rngs=rngs)
        self.post_attn_norm = norm() if config.post_norms else None
        self.mlp_norm = norm()
        self.mlp = MoE(config, stack=stack, rngs=rngs) if moe else MLP(config, stack=stack, rngs=rngs)
        self.post_mlp_norm = norm() if config.post_norms else None

    def __call__(self, x, positions, q_slots, key_valid, cache=None, write_index=None, layer=None, replay=None):
        """(y, cache, routing): routing = (router logits [B, T, E], the router's own top-k ids [B, T, k]) of an MoE
        block, else None. replay: expert ids [B, T, k] the MoE routes by instead of its own (routing replay)."""
        h, cache = self.attn(self.attn_norm(x), positions, q_slots, key_valid, cache, write_index, layer)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = constrain(x + h, ("batch", "length", "act_embed"))
        routing = None
        if isinstance(self.mlp, MoE):
            h, logits, ids = self.mlp.routed(self.mlp_norm(x), replay)
            routing = (logits, ids)
        else:
            h = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        x = constrain(x + h, ("batch", "length", "act_embed"))
        return x, cache, routing


_REMAT_POLICIES = {
    "full": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # LoGRA sketch-native: keep each target's projected input X Aᵀ ([T, r], named by the sketched linear),
    # recompute everything else: the backward pass then needs no second projection of X.
    "save_sketch": jax.checkpoint_policies.save_only_these_names("sketch_projection"),
}


class Decoder(nnx.Module):
    """Decoder-only transformer. Call on int32 tokens [B, T] to get float32 logits [B, T, V]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))
        self.embed.embedding.set_metadata("axes", ("vocab", "embed"))
        # One stacked Block scanned over layers; under decode_unroll (the GPU engine) one Block per layer, so that a
        # decode step reads each layer's weights in place (XLA:GPU copies a loop's static slices of a stack out).
        # With dense layers among MoE ones (moe_layer_step > 1): the dense layers stacked in `blocks`, the MoE ones
        # in `moe_blocks`, scanned a group of moe_layer_step layers at a time.
        step = c.moe_layer_step
        if c.decode_unroll and step > 1:
            raise ValueError(f"Decoder: decode_unroll is not supported with ModelConfig.moe_layer_step={step}")
        self.blocks = (nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)]) if c.decode_unroll
                       else Block(c, stack=c.num_layers - c.num_layers // step, moe=False, rngs=rngs) if step > 1
                       else Block(c, stack=c.num_layers, rngs=rngs))
        self.moe_blocks = Block(c, stack=c.num_layers // step, rngs=rngs) if step > 1 else None
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.norm_offset)
        self.lm_head = None if c.tie_embeddings else Linear(
            c.hidden_size, c.vocab_size, axes=("embed", "vocab"), rngs=rngs)
        if c.param_dtype != "float32":
            cast_matrices(self, c.param_dtype)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.config.dtype)

    def head_weight(self) -> jax.Array:
        """The output projection [D, V] (the transposed embedding when tied), float32."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def _run_blocks(self, x, positions, q_slots, key_valid, cache: KVCache | None, experts: jax.Array | None = None):
        """(x, the new cache's (k, v) or None, routing of an MoE model or None: (router logits [L', B, T, E], the
        routers' own top-k ids [L', B, T, k]) over its L' = L / moe_layer_step MoE layers).

        experts: [B, T, L', k] expert ids to route by (routing replay), MoE layer j's ids experts[:, :, j]; each
        layer (or group) of the scan takes its own [B, T, k] slice, nothing wider is formed."""
        c = self.config
        if experts is not None:
            moe_layers = c.num_layers // c.moe_layer_step if c.moe else 0
            want = (*x.shape[:2], moe_layers, c.experts_per_token)
            if not c.moe or experts.shape != want:
                raise ValueError(f"Decoder: experts (replayed expert ids) must be [B, T, MoE layers, k] = {want} "
                                 f"for architecture={c.architecture!r}, got {experts.shape}")
            experts = jnp.moveaxis(experts, 2, 0)  # [L', B, T, k]: the scan's per-layer slices
        if c.decode_unroll:
            # The layers unrolled, each reading its own weights and its own k, v buffers (a per-layer cache) in place.
            ks, vs, routings = [], [], []
            for layer, block in enumerate(self.blocks):
                kv = None if cache is None else (cache.k[layer], cache.v[layer])
                replay = None if experts is None else experts[layer]
                x, kv, routing = block(x, positions, q_slots, key_valid, kv, None if cache is None else cache.index,
                                       layer, replay)
                routings.append(routing)
                if kv is not None:
                    ks.append(kv[0])
                    vs.append(kv[1])
            routing = jax.tree.map(lambda *a: jnp.stack(a), *routings) if c.moe else None
            return x, None if cache is None else (tuple(ks), tuple(vs)), routing

        if self.moe_blocks is not None:
            return self._run_groups(x, positions, q_slots, key_valid, cache, experts)
        graphdef, state = nnx.split(self.blocks)
        # The cache [L, B, S, Hkv, hd] rides in the carry: each layer scatters its new rows into it in place and
        # reads its own slice (no per-layer copy of the cache in or out of the scan).
        def body(carry, xs):
            h, stacks = carry
            layer_state, layer, replay = xs
            block = nnx.merge(graphdef, layer_state)
            index = None if cache is None else cache.index
            h, stacks, routing = block(h, positions, q_slots, key_valid, stacks, index, layer, replay)
            return (h, stacks), routing

        if c.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[c.remat], prevent_cse=False)
        stacks = None if cache is None else (cache.k, cache.v)
        (x, stacks), routing = jax.lax.scan(body, (x, stacks), (state, jnp.arange(c.num_layers), experts))
        return x, stacks, routing

    def _run_groups(self, x, positions, q_slots, key_valid, cache: KVCache | None, experts: jax.Array | None):
        """`_run_blocks` with moe_layer_step = s > 1: a scan over the L / s groups of layers g·s … g·s + s − 1, each
        s − 1 dense layers (`blocks`, stacked [L − L/s]) and then one MoE layer (`moe_blocks`, stacked [L/s]) routed
        by experts[g] when replaying."""
        s = self.config.moe_layer_step
        groups = self.config.num_layers // s
        dense_graph, dense_state = nnx.split(self.blocks)
        moe_graph, moe_state = nnx.split(self.moe_blocks)
        dense_state = jax.tree.map(lambda a: a.reshape(groups, s - 1, *a.shape[1:]), dense_state)
        index = None if cache is None else cache.index

        def body(carry, xs):
            h, stacks = carry
            dense, moe, group, replay = xs
            for j in range(s - 1):
                block = nnx.merge(dense_graph, jax.tree.map(lambda a, j=j: a[j], dense))
                h, stacks, _ = block(h, positions, q_slots, key_valid, stacks, index, group * s + j)
            block = nnx.merge(moe_graph, moe)
            h, stacks, routing = block(h, positions, q_slots, key_valid, stacks, index, group * s + s - 1, replay)
            return (h, stacks), routing

        if self.config.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.config.remat], prevent_cse=False)
        stacks = None if cache is None else (cache.k, cache.v)
        (x, stacks), routing = jax.lax.scan(body, (x, stacks),
                                            (dense_state, moe_state, jnp.arange(groups), experts))
        return x, stacks, routing

    def features(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                 positions: jax.Array | None = None, experts: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states [B, T, D] in the compute dtype.

        attention_mask [B, T] (1 = real token) masks padding keys; positions default to the count of real
        tokens before each one (so left- and right-padded batches get the same positions as unpadded ones);
        experts [B, T, MoE layers, k]: expert ids every MoE layer routes by (routing replay, `routed_features`).
        """
        return self.routed_features(tokens, attention_mask=attention_mask, positions=positions, experts=experts)[0]

    def routed_features(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                        positions: jax.Array | None = None, experts: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array | None]:
        """(`features`, the routers' own top-k expert ids [B, T, L / moe_layer_step, k] int32, None for a dense
        model). With `experts` (routing replay: ids a rollout engine recorded, any integer dtype) MoE layer j
        routes token t to experts[:, t, j] with the router's weights for them (`moe.route`); the ids returned
        are still what each router would have chosen on the replayed forward (so the replay's effect can be
        measured).

        Raises:
          ValueError: experts given to a dense model, or not [B, T, MoE layers, k].
        """
        B, T = tokens.shape
        mask = jnp.ones((B, T), bool) if attention_mask is None else attention_mask.astype(bool)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        x = self._embed(tokens)
        x, _, routing = self._run_blocks(x, positions, jnp.broadcast_to(jnp.arange(T), (B, T)), mask, None, experts)
        return self.final_norm(x), None if routing is None else jnp.moveaxis(routing[1], 0, 2)

    def router_logits(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None) -> jax.Array:
        """Every MoE layer's float32 router logits [L / moe_layer_step, B, T, E] (for `moe.load_balancing_loss`).

        Raises:
          ValueError: the model is dense (config.num_experts == 0).
        """
        if not self.config.moe:
            raise ValueError(f"router_logits: architecture={self.config.architecture!r} has no experts")
        B, T = tokens.shape
        mask = jnp.ones((B, T), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        x = self._embed(tokens)
        return self._run_blocks(x, positions, jnp.broadcast_to(jnp.arange(T), (B, T)), mask, None)[2][0]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] from hidden states [..., D]."""
        head = self.head_weight().astype(hidden.dtype)
        out = jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "length", "act_vocab")) if out.ndim == 3 else out

    def __call__(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                 positions: jax.Array | None = None, experts: jax.Array | None = None) -> jax.Array:
        return self.logits(self.features(tokens, attention_mask=attention_mask, positions=positions,
                                         experts=experts))

    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed.embedding[...], tokens, axis=0).astype(self.compute_dtype)
        if self.config.scale_embeddings:  # √D rounded to the compute dtype, as Gemma's reference does
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        return constrain(x, ("batch", "length", "act_embed"))

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype | None = None) -> KVCache:
        """An empty cache of `max_len` slots for `batch` sequences (per layer under `ModelConfig.decode_unroll`)."""
        c = self.config
        if max_len > c.max_seq_len:
            raise ValueError(f"init_cache: max_len={max_len} exceeds ModelConfig.max_seq_len={c.max_seq_len}")
        dtype = self.compute_dtype if dtype is None else dtype
        per_layer = (batch, c.num_kv_heads, max_len, c.head_dim)
        empty = lambda: (tuple(jnp.zeros(per_layer, dtype) for _ in range(c.num_layers)) if c.decode_unroll
                         else jnp.zeros((c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim), dtype))
        k, v = constrain_kv(empty()), constrain_kv(empty())
        return KVCache(k=k, v=v,
                       valid=jnp.zeros((batch, max_len), bool), positions=jnp.zeros((batch,), jnp.int32),
                       index=jnp.zeros((batch,), jnp.int32))

    def forward_cached(self, tokens: jax.Array, cache: KVCache, *, attention_mask: jax.Array | None = None
                       ) -> tuple[jax.Array, KVCache]:
        """Append `tokens` [B, T] to the cache and return their logits [B, T, V] and the new cache.

        Used for prefill (T = prompt length, attention_mask marking padding, left or right) and for decoding
        (T = 1). Row b's tokens are written at slots cache.index[b] … + T − 1 and each row keeps its own positions;
        a row whose tokens are all masked (a finished sequence fed padding) writes invalid slots and keeps its index.
        """
        logits, new_cache, _ = self.routed_forward_cached(tokens, cache, attention_mask=attention_mask)
        return logits, new_cache

    def routed_forward_cached(self, tokens: jax.Array, cache: KVCache, *, attention_mask: jax.Array | None = None
                              ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """`forward_cached` and the expert ids every MoE layer's router chose for each token, [B, T,
        L / moe_layer_step, k] int32 (None for a dense model): what a rollout engine records for routing
        replay."""
        B, T = tokens.shape
        mask = jnp.ones((B, T), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = cache.positions[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        valid = write_rows(cache.valid, mask, cache.index)
        q_slots = cache.index[:, None] + jnp.arange(T)
        x = self._embed(tokens)
        x, (k, v), routing = self._run_blocks(x, positions, q_slots, valid, cache)
        logits = self.logits(self.final_norm(x))
        advance = jnp.where(mask.any(axis=1), T, 0).astype(jnp.int32)
        new_cache = KVCache(k=k, v=v, valid=valid, positions=cache.positions + mask.sum(1).astype(jnp.int32),
                            index=cache.index + advance)
        return logits, new_cache, None if routing is None else jnp.moveaxis(routing[1], 0, 2)


def init_model(config: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised decoder (normal(0.02) weights, unit norms); under `ModelConfig.decode_unroll` the
    stacked decoder's weights of the same seed, one module per layer."""
    if not config.decode_unroll:
        return Decoder(config, rngs=nnx.Rngs(params=seed))
    stacked = nnx.split(Decoder(dataclasses.replace(config, decode_unroll=False), rngs=nnx.Rngs(params=seed)))[1]
    graphdef, abstract = nnx.split(abstract_model(config))
    return nnx.merge(graphdef, per_layer_state(stacked, abstract))


def layer_source(path: str) -> tuple[str, int | None]:
    """Where a parameter of the per-layer decoder (`ModelConfig.decode_unroll`) lies in the stacked one: its
    stacked path and layer, or (path, None) for a parameter outside the blocks (the same in both).

    Example:
      >>> layer_source("blocks.3.attn.q_proj.kernel"), layer_source("final_norm.scale")
      (('blocks.attn.q_proj.kernel', 3), ('final_norm.scale', None))
    """
    head, _, rest = path.partition(".")
    index, _, tail = rest.partition(".")
    if head == "blocks" and index.isdigit() and tail:
        return f"blocks.{tail}", int(index)
    return path, None


def per_layer_state(stacked: Any, per_layer: Any) -> Any:
    """The state tree `per_layer` (of a per-layer decoder, any leaves: its abstract state will do) filled from the
    stacked decoder's state or parameter tree `stacked`: layer i of each stacked leaf where `layer_source` says.

    Raises:
      ValueError: `stacked` lacks a parameter the per-layer tree needs (named).
    """
    flat = flat_params(stacked)

    def take(keypath: Any, _: Any) -> Any:
        source, layer = layer_source(path_str(keypath))
        if source not in flat:
            raise ValueError(f"per_layer_state: the stacked state lacks {source!r} (for {path_str(keypath)!r})")
        return flat[source] if layer is None else flat[source][layer]

    return jax.tree_util.tree_map_with_path(take, per_layer)


def cast_matrices(model: nnx.Module, dtype: str) -> None:
    """Store the matrices of `model` (every `kernel` and `embedding` parameter) in `dtype`, in place; norm scales
    and biases, stacked over layers or not, keep their float32.

    Example:
      >>> from logra_jax.models.config import preset
      >>> m = Decoder(preset("tiny"), rngs=nnx.Rngs(params=0))
      >>> cast_matrices(m, "bfloat16")
      >>> str(m.blocks.mlp.up_proj.kernel[...].dtype), str(m.final_norm.scale[...].dtype)
      ('bfloat16', 'float32')
    """
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if path_str(path).endswith(("kernel", "embedding")) else x, params))


def abstract_model(config: ModelConfig) -> Decoder:
    """The decoder with ShapeDtypeStruct leaves (no allocation): for shapes, shardings and memory analysis."""
    return nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(params=0)))


def parameter_shardings(config: ModelConfig, mesh: Mesh) -> dict[str, NamedSharding]:
    """{canonical parameter path: NamedSharding} of the decoder's parameters on `mesh` by the logical-axis rules."""
    abstract = nnx.state(abstract_model(config), nnx.Param)
    return flat_params(param_shardings(abstract, mesh))


def init_sharded_model(config: ModelConfig, mesh: Mesh, seed: int = 0) -> Decoder:
    """`init_model(config, seed)` created directly in its shards on `mesh` (jit with the rules' out_shardings): no
    device ever holds a whole weight that the rules split. Equal, bit for bit, on every mesh (JAX's threefry random
    bits do not depend on the sharding); the eager `init_model` rounds some normal draws one ulp apart (op-by-op vs
    fused arithmetic), so runs from before the job initialised this way start from slightly other weights."""
    graphdef, abstract = nnx.split(abstract_model(config))
    shardings = param_shardings(abstract, mesh)
    state = jax.jit(lambda: nnx.split(init_model(config, seed))[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)
