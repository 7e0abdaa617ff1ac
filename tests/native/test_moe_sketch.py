"""Sketch-native mode on mixture-of-experts kernels: each expert's sketch, formed from its own tokens in the
backward (ragged products with the forward's grouping), equals the dense-gradient mode's G_e·A_eᵀ; an expert
routed no token gets a zero sketch; no dense [E, k, d] gradient is formed; inputs' gradients and outputs equal the
plain model's."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logra_jax.job.train_step import next_token_loss
from logra_jax.models import moe
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.expert_probes import ragged_outer
from logra_jax.native.kl_probe import kl_quadratic, make_kl_probe, predicted_and_realised_kl
from logra_jax.native.sketch_probes import SketchProbe, attach_sketch_probes, sketching
from logra_jax.optim import SketchSpec, logra
from logra_jax.optim.lowrank import apply_updates
from logra_jax.optim.projection import target_projection

RANK = 8
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def _batch(seed=0, B=4, T=10, vocab=128):
    toks = jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)
    mask = jnp.ones_like(toks).at[0, :3].set(0)
    return dict(tokens=toks, attention_mask=mask, loss_mask=mask)


def _flat(tree):
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(tree)}


def test_expert_sketches_equal_the_dense_mode_per_expert():
    """tiny-qwen3-moe (2 layers, 4 experts, top-2): every target's sketch-native S equals G·Aᵀ of the dense
    gradient (numpy float64), per (layer, expert) matrix, including the attention targets."""
    model = init_model(preset("tiny-qwen3-moe", num_layers=2))
    spec = SketchSpec(rank=RANK)
    targets = attach_sketch_probes(model, spec)
    assert len(targets) == 7
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probes, others = nnx.split_state(rest, SketchProbe, ...)
    batch = _batch()

    def native(pr):
        with sketching(jnp.int32(0)):
            return next_token_loss(nnx.merge(graphdef, params, nnx.merge_state(pr, others)), batch)[0]

    got = _flat(jax.jit(jax.grad(native))(probes))
    dense = _flat(jax.jit(jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch)[0]))(params))
    for path, t in targets.items():
        g = dense[path].astype(np.float64)  # [*batch, k, d]
        a = np.asarray(target_projection(t, spec.base_seed, 0, RANK), np.float64)  # [*batch, r, k]
        want = np.einsum("...kd,...rk->...dr", g, a)
        s = got[path.replace(".kernel", ".sketch_probe")]
        assert s.dtype == np.float32 and s.shape == want.shape, path
        for index in np.ndindex(*t.batch_shape):  # per layer, and per expert for the MoE kernels
            err = np.abs(s[index] - want[index]).max()
            assert err <= 1e-5 * max(np.abs(want[index]).max(), 1e-12), (path, index, err)


def _layer(make, unused=3):
    """tiny-qwen3-moe's MoE layer whose expert `unused` receives no token, x and the cotangent as jax arrays."""
    config = preset("tiny-qwen3-moe")
    layer, x, cot = make(config, unused)
    return config, layer, jnp.asarray(x), jnp.asarray(cot)


def test_layer_sketch_is_each_experts_tokens_only_and_zero_for_an_unused_expert(moe_layer_without_expert):
    """On one MoE layer: S_e = G_e A_eᵀ (1e-6 of the largest entry) with G_e the dense-mode gradient of expert e,
    exactly 0 for the expert no token chose; x's gradient and y equal the plain layer's."""
    unused = 3
    config, layer, x, cot = _layer(moe_layer_without_expert, unused)
    plain_graph, plain_state = nnx.split(layer)
    plain = lambda s, x: jnp.sum(nnx.merge(plain_graph, s)(x)[0] * cot)
    dense_grads, dense_dx = jax.grad(plain, argnums=(0, 1))(plain_state, x)
    y_plain = nnx.merge(plain_graph, plain_state)(x)[0]
    counts = np.bincount(np.asarray(moe.route(x.reshape(-1, config.hidden_size) @ layer.router.kernel[...],
                                              config.experts_per_token, True)[1]).ravel(), minlength=4)
    assert counts[unused] == 0 and (np.delete(counts, unused) > 0).all()

    spec = SketchSpec(rank=RANK, refresh=False)
    targets = attach_sketch_probes(layer, spec)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    probes, others = nnx.split_state(rest, SketchProbe, ...)

    def native(pr, x):
        with sketching(jnp.int32(5)):
            y = nnx.merge(graphdef, params, nnx.merge_state(pr, others))(x)[0]
        return jnp.sum(y * cot), y

    (sketches, dx), y = jax.grad(native, argnums=(0, 1), has_aux=True)(probes, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_plain))
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dense_dx), rtol=1e-5, atol=1e-6)
    got, dense = _flat(sketches), _flat(dense_grads)
    for name in EXPERTS:
        t = targets[f"{name}.kernel"]
        assert t.batch_shape == (config.num_experts,)
        g = dense[f"{name}.kernel"].astype(np.float64)
        a = np.asarray(target_projection(t, spec.base_seed, 0, RANK), np.float64)
        s = got[f"{name}.sketch_probe"]
        for e in range(config.num_experts):
            want = g[e].T @ a[e].T
            assert np.abs(s[e] - want).max() <= 1e-6 * max(np.abs(want).max(), 1e-30), (name, e)
        assert not s[unused].any(), name


