"""Decoder building blocks: RMSNorm, Linear, RoPE, grouped-query attention (optionally sliding-window) and the
gated MLP.

Parameters are float32 and carry logical axis names in their `axes` metadata (see logra_jax.parallel.sharding).
A module built with `stack=L` holds L layers' parameters stacked on a leading "layers" axis; the decoder scans
over that axis and calls the module on one layer's slice, so the same `__call__` serves both.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.models.config import ModelConfig
from logra_jax.parallel.sharding import constrain


def write_stacked_rows(stack: jax.Array, layer: jax.Array | None, rows: jax.Array, index: jax.Array) -> jax.Array:
    """stack [L, B, S, H, hd] with rows [B, T, H, hd] (cast to its dtype) written at [layer, b, index[b] :
    index[b] + T] (a scatter of the rows alone: the stack is updated in place, not copied); positions past S are
    dropped. layer None: `stack` is one layer's buffer [B, H, S, hd] (a per-layer cache), written at [b, :,
    index[b] : index[b] + T]."""
    B, T = rows.shape[:2]
    slots = index[:, None] + jnp.arange(T)[None, :]
    b = jnp.arange(B)[:, None]
    # The advanced indices [B, T] go first in the update's shape, so rows [B, T, H, hd] fit either form.
    where = (b, slice(None), slots) if layer is None else (layer, b, slots)
    return stack.at[where].set(rows.astype(stack.dtype), mode="drop")


def write_rows(buffer: jax.Array, rows: jax.Array, index: jax.Array) -> jax.Array:
    """buffer [B, S, ...] with rows [B, T, ...] (cast to its dtype) written at [b, index[b] : index[b] + T]."""
    return jax.vmap(lambda buf, new, i: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), i, 0))(
        buffer, rows, index)

# Finite mask value: a fully masked row (a padding query) softmaxes to uniform instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _stacked(shape: tuple[int, ...], axes: tuple[str, ...], stack: int | None):
    if stack is None:
        return shape, axes
    return (stack, *shape), ("layers", *axes)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + eps) · (offset + scale), returned in x's dtype.

    offset 0 (Llama, Qwen): the normalised x is cast to x's dtype before the multiply; offset 1 (Gemma, whose
    stored scale is centred on 0 and initialised to 0): the multiply is done in float32 and then cast, as each
    family's reference does.
    """

    def __init__(self, features: int, eps: float, *, offset: float = 0.0, stack: int | None = None):
        shape, axes = _stacked((features,), ("norm",), stack)
        self.scale = nnx.Param(jnp.full(shape, 1.0 - offset, jnp.float32), axes=axes)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return (y.astype(x.dtype) * self.scale[...].astype(x.dtype)).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def cast_sharded(kernel: jax.Array, dtype: jnp.dtype, axes: tuple[str, ...]) -> jax.Array:
    """A float32 kernel cast to the compute dtype while still split like the parameter (`constrain` to its logical
    axes), so the FSDP all-gather that follows moves compute-dtype bytes (half of float32's for bfloat16) and
    the gathered copy is that size. The same values as casting after the gather; its derivatives are those of
    `astype` (no constraint on tangents or cotangents: the gradient path is unchanged)."""
    return constrain(kernel.astype(dtype), axes)


@cast_sharded.defjvp
def _cast_sharded_jvp(dtype, axes, primals, tangents):
    (kernel,), (dkernel,) = primals, tangents
    return cast_sharded(kernel, dtype, axes), dkernel.astype(dtype)


