"""Routing in RL (MoE): the routing-mismatch metrics against numpy loops; routing replay makes the trainer's
log-probs the engine's within the sampler tests' bound (1e-4) on a constructed near-tie that the engine and the
trainer break differently, where without replay they differ; the RL train step reports the routing metrics,
replayed or not, and a replay without ids is an error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.job.phases import init_train_state, rl_train_step
from logra_jax.job.run_config import OptimizerSection
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.rl.losses import LossConfig
from logra_jax.rl.objective import make_policy_loss_fn, routed_response_logprobs
from logra_jax.rl.routing import ROUTING_METRICS, recorded_positions, routing_metrics, set_differs
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.slots import Sampler

PROMPTS = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]], np.int32)
MASK = PROMPTS != 0
P, N = PROMPTS.shape[1], 6
BOUND = 1e-4  # engine vs teacher-forced log-probs in tests/rollout/test_rollout_sampler.py (rtol = atol = 1e-4)


def _metrics_reference(engine, trainer, prompt_mask, response_mask, logp, rollout_logp, cap):
    """routing_metrics by numpy loops over rows, response tokens and layers."""
    B, T, L, _ = engine.shape
    hits = {"any": [], "layer": [], "affected": []}
    gaps, weights = {True: [], False: []}, {True: [], False: []}
    for b in range(B):
        ran = [bool(prompt_mask[b, t]) if t < P else (t - P + 1 < N and bool(response_mask[b, t - P + 1]))
               for t in range(T)]
        differ = [[ran[t] and set(engine[b, t, j]) != set(trainer[b, t, j]) for j in range(L)] for t in range(T)]
        for j in range(N):
            if not response_mask[b, j]:
                continue
            t = P + j - 1
            hits["any"].append(any(differ[t]))
            hits["layer"].extend(differ[t])
            affected = any(any(differ[u]) for u in range(t + 1))
            hits["affected"].append(affected)
            gaps[affected].append(abs(rollout_logp[b, j] - logp[b, j]))
            weights[affected].append(min(np.exp(logp[b, j] - rollout_logp[b, j]), cap))
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0
    return {"routing/mismatch_share": mean(hits["any"]), "routing/layer_mismatch_share": mean(hits["layer"]),
            "routing/affected_share": mean(hits["affected"]),
            "routing/logprob_gap_affected": mean(gaps[True]), "routing/logprob_gap_unaffected": mean(gaps[False]),
            "routing/tis_weight_affected": mean(weights[True]), "routing/tis_weight_unaffected": mean(weights[False])}


def test_routing_metrics_equal_numpy_loops():
    rng = np.random.default_rng(1)
    B, L, k, E = 8, 3, 2, 4
    engine = np.stack([rng.permutation(E)[:k] for _ in range(B * (P + N) * L)]).reshape(B, P + N, L, k)
    trainer = engine.copy()
    flips = rng.random((B, P + N, L)) < 0.05
    trainer[flips] = (trainer[flips] + 1) % E  # a shifted set: differs unless it maps {a, b} onto itself
    swapped = rng.random((B, P + N, L)) < 0.3
    trainer[swapped] = trainer[swapped][:, ::-1]  # the same set in another order is no difference
    prompt_mask = np.arange(P)[None] >= rng.integers(0, 3, B)[:, None]
    response_mask = np.arange(N)[None] < rng.integers(1, N + 1, B)[:, None]
    logp, rollout_logp = -rng.random((B, N)) * 3, -rng.random((B, N)) * 3
    got = routing_metrics(jnp.asarray(engine, jnp.uint8), jnp.asarray(trainer), jnp.asarray(prompt_mask),
                          jnp.asarray(response_mask), jnp.asarray(logp), jnp.asarray(rollout_logp), tis_cap=2.0)
    want = _metrics_reference(engine, trainer, prompt_mask, response_mask, logp, rollout_logp, 2.0)
    assert set(got) == set(ROUTING_METRICS)
    for name in ROUTING_METRICS:
        np.testing.assert_allclose(float(got[name]), want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert 0 < want["routing/mismatch_share"] < want["routing/affected_share"] < 1
    np.testing.assert_array_equal(set_differs(jnp.array([[1, 3]]), jnp.array([[3, 1]])), [False])
    np.testing.assert_array_equal(recorded_positions(jnp.array([[0, 1]]), jnp.array([[1, 1, 0]])),
                                  [[False, True, True, False, False]])
    with pytest.raises(ValueError, match="differ in shape"):
        set_differs(jnp.zeros((2, 2)), jnp.zeros((2, 3)))


@pytest.fixture(scope="module")
def near_tie():
    """A tiny top-1 MoE whose first layer's router columns 0 and 1 are equal up to δ·u (δ = 1e-6 of their scale): a
    near-tie for every token routed to one of them, which the engine, running the same weights with the sign of δ
    flipped (a router perturbed far below bfloat16's rounding), breaks the other way. Returns the trainer's model
    and the engine's rollout."""
    config = preset("tiny-qwen3-moe", tie_embeddings=False, experts_per_token=1, norm_topk_prob=False)
    graphdef, state = nnx.split(init_model(config, seed=3))
    state = jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, state)
    router = state["blocks"]["mlp"]["router"]["kernel"][...]  # [L, D, E]
    u = jax.random.normal(jax.random.key(7), router.shape[1:2])
    delta = 1e-6 * float(jnp.abs(router).max())
    trainer = state
    trainer["blocks"]["mlp"]["router"]["kernel"] = trainer["blocks"]["mlp"]["router"]["kernel"].replace(
        router.at[0, :, 1].set(router[0, :, 0] + delta * u))
    engine = jax.tree.map(lambda x: x, trainer)
    engine["blocks"]["mlp"]["router"]["kernel"] = engine["blocks"]["mlp"]["router"]["kernel"].replace(
        router.at[0, :, 1].set(router[0, :, 0] - delta * u))
    sampling = SamplingConfig(max_new_tokens=N, eos_id=1, pad_id=0, num_samples=4, slots=3, decode_steps=2)
    model = nnx.merge(graphdef, trainer)
    out = Sampler(model, sampling)(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0),
                                   state=nnx.state(nnx.merge(graphdef, engine)))
    return model, out