def test_no_dense_expert_gradient_is_formed(moe_layer_without_expert):
    """The backward of the sketch-native layer holds no array of an expert kernel's shape [E, k, d]."""
    config, layer, x, cot = _layer(moe_layer_without_expert)
    attach_sketch_probes(layer, SketchSpec(rank=RANK))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    probes, others = nnx.split_state(rest, SketchProbe, ...)

    def native(pr):
        with sketching(jnp.int32(0)):
            return jnp.sum(nnx.merge(graphdef, params, nnx.merge_state(pr, others))(x)[0] * cot)

    jaxpr = jax.make_jaxpr(jax.grad(native))(probes)
    E, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
    kernel_shaped = []

    def walk(jp):
        for eqn in jp.eqns:
            if any(getattr(v.aval, "shape", None) in ((E, d, f), (E, f, d)) for v in eqn.outvars):
                kernel_shaped.append(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    # only the weight itself (stop_gradient, and Kᵀ for dx): no kernel-shaped product, sum or zeros
    assert set(kernel_shaped) <= {"stop_gradient", "transpose"}, kernel_shaped


def test_ragged_outer_is_a_per_group_product():
    rng = np.random.default_rng(0)
    h, p = rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float32)
    sizes = np.array([2, 0, 4], np.int32)
    got = np.asarray(ragged_outer(jnp.asarray(h), jnp.asarray(p), jnp.asarray(sizes)))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for e in range(3):
        lo, hi = bounds[e], bounds[e + 1]
        np.testing.assert_allclose(got[e], h[lo:hi].T @ p[lo:hi], rtol=1e-6, atol=1e-6)


def test_predicted_matches_realised_kl_through_the_routed_forward():
    """The predicted-KL probe on tiny-qwen3-moe: its JVP holds each token's chosen experts fixed (top-k is
    piecewise constant) while the router's weights over them move with the update; for a small step the
    realised KL, which re-routes, agrees with the prediction."""
    model = init_model(preset("tiny-qwen3-moe", num_layers=2), seed=1)
    attach_sketch_probes(model, SketchSpec(rank=RANK))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = jax.random.randint(jax.random.key(0), (4, 16), 0, 128)
    batch = dict(tokens=toks, attention_mask=jnp.ones_like(toks), loss_mask=jnp.ones_like(toks))
    probe = dict(tokens=toks[:2], attention_mask=jnp.ones_like(toks[:2]),
                 kl_mask=jnp.ones_like(toks[:2]).at[:, :4].set(0))
    grads = jax.jit(jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    tx = logra(rank=RANK, update_ratio=3e-3, round_bf16=False)
    updates, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
    q, realised = jax.jit(lambda p, u: predicted_and_realised_kl(graphdef, p, rest, jnp.int32(0), u, probe))(
        params, updates)
    assert float(q) > 1e-6
    assert abs(float(realised) / float(q) - 1) < 0.03, (float(q), float(realised))

    # The factored tangent equals JAX's own JVP of the plain routed forward along the dense ΔW (autodiff holds
    # top-k fixed too); central differences at a finite step would see routing flips instead.
    delta = jax.tree.map(lambda new, old: new - old, apply_updates(params, updates), params)
    z = lambda p: nnx.merge(graphdef, p, rest)(probe["tokens"])
    logits, dz = jax.jit(lambda p, d: jax.jvp(z, (p,), (d,)))(params, delta)
    mask = probe["kl_mask"].astype(jnp.float32)
    q_jvp = float(jnp.sum(kl_quadratic(logits, dz) * mask) / mask.sum())
    q_sum, count = make_kl_probe(graphdef, params, rest, jnp.int32(0), probe)(updates)
    assert abs(float(q_sum / count) / q_jvp - 1) < 1e-3, (float(q_sum / count), q_jvp)
