"""Routing replay in the MoE layer and the decoder: a forward replaying the model's own expert ids is bit for bit the
plain forward (stacked layers, the grouped scan of moe_layer_step > 1, the unrolled per-layer decoder); forced
other ids give a numpy per-token loop routing by them (weights from the live router); each MoE layer gets its own
slice of the ids; bad ids are rejected by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax import models
from logra_jax.models import moe
from logra_jax.models.decoder import init_model

TOKENS = np.array([[0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]], np.int32)
MASK = TOKENS != 0


@pytest.mark.parametrize("normalize", [False, True])
def test_forced_ids_route_like_a_numpy_loop_with_the_routers_weights(normalize, moe_reference, random_moe_layer):
    config = models.preset("tiny-qwen3-moe", norm_topk_prob=normalize, num_experts=5, experts_per_token=2)
    layer, rng = random_moe_layer(config)
    x = rng.standard_normal((2, 6, config.hidden_size)).astype(np.float32)
    y_own, _, own = layer.routed(jnp.asarray(x))
    # Other experts than the router's: the complement's first two where there are two, else a shifted pair.
    forced = (np.asarray(own) + 2) % config.num_experts
    assert (np.sort(forced, -1) != np.sort(np.asarray(own), -1)).any(-1).all()
    y, logits, own_again = layer.routed(jnp.asarray(x), jnp.asarray(forced, jnp.uint8))
    kernels = [np.asarray(m.kernel[...], np.float64) for m in (layer.router, layer.gate_proj, layer.up_proj,
                                                                layer.down_proj)]
    flat = x.reshape(-1, config.hidden_size).astype(np.float64)
    want = moe_reference(flat, *kernels, config.experts_per_token, normalize, forced.reshape(-1, 2))
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(y) - np.asarray(y_own)).max() > 1e-3  # the forced set really changes the output
    np.testing.assert_array_equal(own_again, own)  # the ids returned are the router's own choice
    assert logits.shape == (2, 6, config.num_experts)
    with pytest.raises(ValueError, match=r"replay ids must be \[B, T, k\]"):
        layer.routed(jnp.asarray(x), jnp.asarray(forced[..., :1]))


def test_route_replay_gathers_the_routers_probabilities():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    weights, ids = moe.route(logits, 2, False, jnp.array([[0, 2]], jnp.uint8))
    np.testing.assert_allclose(weights, [[0.1, 0.3]], rtol=1e-6)
    assert ids.dtype == jnp.int32 and ids.tolist() == [[0, 2]]
    np.testing.assert_allclose(moe.route(logits, 2, True, jnp.array([[0, 2]]))[0], [[0.25, 0.75]], rtol=1e-6)
    assert moe.expert_id_dtype(256) == jnp.uint8 and moe.expert_id_dtype(257) == jnp.uint16
    with pytest.raises(ValueError, match="num_experts"):
        moe.expert_id_dtype(0)


LAYOUTS = {"stacked": {}, "grouped": {"moe_layer_step": 2}, "unrolled": {"decode_unroll": True}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    config = models.preset("tiny-qwen3-moe", num_layers=4, **LAYOUTS[request.param])
    return request.param, config, init_model(config, seed=1)


@nnx.jit
def _routed(model, tokens, mask, experts):
    return model.routed_features(tokens, attention_mask=mask, experts=experts)


def test_replaying_the_models_own_ids_is_bitwise_the_plain_forward(layout):
    name, config, model = layout
    tokens, mask = jnp.asarray(TOKENS), jnp.asarray(MASK)
    hidden, ids = _routed(model, tokens, mask, None)
    moe_layers = config.num_layers // config.moe_layer_step
    assert ids.shape == (2, 7, moe_layers, config.experts_per_token) and ids.dtype == jnp.int32
    replayed, ids_again = _routed(model, tokens, mask, ids.astype(moe.expert_id_dtype(config.num_experts)))
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden), err_msg=name)
    np.testing.assert_array_equal(np.asarray(ids_again), np.asarray(ids), err_msg=name)
    logits = nnx.jit(lambda m, t, a, e: m(t, attention_mask=a, experts=e))
    np.testing.assert_array_equal(np.asarray(logits(model, tokens, mask, ids)),
                                  np.asarray(logits(model, tokens, mask, None)), err_msg=name)


def _blocks(model):
    """The decoder's blocks in layer order as (module, is MoE): the unrolled decoder's own, or layer i of the
    stacks (`blocks`, and `moe_blocks` under moe_layer_step > 1) cut out one at a time."""
    c = model.config
    if c.decode_unroll:
        return [(block, True) for block in model.blocks]
    graph, state = nnx.split(model.blocks)
    layer = lambda g, st, i: nnx.merge(g, jax.tree.map(lambda a: a[i], st))
    if model.moe_blocks is None:
        return [(layer(graph, state, i), True) for i in range(c.num_layers)]
    moe_graph, moe_state = nnx.split(model.moe_blocks)
    out, dense, routed = [], 0, 0
    for i in range(c.num_layers):
        if (i + 1) % c.moe_layer_step:
            out.append((layer(graph, state, dense), False))
            dense += 1
        else:
            out.append((layer(moe_graph, moe_state, routed), True))
            routed += 1
    return out


def _layer_by_layer(model, tokens, mask, experts):
    """The reference: the decoder's blocks called one at a time in Python, its j-th MoE layer routed by
    experts[:, :, j] (no scan, no stacking of the ids)."""
    B, T = tokens.shape
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    x = model._embed(tokens)
    j = 0
    for layer, (block, is_moe) in enumerate(_blocks(model)):
        x, _, _ = block(x, positions, jnp.broadcast_to(jnp.arange(T), (B, T)), mask, None, None, layer,
                        experts[:, :, j] if is_moe else None)
        j += is_moe
    return model.final_norm(x)


def test_each_moe_layer_routes_by_its_own_slice_of_forced_ids(layout):
    """Forced ids that differ from the router's in one MoE layer at a time: the decoder equals its blocks called
    one by one in Python with those ids, differs from the plain forward, and the routers up to that layer
    choose as before (their inputs do not depend on it)."""
    name, config, model = layout
    tokens, mask = jnp.asarray(TOKENS), jnp.asarray(MASK)
    plain, own = _routed(model, tokens, mask, None)
    for j in range(own.shape[2]):
        forced = own.at[:, :, j].set((own[:, :, j] + 1) % config.num_experts)
        got, own_forced = _routed(model, tokens, mask, forced)
        want = _layer_by_layer(model, tokens, mask, forced)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=(name, j))
        assert np.abs(np.asarray(got) - np.asarray(plain))[np.asarray(MASK)].max() > 1e-4, (name, j)
        np.testing.assert_array_equal(np.asarray(own_forced)[:, :, :j + 1], np.asarray(own)[:, :, :j + 1])


def test_replay_ids_of_the_wrong_shape_or_a_dense_model_are_rejected():
    model = init_model(models.preset("tiny-qwen3-moe"), seed=0)
    tokens = jnp.asarray(TOKENS)
    with pytest.raises(ValueError, match=r"experts \(replayed expert ids\) must be \[B, T, MoE layers, k\]"):
        model.routed_features(tokens, experts=jnp.zeros((2, 7, 3, 2), jnp.uint8))
    dense = init_model(models.preset("tiny"), seed=0)
    assert dense.routed_features(tokens)[1] is None
    with pytest.raises(ValueError, match="architecture='llama'"):
        dense.routed_features(tokens, experts=jnp.zeros((2, 7, 2, 2), jnp.uint8))


def test_replay_adds_no_tokens_by_experts_intermediate():
    """The replayed layer gathers the router's probabilities at the k ids: besides the [N, E] logits and
    probabilities no array has both a token axis (N or N·k) and the expert axis."""
    config = models.preset("tiny-qwen3-moe", num_experts=8, experts_per_token=2)
    layer = moe.MoE(config, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(layer)
    x, replay = jnp.zeros((3, 5, config.hidden_size)), jnp.zeros((3, 5, 2), jnp.uint8)
    jaxpr = jax.make_jaxpr(lambda s, x, r: nnx.merge(graphdef, s).routed(x, r))(state, x, replay)
    N, E = 15, config.num_experts
    for eqn in jaxpr.jaxpr.eqns:
        for var in eqn.outvars:
            shape = tuple(var.aval.shape)
            if E in shape and (N in shape or 2 * N in shape):
                assert len(shape) == 2, (eqn.primitive.name, shape)


def test_replayed_forward_sharded_equals_unsharded():
    """8 fake devices (data 2 × fsdp 2 × tensor 2), the rows and their replayed ids over the batch axes: the same
    hidden states (1e-5) and the same own choices as on one device."""
    from logra_jax.parallel import sharding as shd

    config = models.preset("tiny-qwen3-moe")
    graphdef, state = nnx.split(init_model(config, seed=1))
    tokens = jnp.asarray(np.concatenate([TOKENS, TOKENS[:, ::-1]]))
    mask = jnp.asarray(np.concatenate([MASK, MASK[:, ::-1]]))

    def run(state, tokens, mask, experts):
        return nnx.merge(graphdef, state).routed_features(tokens, attention_mask=mask, experts=experts)

    _, own = jax.jit(run)(state, tokens, mask, None)
    forced = (own + 1) % config.num_experts
    want = jax.jit(run)(state, tokens, mask, forced)
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))

    def sharded(state, tokens, mask, experts):
        with shd.use_rules(mesh):
            return run(state, tokens, mask, experts)

    state = jax.device_put(state, shd.param_shardings(state, mesh))
    batch = jax.device_put((tokens, mask, forced), shd.batch_shardings((tokens, mask, forced), mesh))
    got = jax.jit(sharded, compiler_options=shd.FAST_CPU_COMPILE)(state, *batch)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
