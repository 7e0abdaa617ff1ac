"""Mixture-of-experts feed-forward layer: a top-k router and dropless, grouped expert matmuls.

Families: Qwen3-MoE (`Qwen3MoeForCausalLM`) and Mixtral (`MixtralForCausalLM`). Mixtral is the second family
because its MoE differs where a general layer must bend and nowhere else: the router always renormalises its k
weights (Qwen3-MoE only with `norm_topk_prob`), the expert width is the model's `intermediate_size`, the attention
is Llama's (no q/k norm) and its checkpoints name the experts `block_sparse_moe.experts.{e}.w1/w3/w2`. OLMoE
(q/k norm over the whole projection) and gpt-oss (biased, clamped experts, attention sinks) would need attention
and activation features beyond this layer.

For a token x [D], with router weights R [D, E] and the experts' gate, up and down kernels G_e, U_e [D, F_e],
W_e [F_e, D]:

    p = softmax(x R)                          (float32, over all E experts)
    S = top-k indices of p,   w_e = p_e  (e ∈ S)
    w_e ← w_e / Σ_{e' ∈ S} p_e'               (norm_topk_prob; always for Mixtral)
    y = Σ_{e ∈ S} w_e · W_eᵀ(silu(G_eᵀ x) ⊙ U_eᵀ x)

Dropless: every token reaches its k experts (no capacity factor). The N·k (token, expert) pairs are sorted by
expert id and each expert multiplies only its own contiguous rows with `jax.lax.ragged_dot` over the kernels
stacked [E, in, out]: no [tokens, E, ...] intermediate in the program. How the compiler runs it differs: libtpu's
grouped-matmul kernel does each expert's rows only (1.00× the flops), while XLA:CPU and XLA:GPU (jaxlib 0.10.2)
expand it to a dense product over every expert (64× the flops on a 64-expert example:
experiments/memory/ragged_dot.py) — a grouped-matmul kernel for GPUs is still to come.

Routing replay (`route(..., replay)`, `MoE.routed`): S is given (the experts a rollout engine chose for the token)
instead of the top-k, and w_e = p_e for e ∈ S (renormalised as above) still comes from this router's logits. Replay
fixes the set, not the weights: the output is continuous in the router again and its gradient flows as without
replay.

Parameters carry the logical axis "expert" on their expert dimension; the sharding rules leave it unmapped
(replicated) until expert parallelism maps it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.models.config import ModelConfig
from logra_jax.models.layers import Linear
from logra_jax.parallel.sharding import constrain


class ExpertLinear(nnx.Module):
    """E stacked kernels [E, in, out] (Flax layout); applied to rows sorted by expert with per-expert counts."""

    def __init__(self, experts: int, in_features: int, out_features: int, *, axes: tuple[str, str],
                 stack: int | None = None, rngs: nnx.Rngs, init_std: float = 0.02):
        shape, names = (experts, in_features, out_features), ("expert", *axes)
        if stack is not None:
            shape, names = (stack, *shape), ("layers", *names)
        self.kernel = nnx.Param(init_std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=names)
        # Installed by logra_jax.native.sketch_probes on LoGRA targets: a callable
        # (x, kernel, probe, digest, group_sizes) -> y that sends each expert's sketch into `sketch_probe`.
        self.lowrank_hook = None

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x [M, in] sorted by expert, group_sizes [E] (rows per expert, summing to M) → [M, out]:
        row m of group e is x_m · kernel[e]."""
        if self.lowrank_hook is not None:
            return self.lowrank_hook(x, self.kernel[...], self.sketch_probe[...], self.sketch_digest[...],
                                     group_sizes)
        return jax.lax.ragged_dot(x, self.kernel[...].astype(x.dtype), group_sizes)


def route(logits: jax.Array, k: int, normalize: bool, replay: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] float32, expert ids [N, k] int32) of router logits [N, E]: the top-k of softmax(logits),
    renormalised to sum to 1 when `normalize`.

    With `replay` (routing replay: expert ids [N, k] a rollout engine chose, any integer dtype) the set is
    `replay`'s and the weights are still the router's, p = softmax(logits) gathered at the replayed ids (then
    renormalised when `normalize`): replay fixes which experts a token reaches, not how much each weighs, so the
    router's gradient and the renormalisation follow the trainer's own logits.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if replay is None:
        weights, ids = jax.lax.top_k(probs, k)
    else:
        ids = replay.astype(jnp.int32)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def expert_id_dtype(num_experts: int) -> jnp.dtype:
    """The dtype a rollout stores expert ids in: uint8 up to 256 experts, else uint16 (at Qwen3-30B-A3B's 48 MoE
    layers × top-8, 384 bytes per token).

    Raises:
      ValueError: num_experts outside [1, 65536].
    """
    if not 1 <= num_experts <= 2**16:
        raise ValueError(f"expert_id_dtype: num_experts must be in [1, 65536], got {num_experts!r}")
    return jnp.dtype(jnp.uint8 if num_experts <= 2**8 else jnp.uint16)