class Linear(nnx.Module):
    """y = x · kernel (+ bias), kernel [in, out] (Flax layout: LoGRA's W is kernelᵀ, rows = out features)."""

    def __init__(self, in_features: int, out_features: int, *, axes: tuple[str, str], use_bias: bool = False,
                 stack: int | None = None, rngs: nnx.Rngs, init_std: float = 0.02):
        shape, kaxes = _stacked((in_features, out_features), axes, stack)
        self.kernel = nnx.Param(init_std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=kaxes)
        if use_bias:
            bshape, baxes = _stacked((out_features,), axes[1:], stack)
            self.bias = nnx.Param(jnp.zeros(bshape, jnp.float32), axes=baxes)
        else:
            self.bias = None

        # Installed by logra_jax.native.sketch_probes on LoGRA targets: a callable
        # (x, kernel, probe, digest) -> y that routes the weight's gradient signal into `sketch_probe`.
        self.lowrank_hook = None

    def __call__(self, x: jax.Array) -> jax.Array:
        axes = self.kernel.get_metadata().get("axes")
        kernel = self.kernel[...]
        if axes and kernel.dtype != x.dtype:
            kernel = cast_sharded(kernel, x.dtype, tuple(axes[-kernel.ndim:]))
        if self.lowrank_hook is not None:
            y = self.lowrank_hook(x, kernel, self.sketch_probe[...], self.sketch_digest[...])
        else:
            y = jnp.einsum("...k,kd->...d", x, kernel.astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


def rope_inv_freq(config: ModelConfig, *, local: bool = False) -> jax.Array:
    """Inverse frequencies θ^(-2i/d) [head_dim/2], with linear or llama3 scaling applied.

    local=True: the sliding layers' frequencies, base `rope_local_theta` (else rope_theta) and no scaling.
    """
    hd = config.head_dim
    theta = config.rope_theta if not local or config.rope_local_theta is None else config.rope_local_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    if local:
        return inv_freq
    if config.rope_scaling == "linear":
        inv_freq = inv_freq / config.rope_scaling_factor
    elif config.rope_scaling == "llama3":
        factor = config.rope_scaling_factor
        old = config.rope_original_max_position
        low_wavelen = old / config.rope_low_freq_factor
        high_wavelen = old / config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - config.rope_low_freq_factor) / (
            config.rope_high_freq_factor - config.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, interleaved: bool) -> jax.Array:
    """Rotate x [B, T, H, hd] by angle position·inv_freq.

    rotate-half pairs dimension i with i + hd/2 (HF); interleaved pairs 2i with 2i+1 (GGUF / Meta).
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        even, odd = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        x1, x2 = x32[..., :half], x32[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def key_mask(q_slots: jax.Array, key_slots: jax.Array, key_valid: jax.Array, window: jax.Array | None = None,
             q_positions: jax.Array | None = None, key_positions: jax.Array | None = None) -> jax.Array:
    """Which keys each query may attend to, [B, T, S]: real (`key_valid` [B, S]), not after the query
    (key slot <= query slot; `q_slots` [T] or [B, T], `key_slots` [S]) and, with a `window` (a scalar, traced or
    not), fewer than `window` positions behind it: q_positions [B, T] − key_positions [B, S] < window.
    """
    mask = key_valid[:, None, :] & (key_slots <= q_slots[..., None])
    if window is not None:
        mask = mask & (q_positions[:, :, None] - key_positions[:, None, :] < window)
    return mask


def _dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_slots: jax.Array, key_valid: jax.Array, *,
                     scale: float, window: jax.Array | None = None, q_positions: jax.Array | None = None,
                     key_positions: jax.Array | None = None) -> jax.Array:
    """softmax(scale · q kᵀ + mask) v with q [B, T, Hkv, G, hd], k/v [B, S, Hkv, hd]; mask: `key_mask`."""
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = key_mask(q_slots, jnp.arange(k.shape[1]), key_valid, window, q_positions, key_positions)
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", p, v, preferred_element_type=jnp.float32).astype(q.dtype)


def _chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_slots: jax.Array, key_valid: jax.Array,
                       chunk: int, *, scale: float, window: jax.Array | None = None,
                       q_positions: jax.Array | None = None, key_positions: jax.Array | None = None) -> jax.Array:
    """Same result as `_dense_attention`, with an online softmax over key chunks (no [T, S] scores). A sliding
    window is a mask here: every chunk is still visited."""
    B, S, Hkv, hd = k.shape
    T, G = q.shape[1], q.shape[3]
    n = -(-S // chunk)
    pad = n * chunk - S
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        key_valid = jnp.pad(key_valid, ((0, 0), (0, pad)))
        if key_positions is not None:
            key_positions = jnp.pad(key_positions, ((0, 0), (0, pad)))
    kc = k.reshape(B, n, chunk, Hkv, hd).swapaxes(0, 1)
    vc = v.reshape(B, n, chunk, Hkv, hd).swapaxes(0, 1)
    validc = key_valid.reshape(B, n, chunk).swapaxes(0, 1)
    posc = None if key_positions is None else key_positions.reshape(B, n, chunk).swapaxes(0, 1)
    slotc = jnp.arange(n * chunk).reshape(n, chunk)

    @jax.checkpoint
    def step(carry, xs):
        m, denom, acc = carry
        kb, vb, validb, slotb, posb = xs
        s = jnp.einsum("btkgh,bskh->bkgts", q, kb, preferred_element_type=jnp.float32) * scale
        mask = key_mask(q_slots, slotb, validb, window, q_positions, posb)
        s = jnp.where(mask[:, None, None], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        denom = denom * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("bkgts,bskh->bkgth", p.astype(vb.dtype), vb,
                                                 preferred_element_type=jnp.float32)
        return (m_new, denom, acc), None

    init = (jnp.full((B, Hkv, G, T), MASK_VALUE, jnp.float32), jnp.zeros((B, Hkv, G, T), jnp.float32),
            jnp.zeros((B, Hkv, G, T, hd), jnp.float32))
    (_, denom, acc), _ = jax.lax.scan(step, init, (kc, vc, validc, slotc, posc))
    out = acc / denom[..., None]
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional per-head q/k RMSNorm, an optional sliding window and an
    optional KV cache."""

    def __init__(self, config: ModelConfig, *, stack: int | None = None, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.q_proj = Linear(c.hidden_size, c.q_size, axes=("embed", "q_heads"), use_bias=c.qkv_bias,
                             stack=stack, rngs=rngs)
        self.k_proj = Linear(c.hidden_size, c.kv_size, axes=("embed", "kv_heads"), use_bias=c.qkv_bias,
                             stack=stack, rngs=rngs)
        self.v_proj = Linear(c.hidden_size, c.kv_size, axes=("embed", "kv_heads"), use_bias=c.qkv_bias,
                             stack=stack, rngs=rngs)
        self.o_proj = Linear(c.q_size, c.hidden_size, axes=("q_heads", "embed"), stack=stack, rngs=rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=c.norm_offset, stack=stack)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=c.norm_offset, stack=stack)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, positions: jax.Array, q_slots: jax.Array, key_valid: jax.Array,
                 cache: tuple[jax.Array, jax.Array] | None = None, write_index: jax.Array | None = None,
                 layer: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, T, D] → [B, T, D]; q_slots [B, T] are the queries' cache slots (causality). With a cache (the
        stacked k, v [L, B, S, Hkv, hd] of every layer, or this layer's own k, v [B, Hkv, S, hd]: a per-layer
        cache) row b's new keys are written at [layer, b, write_index[b]] (in place) and attention runs over the
        layer's first S' cache positions, S' = key_valid's length ([B, S'] marks real tokens).
        `layer` (the layer's index: traced under the decoder's scan, a Python int in its per-layer loop) selects
        the sliding window and RoPE base of that layer; it is required when the config has a sliding window."""
        with jax.named_scope("attention"):  # names the buffers in compiled memory reports
            return self._attend(x, positions, q_slots, key_valid, cache, write_index, layer)

    def _layer_rope_and_window(self, layer: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """(inverse RoPE frequencies, sliding window or None) of layer `layer`; global layers get an unbounded
        window (the mask is built alike on every layer of the scan)."""
        c = self.config
        if c.sliding_window is None:
            return rope_inv_freq(c), None
        if layer is None:
            raise ValueError("Attention: `layer` is required when ModelConfig.sliding_window is set "
                             f"({c.sliding_window})")
        sliding = jnp.asarray(c.sliding_layers())[layer]
        inv_freq = jnp.where(sliding, rope_inv_freq(c, local=True), rope_inv_freq(c))
        window = jnp.where(sliding, c.sliding_window, jnp.iinfo(jnp.int32).max)
        return inv_freq, window

    def _attend(self, x, positions, q_slots, key_valid, cache, write_index, layer):
        c = self.config
        B, T, _ = x.shape
        G = c.num_heads // c.num_kv_heads
        inv_freq, window = self._layer_rope_and_window(layer)
        q = self.q_proj(x).reshape(B, T, c.num_heads, c.head_dim)
        k = self.k_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(apply_rope(q, positions, inv_freq, c.rope_interleaved),
                      ("batch", "length", "act_heads", None))
        k = constrain(apply_rope(k, positions, inv_freq, c.rope_interleaved),
                      ("batch", "length", "act_kv_heads", None))
        v = constrain(v, ("batch", "length", "act_kv_heads", None))
        key_positions = positions if window is not None else None
        if cache is not None:  # write this layer's rows in place, read its first S' positions
            per_layer = cache[0].ndim == 4
            at = None if per_layer else layer
            cache = tuple(write_stacked_rows(stack, at, new, write_index) for stack, new in zip(cache, (k, v)))
            read = key_valid.shape[1]
            k, v = ((jnp.swapaxes(stack[:, :, :read], 1, 2) if per_layer else
                     jax.lax.dynamic_index_in_dim(stack, layer, 0, keepdims=False)[:, :read]).astype(x.dtype)
                    for stack in cache)
            key_positions = cache_key_positions(key_valid) if window is not None else None
        qg = q.reshape(B, T, c.num_kv_heads, G, c.head_dim)
        scale = (c.head_dim if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar) ** -0.5
        masking = dict(scale=scale, window=window, q_positions=positions, key_positions=key_positions)
        if c.attention_impl == "chunked" and T > 1:  # a decode step's scores [B, H, 1, S] need no chunks
            out = _chunked_attention(qg, k, v, q_slots, key_valid, c.attention_chunk, **masking)
        else:
            out = _dense_attention(qg, k, v, q_slots, key_valid, **masking)
        out = constrain(out.reshape(B, T, c.q_size), ("batch", "length", "act_heads"))
        return self.o_proj(out), cache


def cache_key_positions(key_valid: jax.Array) -> jax.Array:
    """RoPE positions [B, S] of a cache's keys: the count of real slots before each slot (the position the
    decoder gave each real token when it was written, for any padding)."""
    return jnp.maximum(jnp.cumsum(key_valid, axis=1) - 1, 0)


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) · up(x)); act = silu (SwiGLU) or tanh-approximated GELU (GeGLU)."""

    def __init__(self, config: ModelConfig, *, stack: int | None = None, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.activation = config.mlp_activation
        self.gate_proj = Linear(d, f, axes=("embed", "mlp"), stack=stack, rngs=rngs)
        self.up_proj = Linear(d, f, axes=("embed", "mlp"), stack=stack, rngs=rngs)
        self.down_proj = Linear(f, d, axes=("mlp", "embed"), stack=stack, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):  # names the buffers in compiled memory reports
            gate = self.gate_proj(x)
            act = jax.nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True)
            h = act * self.up_proj(x)
            return self.down_proj(constrain(h, ("batch", "length", "act_mlp")))
