"""LoGRA on mixture-of-experts kernels in dense-gradient mode: each expert's matrix is a target with its own seeded
projection (the expert index in the seed path) and row moments. Per expert, the sketch equals G_e·A_eᵀ with G_e
formed in numpy float64 from the expert's own tokens only; distinct experts draw distinct projections; an expert
that received no token gets a zero sketch and leaves its weights unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax import models
from logra_jax import optim as logra_optim
from logra_jax.optim.projection import layer_seed, projection, target_projection
from logra_jax.optim.sketch import scale_by_sketch
from logra_jax.optim.targets import find_targets

RANK = 8
SEED = 42
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def _silu(x):
    return x / (1 + np.exp(-x))


def _expert_gradients(route_reference, x, router, gate, up, down, cotangent, k, normalize):
    """Per-expert kernel gradients [E, in, out] of Σ y ⊙ cotangent in numpy float64, each expert summing over
    only the (token, slot) pairs routed to it: with weight w, g = Gᵀx, u = Uᵀx, h = silu(g) ⊙ u and c = w·cotangent,
    ∂down = h ⊗ c, ∂up = x ⊗ (W c ⊙ silu(g)), ∂gate = x ⊗ (W c ⊙ u ⊙ silu'(g)). Also the tokens per expert."""
    grads = [np.zeros_like(gate), np.zeros_like(up), np.zeros_like(down)]
    counts = np.zeros(gate.shape[0], int)
    for token, cot in zip(x, cotangent):
        chosen, w = route_reference(token, router, k, normalize)
        for weight, e in zip(w, chosen):
            counts[e] += 1
            g, u = token @ gate[e], token @ up[e]
            sig = 1 / (1 + np.exp(-g))
            c = weight * cot
            dh = down[e] @ c
            grads[2][e] += np.outer(_silu(g) * u, c)
            grads[1][e] += np.outer(token, dh * _silu(g))
            grads[0][e] += np.outer(token, dh * u * sig * (1 + g * (1 - sig)))
    return grads, counts


def _kernel_grads(layer, x, cotangent):
    """jax.grad of Σ y ⊙ cotangent w.r.t. the layer's parameters, as a pure dict."""
    graphdef, state = nnx.split(layer)
    pure = nnx.to_pure_dict(state)

    def loss(params):
        y, _ = nnx.merge(graphdef, params)(jnp.asarray(x))
        return jnp.sum(y * jnp.asarray(cotangent))

    return pure, jax.grad(loss)(pure)


def test_each_expert_sketch_is_its_tokens_gradient_times_its_projection(route_reference, moe_layer_without_expert):
    """S_e = G_e·A_eᵀ per expert (fp32 against float64 numpy, 1e-6 of the largest entry), where G_e sums over
    the expert's tokens only and A_e is drawn from the seed path "<kernel>.e"; the unused expert's sketch is 0."""
    unused = 3
    config = models.preset("tiny-qwen3-moe")
    layer, x, cotangent = moe_layer_without_expert(config, unused)
    params, grads = _kernel_grads(layer, x, cotangent)
    kernels = [np.asarray(params[n]["kernel"], np.float64) for n in ("router", *EXPERTS)]
    flat = lambda a: a.reshape(-1, config.hidden_size).astype(np.float64)
    oracle, counts = _expert_gradients(route_reference, flat(x), *kernels, flat(cotangent), config.experts_per_token,
                                       config.norm_topk_prob)
    assert counts[unused] == 0 and (counts[np.arange(4) != unused] > 0).all(), counts

    tx = scale_by_sketch(rank=RANK, base_seed=SEED, refresh=False)
    sketched, _ = tx.update(grads, tx.init(params))
    assert set(find_targets(params)) == {f"{n}.kernel" for n in EXPERTS}  # the router is no target
    for name, g in zip(EXPERTS, oracle):
        got = np.asarray(grads[name]["kernel"], np.float64)
        assert np.abs(got - g).max() <= 1e-5 * np.abs(g).max(), name  # autodiff gradient = per-token oracle
        update = sketched[name]["kernel"]
        assert update.target.batch_shape == (config.num_experts,)
        s = np.asarray(update.factor, np.float64)  # [E, out, r]
        for e in range(config.num_experts):
            a = np.asarray(projection(layer_seed(SEED, 0, f"{name}.kernel.{e}"), RANK, g.shape[1]), np.float64)
            want = g[e].T @ a.T  # W_e = kernel_eᵀ [out, in]: S_e = G_e A_eᵀ [out, r]
            scale = max(np.abs(want).max(), 1e-30)
            assert np.abs(s[e] - want).max() <= 1e-6 * scale, (name, e)
        assert not s[unused].any(), name


def test_an_expert_that_received_no_token_keeps_its_weights(moe_layer_without_expert):
    """A full LoGRA step (RowAdam, global step size, router frozen): the unused expert's kernels are unchanged
    bit for bit, every other expert's move, and the router (no target) stays put."""
    unused = 3
    layer, x, cotangent = moe_layer_without_expert(models.preset("tiny-qwen3-moe"), unused)
    params, grads = _kernel_grads(layer, x, cotangent)
    tx = logra_optim.logra(RANK, base_seed=SEED, update_ratio=1e-2)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = logra_optim.apply_updates(params, updates)
    np.testing.assert_array_equal(np.asarray(new["router"]["kernel"]), np.asarray(params["router"]["kernel"]))
    for name in EXPERTS:
        before, after = np.asarray(params[name]["kernel"]), np.asarray(new[name]["kernel"])
        np.testing.assert_array_equal(after[unused], before[unused])
        for e in range(before.shape[0]):
            if e != unused:
                assert np.abs(after[e] - before[e]).max() > 0, (name, e)


def test_stacked_experts_draw_distinct_projections_seeded_by_layer_and_expert():
    """In the decoder, expert kernels are [L, E, in, out]: slice (l, e) is "path.{l·E + e}", so every (layer,
    expert) has its own A, and the dense-mode sketch of the model's gradient follows it."""
    config = models.preset("tiny-qwen3-moe", num_layers=2)
    model = models.init_model(config, seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 6)), jnp.int32)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

    grads = jax.grad(loss)(params)
    targets = find_targets(params)
    tx = scale_by_sketch(rank=RANK, base_seed=SEED, refresh=False)
    sketched, _ = tx.update(grads, tx.init(params))
    L, E = config.num_layers, config.num_experts
    for name in EXPERTS:
        path = f"blocks.mlp.{name}.kernel"
        t = targets[path]
        assert t.batch_shape == (L, E)
        a = np.asarray(target_projection(t, SEED, 0, RANK))  # [L, E, r, k]
        flat_a = a.reshape(L * E, -1)
        assert len({row.tobytes() for row in flat_a}) == L * E, path  # all distinct
        g = np.asarray(grads["blocks"]["mlp"][name]["kernel"], np.float64)
        s = np.asarray(sketched["blocks"]["mlp"][name]["kernel"].factor, np.float64)
        for layer in range(L):
            for e in range(E):
                want_a = projection(layer_seed(SEED, 0, f"{path}.{layer * E + e}"), RANK, t.k)
                np.testing.assert_array_equal(a[layer, e], np.asarray(want_a))
                want = g[layer, e].T @ a[layer, e].T.astype(np.float64)
                assert np.abs(s[layer, e] - want).max() <= 1e-6 * max(np.abs(want).max(), 1e-30), (path, layer, e)