def _trainer_logprobs(model, out, replay):
    @nnx.jit
    def run(model, tokens, mask, experts):
        return routed_response_logprobs(model, tokens, mask, P, experts=experts)
    return run(model, out.tokens, out.attention_mask(), out.experts if replay else None)


def test_replay_makes_the_trainers_logprobs_the_engines_on_a_near_tie(near_tie):
    model, out = near_tie
    valid = np.asarray(out.response_mask)
    engine = np.asarray(out.logprobs)[valid]
    plain, own = _trainer_logprobs(model, out, replay=False)
    replayed, own_replayed = _trainer_logprobs(model, out, replay=True)
    recorded = np.asarray(recorded_positions(out.prompt_mask, out.response_mask))
    flipped = np.asarray(set_differs(out.experts, own))[..., 0] & recorded  # layer 0: the near-tie
    tied = recorded & (np.asarray(own)[..., 0, 0] < 2)  # tokens whose layer-0 top-1 is one of the tied pair
    assert tied[recorded].mean() > 0.3 and flipped[tied].all()  # the engine broke every such tie the other way
    assert not flipped[recorded & ~tied].any()
    assert np.abs(np.asarray(plain)[valid] - engine).max() > 100 * BOUND  # without replay: other experts
    np.testing.assert_allclose(np.asarray(replayed)[valid], engine, rtol=BOUND, atol=BOUND)
    # Layer 0's router sees the same inputs replayed or not; layer 1's sees the engine's (its experts then agree).
    np.testing.assert_array_equal(np.asarray(own_replayed)[:, :, 0], np.asarray(own)[:, :, 0])
    assert not np.asarray(set_differs(out.experts, own_replayed))[..., 1][recorded].any()


@pytest.mark.parametrize("replay", [False, True])
def test_train_step_reports_routing_metrics(near_tie, replay):
    model, out = near_tie
    valid = out.response_mask
    batch = {"tokens": out.tokens, "attention_mask": out.attention_mask(), "response_mask": valid,
             "advantages": jnp.linspace(-1.0, 1.0, out.tokens.shape[0]), "rollout_logprobs": out.logprobs,
             "finished": out.finished, "experts": out.experts}
    plan, graphdef, state, rest = init_train_state(OptimizerSection(name="adamw", learning_rate=1e-4), model)
    step = jax.jit(rl_train_step(graphdef, plan, LossConfig(tis_cap=2.0), P, routing_replay=replay))
    _, metrics, _ = step(state, rest, batch)
    for name in ROUTING_METRICS:
        assert np.isfinite(float(metrics[name])), name
    assert float(metrics["routing/mismatch_share"]) > 0.3  # measured whether or not replay overrode it
    gap = float(metrics["routing/logprob_gap_affected"])
    assert (gap < BOUND) if replay else (gap > 10 * BOUND), gap
    loss_fn = make_policy_loss_fn(LossConfig(), P, routing_replay=True)
    with pytest.raises(ValueError, match=r"routing_replay needs batch\['experts'\]"):
        loss_fn(model, {k: v for k, v in batch.items() if k != "experts"})


def test_routing_replay_config_is_validated():
    from logra_jax.job.run_config import RunConfig

    assert RunConfig().rollout.routing_replay is False
    assert RunConfig.from_dict({"rollout": {"routing_replay": True}}).rollout.routing_replay is True
    with pytest.raises(ValueError, match=r"config\.rollout\.routing_replay = True: needs rollout\.engine='jax'"):
        RunConfig.from_dict({"rollout": {"routing_replay": True, "engine": "vllm"}})
    with pytest.raises(ValueError, match=r"config\.rollout\.routing_replay = 'yes'"):
        RunConfig.from_dict({"rollout": {"routing_replay": "yes"}})


def test_routing_replay_of_a_dense_model_is_rejected_when_the_step_is_built():
    from logra_jax.job.phases import Trainer, rollout_experts
    from logra_jax.job.run_config import RunConfig
    from logra_jax.parallel.sharding import MeshConfig, make_mesh

    run = RunConfig.from_dict({"rollout": {"routing_replay": True}, "optimizer": {"rank": 4}})
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    trainer = Trainer.build(run, init_model(preset("tiny"), seed=0), mesh)
    with pytest.raises(ValueError, match=r"routing_replay = True: the model \('llama'\) has no experts"):
        trainer.rl_step(run, mesh, P)
    moe = preset("tiny-qwen3-moe")
    assert rollout_experts(moe, "jax") == (2, 2, jnp.uint8) and rollout_experts(moe, "vllm") is None
    assert rollout_experts(preset("tiny"), "jax") is None
