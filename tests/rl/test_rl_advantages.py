"""Advantage estimators against per-group numpy loops, the registry, the running baseline and dynamic sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.rl.advantages import (
    ESTIMATORS,
    advantage_estimator,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    grpo_advantages,
    init_baseline,
    reinforce_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)


def _rewards(num_groups: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    r = rng.choice([1.0, -0.01, 0.5], size=(num_groups, n)).astype(np.float32)
    r[0] = 1.0  # a group of equal rewards (no signal)
    return r.reshape(-1)


def _loop(rewards: np.ndarray, n: int, per_group) -> np.ndarray:
    out = []
    for start in range(0, len(rewards), n):
        out.extend(per_group([float(x) for x in rewards[start:start + n]]))
    return np.array(out)


def _grpo_ref(g, eps=1e-6):
    m = sum(g) / len(g)
    s = (sum((x - m) ** 2 for x in g) / (len(g) - 1)) ** 0.5
    return [(x - m) / (s + eps) for x in g]


def _rloo_ref(g):
    return [x - (sum(g) - x) / (len(g) - 1) for x in g]


def _dr_ref(g):
    return [x - sum(g) / len(g) for x in g]


@pytest.mark.parametrize("n", [2, 4, 5])
def test_group_estimators_match_loops(n):
    r = _rewards(6, n, seed=n)
    np.testing.assert_allclose(grpo_advantages(jnp.asarray(r), n), _loop(r, n, _grpo_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rloo_advantages(jnp.asarray(r), n), _loop(r, n, _rloo_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dr_grpo_advantages(jnp.asarray(r), n), _loop(r, n, _dr_ref), rtol=1e-5, atol=1e-6)


def test_equal_rewards_give_zero_advantage_everywhere():
    r = jnp.full((8,), 0.3)
    for fn in (grpo_advantages, rloo_advantages, dr_grpo_advantages):
        np.testing.assert_array_equal(fn(r, 4), np.zeros(8))
    np.testing.assert_array_equal(reinforce_pp_advantages(r, 4), np.zeros(8))


def test_rloo_identity_with_group_mean():
    r = jnp.asarray(_rewards(3, 4, seed=0))
    np.testing.assert_allclose(rloo_advantages(r, 4), 4 / 3 * dr_grpo_advantages(r, 4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group_baseline", [False, True])
def test_reinforce_pp_matches_numpy_whitening(group_baseline):
    r = _rewards(4, 3, seed=5)
    x = np.asarray(_loop(r, 3, _dr_ref)) if group_baseline else r.astype(np.float64)
    expected = (x - x.mean()) / (x.std() + 1e-6)
    got = reinforce_pp_advantages(jnp.asarray(r), 3, group_baseline=group_baseline)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_baseline", [False, True])
def test_reinforce_pp_token_whitening_matches_numpy_over_tokens(group_baseline):
    """whiten="token": verl's masked whitening of the returns broadcast over each response's tokens; the reference
    builds the token array explicitly (value x_i repeated L_i times) and whitens it with numpy."""
    r = _rewards(4, 3, seed=6)
    lengths = np.random.default_rng(7).integers(1, 40, size=r.shape)
    lengths[2] = 0  # an empty response weighs nothing
    x = np.asarray(_loop(r, 3, _dr_ref)) if group_baseline else r.astype(np.float64)
    tokens = np.repeat(x, lengths)
    expected = (x - tokens.mean()) / (tokens.std() + 1e-6)
    est = advantage_estimator("reinforce++", group_size=3, group_baseline=group_baseline, whiten="token")
    got, _ = est.update(jnp.asarray(r), est.init(), lengths=jnp.asarray(lengths))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    per_response = reinforce_pp_advantages(jnp.asarray(r), 3, group_baseline=group_baseline)
    assert np.abs(np.asarray(per_response) - expected).max() > 0.05  # the default is a different estimator
    # equal rewards still give exactly 0
    np.testing.assert_array_equal(reinforce_pp_advantages(jnp.full((6,), 0.3), 3, whiten="token",
                                                          lengths=jnp.arange(6)), np.zeros(6))


def test_reinforce_pp_whitening_is_validated():
    r = jnp.ones(4)
    with pytest.raises(ValueError, match="whiten must be one of"):
        reinforce_pp_advantages(r, whiten="tokens")
    with pytest.raises(ValueError, match="whiten must be one of"):
        advantage_estimator("reinforce++", group_size=1, whiten="sequence")
    with pytest.raises(ValueError, match="lengths is required by whiten='token'"):
        reinforce_pp_advantages(r, whiten="token")
    with pytest.raises(ValueError, match="only used there"):
        reinforce_pp_advantages(r, lengths=jnp.ones(4))
    with pytest.raises(ValueError, match=r"lengths must be \[B·n\]"):
        reinforce_pp_advantages(r, whiten="token", lengths=jnp.ones(3))


def test_reinforce_running_baseline_matches_a_python_loop():
    rng = np.random.default_rng(0)
    batches = [rng.choice([1.0, -0.01], size=8).astype(np.float32) for _ in range(5)]
    state = init_baseline()
    baseline = None
    for batch in batches:
        adv, state = reinforce_advantages(jnp.asarray(batch), state, momentum=0.1)
        b = 0.0 if baseline is None else baseline
        np.testing.assert_allclose(adv, batch - b, rtol=1e-6, atol=1e-6)
        mean = float(batch.mean())
        baseline = mean if baseline is None else 0.9 * baseline + 0.1 * mean
        np.testing.assert_allclose(state.baseline, baseline, rtol=1e-6)
    assert int(state.count) == 5


def test_registry_and_uniform_interface_under_jit():
    r = jnp.asarray(_rewards(2, 4, seed=1))
    for name in ESTIMATORS:
        est = advantage_estimator(name, group_size=4)
        state = est.init()
        adv, new_state = jax.jit(est.update)(r, state)
        assert adv.shape == r.shape and adv.dtype == jnp.float32
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
    est = advantage_estimator("grpo", group_size=4, eps=1e-3)
    np.testing.assert_allclose(est.update(r, est.init())[0], grpo_advantages(r, 4, eps=1e-3))
    est = advantage_estimator("reinforce", group_size=1, momentum=0.5)
    _, s = est.update(jnp.array([1.0, 0.0]), est.init())
    _, s = est.update(jnp.array([0.0, 0.0]), s)
    assert float(s.baseline) == pytest.approx(0.25)


def test_registry_rejects_unknown_names_and_bad_options():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*grpo"):
        advantage_estimator("ppo", group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        advantage_estimator("grpo", group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        advantage_estimator("rloo", group_size=1)
    with pytest.raises(TypeError):
        advantage_estimator("rloo", group_size=2, momentum=0.1)
    with pytest.raises(ValueError, match="rewards must be"):
        grpo_advantages(jnp.ones(6), 4)
    with pytest.raises(ValueError, match="momentum"):
        reinforce_advantages(jnp.ones(2), init_baseline(), momentum=0.0)


def test_dynamic_sampling_mask_drops_zero_variance_groups():
    r = jnp.array([1.0, 1.0, 1.0, 1.0, -0.01, 1.0, 0.5, 0.5, 0.2, 0.2 + 1e-6, 0.2, 0.2])
    np.testing.assert_array_equal(dynamic_sampling_mask(r, 4), np.repeat([False, True, True], 4))
    np.testing.assert_array_equal(dynamic_sampling_mask(r, 4, atol=1e-5), np.repeat([False, True, False], 4))
    np.testing.assert_array_equal(dynamic_sampling_mask(r, 2), np.repeat([False, False, True, False, True, False], 2))
