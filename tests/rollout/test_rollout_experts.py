"""The slot engine records each token's experts (`Rollout.experts`): for the same tokens they are the experts a full
teacher-forced forward chooses wherever the choice is not a near-tie (prompt tokens from the prefill, response
tokens from the decode steps, under continuous batching with refills), 0…k − 1 where the engine ran no token; a
dense model records none; a worker's rollout arrays without experts still make a Rollout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.rollout.sampling import Rollout, SamplingConfig
from logra_jax.rollout.slots import Sampler

PROMPTS = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13], [0, 0, 0, 40, 41]], np.int32)
MASK = PROMPTS != 0
P, N = PROMPTS.shape[1], 8
# slots < rows and a few decode steps per chunk: rows start at different times, prompts are prefilled by refills
SAMPLING = SamplingConfig(max_new_tokens=N, eos_id=1, pad_id=0, num_samples=3, slots=4, decode_steps=3)


def _sharp(config, seed=1):
    """Weights 4× the init scale: varied routing and next-token distributions (as test_rollout_sampler's model)."""
    graphdef, state = nnx.split(init_model(config, seed=seed))
    return nnx.merge(graphdef, jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, state))


def _probs(model, tokens, mask):
    """Every MoE layer's router probabilities [B, T, L', E] of a full forward, float64."""
    logits = nnx.jit(lambda m, t, a: m.router_logits(t, attention_mask=a))(model, tokens, mask)
    z = np.moveaxis(np.asarray(logits, np.float64), 0, 2)
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("overrides", [{}, {"moe_layer_step": 2, "num_layers": 4}], ids=["every", "step2"])
def test_recorded_experts_are_the_full_forwards_where_no_near_tie(overrides):
    config = preset("tiny-qwen3-moe", tie_embeddings=False, **overrides)
    model = _sharp(config)
    out = Sampler(model, SAMPLING)(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0))
    experts = np.asarray(out.experts)
    layers, k = config.num_layers // config.moe_layer_step, config.experts_per_token
    assert experts.shape == (9, P + N, layers, k) and experts.dtype == np.uint8
    probs = _probs(model, out.tokens, out.attention_mask())
    top = np.sort(probs, -1)[..., ::-1]
    margin = top[..., k - 1] - top[..., k]  # k-th minus (k+1)-th probability: a near-tie below 1e-5
    want = np.argsort(-probs, -1, kind="stable")[..., :k]
    response = np.asarray(out.response_mask)
    recorded = np.concatenate([np.asarray(out.prompt_mask), response[:, 1:], np.zeros((9, 1), bool)], 1)
    same = (np.sort(experts, -1) == np.sort(want, -1)).all(-1)  # [R, T, L']
    clear = margin > 1e-5
    assert clear[recorded].mean() > 0.95
    assert same[recorded[..., None] & clear].all()
    assert len({tuple(e) for e in experts[recorded].reshape(-1, k)}) > 2  # the routing varies
    np.testing.assert_array_equal(experts[~recorded], np.broadcast_to(np.arange(k), experts[~recorded].shape))
    assert recorded[:, P:].sum() == response.sum() - 9  # every response token but each row's last


def test_a_dense_model_records_none_and_rollouts_without_experts_load():
    out = Sampler(init_model(preset("tiny"), seed=0), SAMPLING)(jnp.asarray(PROMPTS), jnp.asarray(MASK),
                                                                jax.random.key(0))
    assert out.experts is None
    arrays = {name: np.asarray(v) for name, v in out._asdict().items() if v is not None}
    assert Rollout.from_arrays(arrays).experts is None
    arrays["experts"] = np.zeros((9, P + N, 2, 2), np.uint8)
    assert Rollout.from_arrays(arrays).experts.dtype == jnp.uint8


def test_colocated_engine_on_8_devices_records_a_one_device_samplers_experts_split_over_rows():
    """The colocated engine (trainer FSDP 8, decode layout data 4 × tensor 2): the same tokens and recorded
    experts as a one-device sampler on its weights, the ids' rows split over the decode layout's data axis."""
    from logra_jax.parallel.sharding import MeshConfig, make_mesh, param_shardings
    from logra_jax.rollout.engine import ColocatedEngine

    config = preset("tiny-qwen3-moe", tie_embeddings=False)
    sampling = SamplingConfig(max_new_tokens=N, eos_id=1, pad_id=0, num_samples=2, slots=4, decode_steps=3)
    prompts = np.concatenate([PROMPTS, PROMPTS[:1, ::-1]])
    mask = prompts != 0
    mesh = make_mesh(MeshConfig(fsdp=8))
    _, params, rest = nnx.split(_sharp(config), nnx.Param, ...)
    params = jax.device_put(params, param_shardings(params, mesh))
    engine = ColocatedEngine(config, sampling, mesh, params, rest, tensor=2)
    got = engine.generate(prompts, mask, jax.random.key(3))
    want = Sampler(nnx.merge(engine.graphdef, jax.device_get(engine.state)), sampling)(
        jnp.asarray(prompts), jnp.asarray(mask), jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.experts), np.asarray(want.experts))
    experts = got.experts
    assert np.prod(experts.sharding.shard_shape(experts.shape)) * 4 == experts.size, experts.sharding