def load_balancing_loss(router_logits: jax.Array, k: int, mask: jax.Array | None = None) -> jax.Array:
    """The Switch-Transformer auxiliary loss, as transformers' `load_balancing_loss_func` computes it over all
    layers together:

        aux = E · Σ_{j<k} Σ_e f_{j,e} · P_e,
        f_{j,e} = mean over (layer, token) of [the token's j-th choice is e],
        P_e = mean over (layer, token) of softmax(logits)_e,

    the means over the real tokens (`mask` [B, T]) of every layer.

    Args:
      router_logits: [L, B, T, E] (`Decoder.router_logits`).
      k: experts per token.
      mask: [B, T], 1 = real token; None = all.

    Returns:
      A float32 scalar (add coef · aux to the loss; transformers' default coefficient is 0.001, off here unless
      a learner adds it).
    """
    L, B, T, E = router_logits.shape
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, ids = jax.lax.top_k(probs, k)
    chosen = jax.nn.one_hot(ids, E, dtype=jnp.float32)  # [L, B, T, k, E]
    real = jnp.ones((B, T), jnp.float32) if mask is None else mask.astype(jnp.float32)
    real = jnp.broadcast_to(real, (L, B, T))
    count = real.sum()
    tokens_per_expert = jnp.einsum("lbtke,lbt->ke", chosen, real) / count
    prob_per_expert = jnp.einsum("lbte,lbt->e", probs, real) / count
    return E * jnp.sum(tokens_per_expert * prob_per_expert[None])


class MoE(nnx.Module):
    """Top-k routed experts with SwiGLU (see the module docstring for the equations); [B, T, D] → [B, T, D]."""

    def __init__(self, config: ModelConfig, *, stack: int | None = None, rngs: nnx.Rngs):
        d, f, E = config.hidden_size, config.expert_intermediate_size, config.num_experts
        self.k = config.experts_per_token
        self.normalize = config.norm_topk_prob
        self.router = Linear(d, E, axes=("embed", "expert"), stack=stack, rngs=rngs)
        self.gate_proj = ExpertLinear(E, d, f, axes=("embed", "mlp"), stack=stack, rngs=rngs)
        self.up_proj = ExpertLinear(E, d, f, axes=("embed", "mlp"), stack=stack, rngs=rngs)
        self.down_proj = ExpertLinear(E, f, d, axes=("mlp", "embed"), stack=stack, rngs=rngs)
        # Installed by expert parallelism: a callable (flat [N, D], weights [N, k], ids [N, k]) -> y [N, D] that
        # replaces `experts` (the same contract), computing each expert where its kernels live.
        self.dispatch_hook = None

    def router_logits(self, x: jax.Array) -> jax.Array:
        """float32 router logits [..., E] of x [..., D]."""
        kernel = self.router.kernel[...].astype(x.dtype)
        return jnp.einsum("...d,de->...e", x, kernel, preferred_element_type=jnp.float32)

    def __call__(self, x: jax.Array, replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(y [B, T, D], router logits [B, T, E] float32) of x [B, T, D] (`routed` without its ids)."""
        y, logits, _ = self.routed(x, replay)
        return y, logits

    def routed(self, x: jax.Array, replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(y [B, T, D], router logits [B, T, E] float32, the router's own top-k ids [B, T, k] int32) of x
        [B, T, D]. With `replay` (expert ids [B, T, k], routing replay) each token reaches those experts instead of
        its own top-k, weighted by the router (`route`); the ids returned are still the router's own choice.

        Raises:
          ValueError: replay is not [B, T, k].
        """
        with jax.named_scope("moe"):
            B, T, D = x.shape
            E = self.router.kernel.shape[-1]
            flat = x.reshape(B * T, D)
            logits = self.router_logits(flat)
            weights, ids = route(logits, self.k, self.normalize)
            own = ids
            if replay is not None:
                if replay.shape != (B, T, self.k):
                    raise ValueError(f"MoE: replay ids must be [B, T, k] = {(B, T, self.k)}, got {replay.shape}")
                weights, ids = route(logits, self.k, self.normalize, replay.reshape(B * T, self.k))
            dispatch = self.experts if self.dispatch_hook is None else self.dispatch_hook
            y = dispatch(flat, weights, ids)
            return (constrain(y.reshape(B, T, D), ("batch", "length", "act_embed")), logits.reshape(B, T, E),
                    own.reshape(B, T, self.k))

    def experts(self, flat: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        """The routed experts' weighted sum [N, D] for tokens flat [N, D] routed to experts ids [N, k] with weights
        [N, k], on the devices that hold the tokens (every expert's kernels gathered there)."""
        N, D = flat.shape
        E = self.router.kernel.shape[-1]
        # Sort the N·k (token, slot) pairs by expert: each expert's rows are contiguous for ragged_dot.
        order = jnp.argsort(ids.reshape(-1), stable=True)
        group_sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
        rows = jnp.take(flat, order // self.k, axis=0)
        h = jax.nn.silu(self.gate_proj(rows, group_sizes)) * self.up_proj(rows, group_sizes)
        out = self.down_proj(h, group_sizes)
        # Back to (token, slot) order, then the weighted sum over each token's k experts.
        out = jnp.take(out, jnp.argsort(order), axis=0).reshape(N, self.k, D)
        return jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype))