def test_expert_row_moments_are_per_expert():
    """RowAdam keeps one row moment per (layer, expert) matrix, [L, E, d], in the LoGRA state of the decoder."""
    config = models.preset("tiny-qwen3-moe", num_layers=2)
    params = nnx.to_pure_dict(nnx.state(models.init_model(config, seed=0), nnx.Param))
    state = logra_optim.logra(RANK).init(params)
    moments = [leaf for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, logra_optim.RowAdamState))
               if isinstance(leaf, logra_optim.RowAdamState)]
    assert len(moments) == 1
    mlp = moments[0].row_moment["blocks"]["mlp"]
    for name in EXPERTS:
        d = config.hidden_size if name == "down_proj" else config.expert_intermediate_size
        assert mlp[name]["kernel"].shape == (config.num_layers, config.num_experts, d), name


def _one_logra_step(section):
    """One LoGRA train step of tiny-qwen3-moe as the loop builds it: {path: (before, after)} and the targets."""
    from logra_jax.core.tree_paths import path_str
    from logra_jax.job.optimizer_plan import build_optimizer
    from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss

    model = models.init_model(models.preset("tiny-qwen3-moe", num_layers=2), seed=0)
    plan = build_optimizer(section, model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = make_train_step(graphdef, next_token_loss, plan.tx, mode=plan.mode, trainable=plan.trainable)
    toks = jax.random.randint(jax.random.key(0), (4, 10), 1, 128)
    batch = {"tokens": toks, "attention_mask": jnp.ones_like(toks, bool), "loss_mask": jnp.ones_like(toks, bool)}
    new, _ = jax.jit(step)(TrainState(params, plan.tx.init(params), jnp.zeros((), jnp.int32)), rest, batch)
    leaves = lambda tree: {path_str(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    return leaves(params), leaves(new.params), set(plan.targets)


def test_router_is_frozen_by_default_and_trained_densely_by_config():
    """non_targets="frozen" (default): only the targets move, the routers stay put; non_targets="router": the
    routers move too (AdamW), every other non-target stays put; in sketch-native and dense-gradient mode."""
    from logra_jax.job.run_config import OptimizerSection

    for sketch_native in (True, False):
        for choice in ("frozen", "router"):
            section = OptimizerSection(name="logra", rank=RANK, update_ratio=1e-2, learning_rate=1e-3,
                                       sketch_native=sketch_native, non_targets=choice)
            before, after, targets = _one_logra_step(section)
            routers = {p for p in before if p.endswith("router.kernel")}
            assert routers and targets
            expected = targets | (routers if choice == "router" else set())
            moved = {p for p in before if not np.array_equal(before[p], after[p])}
            assert moved == expected, (sketch_native, choice, moved ^ expected)


def test_router_choice_needs_a_router():
    from logra_jax.job.optimizer_plan import build_optimizer
    from logra_jax.job.run_config import OptimizerSection

    with pytest.raises(ValueError, match="has no MoE router"):
        build_optimizer(OptimizerSection(name="logra", rank=RANK, non_targets="router"),
                        models.init_model(models.preset("tiny"), seed=0))
