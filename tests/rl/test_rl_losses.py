"""Losses against numpy loops (values and gradients), masking, aggregation edge cases and the combined loss."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.rl.losses import (
    LossConfig,
    aggregate,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    reinforce_loss,
    truncated_is_weights,
)

B, T = 4, 6


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.05, 0.95, (B, T))).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, (B, T))).astype(np.float32)
    rollout = (old + rng.normal(0, 0.5, (B, T))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.8, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    lengths = [T, 3, 0, 1]  # a response cut at max length, ordinary ones, and an empty one
    mask = np.array([[t < n for t in range(T)] for n in lengths])
    return logp, old, rollout, ref, adv, mask


def _ppo_ref(lp, old, a, eps_low, eps_high, c):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss


def _per_token_ref(fn, *arrays, mask):
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                out[b, t] = fn(b, t, *arrays)
    return out


@pytest.mark.parametrize("eps_low, eps_high, dual_clip", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_ppo_clip_matches_loop(eps_low, eps_high, dual_clip):
    logp, old, _, _, adv, mask = _batch()
    expected = _per_token_ref(lambda b, t: _ppo_ref(logp[b, t], old[b, t], adv[b], eps_low, eps_high, dual_clip),
                              mask=mask)
    got = ppo_clip_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps_low=eps_low,
                        eps_high=eps_high, dual_clip=dual_clip)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_ppo_clip_cases_by_hand():
    one = jnp.ones((1, 1))
    log = lambda r: jnp.log(jnp.array([[r]]))
    # A > 0: ratio above 1 + eps_high is clipped (clip-higher lets it go to 1.28 instead of 1.2).
    assert float(ppo_clip_loss(log(1.5), 0 * one, jnp.array([1.0]), one, eps_high=0.28)[0, 0]) == pytest.approx(-1.28)
    # A < 0 with a huge ratio: max(−A r, −A clip) = 10·2, dual clip caps it at c·|A| = 3·2.
    a = jnp.array([-2.0])
    assert float(ppo_clip_loss(log(10.0), 0 * one, a, one)[0, 0]) == pytest.approx(20.0, rel=1e-5)
    assert float(ppo_clip_loss(log(10.0), 0 * one, a, one, dual_clip=3.0)[0, 0]) == pytest.approx(6.0)
    # A < 0 with a small ratio: −A clip(r) = 2·0.8 dominates −A r = 2·0.5.
    assert float(ppo_clip_loss(log(0.5), 0 * one, a, one)[0, 0]) == pytest.approx(1.6)


def test_ppo_gradient_matches_analytic():
    logp, old, _, _, adv, mask = _batch(1)
    eps_low, eps_high = 0.2, 0.28
    grad = jax.grad(lambda lp: ppo_clip_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                             eps_low=eps_low, eps_high=eps_high).sum())(jnp.asarray(logp))

    def d_ref(b, t):
        r = math.exp(logp[b, t] - old[b, t])
        a = adv[b]
        clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
        return 0.0 if clipped else -a * r

    np.testing.assert_allclose(grad, _per_token_ref(d_ref, mask=mask), rtol=1e-5, atol=1e-6)


def test_reinforce_loss_and_gradient():
    logp, _, _, _, adv, mask = _batch(2)
    expected = _per_token_ref(lambda b, t: -adv[b] * logp[b, t], mask=mask)
    np.testing.assert_allclose(reinforce_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask)), expected,
                               rtol=1e-6)
    grad = jax.grad(lambda lp: reinforce_loss(lp, jnp.asarray(adv), jnp.asarray(mask)).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(grad, _per_token_ref(lambda b, t: -adv[b], mask=mask), rtol=1e-6)
    token_adv = jnp.broadcast_to(jnp.asarray(adv)[:, None], (B, T))
    np.testing.assert_allclose(reinforce_loss(jnp.asarray(logp), token_adv, jnp.asarray(mask)), expected, rtol=1e-6)


def test_truncated_is_weights_match_loop_and_stop_gradient():
    _, old, rollout, _, _, mask = _batch(3)
    expected = _per_token_ref(lambda b, t: min(math.exp(old[b, t] - rollout[b, t]), 1.2), mask=mask)
    got = truncated_is_weights(jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask), cap=1.2)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert got.max() <= np.float32(1.2) and (expected == 1.2).sum() >= 2
    grad = jax.grad(lambda o: truncated_is_weights(o, jnp.asarray(rollout), jnp.asarray(mask)).sum())(jnp.asarray(old))
    np.testing.assert_array_equal(grad, np.zeros((B, T)))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamp", [None, 0.3])
def test_kl_estimators_match_loop(estimator, clamp):
    logp, _, _, ref, _, mask = _batch(4)

    def k(b, t):
        d = float(logp[b, t]) - float(ref[b, t])
        value = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[estimator]
        return value if clamp is None else min(max(value, -clamp), clamp)

    got = kl_penalty(jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(mask), estimator=estimator, clamp=clamp)
    np.testing.assert_allclose(got, _per_token_ref(k, mask=mask), rtol=1e-5, atol=1e-6)


def test_k3_gradient_and_extreme_ratio():
    logp, _, _, ref, _, mask = _batch(5)
    grad = jax.grad(lambda lp: kl_penalty(lp, jnp.asarray(ref), jnp.asarray(mask), clamp=None).sum())(
        jnp.asarray(logp))
    expected = _per_token_ref(lambda b, t: 1.0 - math.exp(-(float(logp[b, t]) - float(ref[b, t]))), mask=mask)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)
    # log π_θ − log π_ref = −200: exp(200) overflows float32, the clamp must still give exactly κ, with a finite
    # (zero) gradient; also with a −inf reference log-prob, for every estimator.
    one = jnp.ones((1, 1))
    assert float(kl_penalty(-200.0 * one, 0 * one, one, clamp=10.0)[0, 0]) == 10.0
    for estimator in ("k1", "k2", "k3"):
        for ref_logp in (-jnp.inf, jnp.inf):
            value, grad = jax.value_and_grad(lambda lp, r=ref_logp, e=estimator: kl_penalty(
                lp, r * one, one, estimator=e, clamp=10.0).sum())(-1.0 * one)
            assert abs(float(value)) == 10.0 and float(grad[0, 0]) == 0.0, (estimator, ref_logp)


def test_aggregation_modes_by_hand_with_empty_and_full_responses():
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert float(aggregate(x, m, "token_mean")) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert float(aggregate(x, m, "seq_mean")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(aggregate(x, m, "seq_mean_token_sum_norm")) == pytest.approx(10 / (3 * 3))
    assert float(aggregate(x, m, "seq_mean_token_sum_norm", max_len=5)) == pytest.approx(10 / (3 * 5))
    for mode in ("token_mean", "seq_mean", "seq_mean_token_sum_norm"):
        assert float(aggregate(x, jnp.zeros_like(m), mode)) == 0.0
    with pytest.raises(ValueError, match="unknown mode 'sum'"):
        aggregate(x, m, "sum")


def test_masked_positions_never_leak_values_or_gradients():
    logp, old, rollout, ref, adv, mask = _batch(6)
    poison = lambda a: jnp.where(jnp.asarray(mask), jnp.asarray(a), jnp.nan)
    config = LossConfig(kl_beta=0.1, eps_high=0.28, dual_clip=3.0)
    loss, grad = jax.value_and_grad(lambda lp: policy_loss(
        lp, jnp.asarray(adv), jnp.asarray(mask), config=config, old_logp=poison(old), rollout_logp=poison(rollout),
        ref_logp=poison(ref))[0])(jnp.where(jnp.asarray(mask), jnp.asarray(logp), -jnp.inf))
    assert np.isfinite(float(loss))
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("policy", ["ppo", "reinforce"])
def test_policy_loss_composes_the_pieces(aggregation, policy):
    logp, old, rollout, ref, adv, mask = _batch(7)
    config = LossConfig(policy=policy, eps_low=0.2, eps_high=0.28, tis_cap=2.0, kl_beta=0.05, kl_estimator="k3",
                        kl_clamp=10.0, aggregation=aggregation, max_len=8)

    def ref_token(b, t):
        w = min(math.exp(old[b, t] - rollout[b, t]), 2.0)
        pg = _ppo_ref(logp[b, t], old[b, t], adv[b], 0.2, 0.28, None) if policy == "ppo" else -adv[b] * logp[b, t]
        d = float(logp[b, t]) - float(ref[b, t])
        return w * pg + 0.05 * min(math.exp(-d) + d - 1, 10.0)

    per_token = _per_token_ref(ref_token, mask=mask)
    counts = mask.sum(1)
    expected = {"token_mean": per_token.sum() / mask.sum(),
                "seq_mean": np.mean([per_token[b].sum() / counts[b] for b in range(B) if counts[b]]),
                "seq_mean_token_sum_norm": per_token.sum() / (B * 8)}[aggregation]
    loss, metrics = policy_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), config=config,
                                old_logp=jnp.asarray(old), rollout_logp=jnp.asarray(rollout), ref_logp=jnp.asarray(ref))
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert set(metrics) == {"pg_loss", "kl", "tis_weight", "tis_capped", "clip_fraction", "outside_clip_fraction"}
    ratio = np.exp(logp.astype(np.float64) - old)
    a = np.broadcast_to(adv[:, None], (B, T))
    binds = ((a > 0) & (ratio > 1.28)) | ((a < 0) & (ratio < 0.8))
    outside = (ratio > 1.28) | (ratio < 0.8)
    assert float(metrics["clip_fraction"]) == pytest.approx(binds[mask].mean(), abs=1e-6)
    assert float(metrics["outside_clip_fraction"]) == pytest.approx(outside[mask].mean(), abs=1e-6)
    assert 0 < binds[mask].sum() < outside[mask].sum()  # the batch tells the two apart


def test_clip_fraction_counts_tokens_where_the_clip_binds():
    """By hand, ε_low = 0.2, ε_high = 0.28: the clip binds only where the advantage pushes the ratio out."""
    ratios = [[1.5, 0.5, 1.0, 1.0],  # A > 0: binds (r > 1.28); outside but not binding; inside; padding
              [0.5, 1.5, 1.1, 5.0],  # A < 0: binds (r < 0.8); outside but not binding; inside; masked (r = 5)
              [2.0, 1.0, 1.0, 1.0]]  # A = 0: outside, never binds
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    logp = jnp.log(jnp.array(ratios))
    _, metrics = policy_loss(logp, jnp.array([1.0, -1.0, 0.0]), mask, old_logp=jnp.zeros((3, 4)),
                             config=LossConfig(eps_low=0.2, eps_high=0.28, tis_cap=None))
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / 7)
    assert float(metrics["outside_clip_fraction"]) == pytest.approx(5 / 7)


def test_extreme_log_ratios_give_finite_loss_and_gradient():
    """log r = ±100 and −inf rollout / reference log-probs: without the ±20 log-ratio clamp exp overflows and
    0·∞ = NaN reaches the gradient even on clipped tokens."""
    one = jnp.ones((1, 1))
    for a in (1.0, -1.0):
        for log_r in (100.0, -100.0):
            loss, grad = jax.value_and_grad(lambda lp, a=a: ppo_clip_loss(lp, 0 * one, jnp.array([a]), one,
                                                                          dual_clip=3.0).sum())(log_r * one)
            assert np.isfinite(float(loss)) and np.isfinite(float(grad[0, 0])), (a, log_r)
            assert float(grad[0, 0]) == 0.0  # clipped, capped or clamped: no gradient
    # A > 0, r = e^100: the clipped branch −A (1 + ε_high); A < 0: the dual clip's −c A.
    assert float(ppo_clip_loss(100 * one, 0 * one, jnp.array([1.0]), one)[0, 0]) == pytest.approx(-1.2)
    assert float(ppo_clip_loss(100 * one, 0 * one, jnp.array([-1.0]), one, dual_clip=3.0)[0, 0]) == 3.0

    logp, old, rollout, ref, adv, mask = _batch(9)
    bad = np.zeros_like(mask)
    bad[0, 1] = bad[1, 0] = True  # two response tokens with garbage log-probs
    old_bad = np.where(bad, logp - 100.0, old)  # log r = +100
    rollout_bad = np.where(bad, -np.inf, rollout)
    ref_bad = np.where(bad, -np.inf, ref)
    for estimator in ("k1", "k2", "k3"):
        config = LossConfig(eps_high=0.28, tis_cap=2.0, kl_beta=0.1, kl_estimator=estimator)
        loss, grad = jax.value_and_grad(lambda lp, config=config: policy_loss(
            lp, jnp.asarray(adv), jnp.asarray(mask), config=config, old_logp=jnp.asarray(old_bad),
            rollout_logp=jnp.asarray(rollout_bad), ref_logp=jnp.asarray(ref_bad))[0])(jnp.asarray(logp))
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all(), estimator

    # In the normal range the clamp changes nothing: per-token values and gradients equal the unclamped loops.
    def ref_token(b, t):
        w = min(math.exp(old[b, t] - rollout[b, t]), 2.0)
        d = float(logp[b, t]) - float(ref[b, t])
        return w * _ppo_ref(logp[b, t], old[b, t], adv[b], 0.2, 0.28, None) + 0.1 * min(math.exp(-d) + d - 1, 10.0)

    config = LossConfig(eps_high=0.28, tis_cap=2.0, kl_beta=0.1, kl_estimator="k3")
    loss = policy_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), config=config,
                       old_logp=jnp.asarray(old), rollout_logp=jnp.asarray(rollout), ref_logp=jnp.asarray(ref))[0]
    assert float(loss) == pytest.approx(_per_token_ref(ref_token, mask=mask).sum() / mask.sum(), rel=1e-5)


def test_on_policy_default_gives_the_reinforce_gradient():
    logp, _, _, _, adv, mask = _batch(8)
    config = LossConfig(tis_cap=None, aggregation="token_mean")
    grad = jax.grad(lambda lp: policy_loss(lp, jnp.asarray(adv), jnp.asarray(mask), config=config)[0])(
        jnp.asarray(logp))
    expected = _per_token_ref(lambda b, t: -adv[b], mask=mask) / mask.sum()
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_row_caps_lower_the_importance_weights_of_their_rows():
    """tis_cap_rows: each row's weights capped at min(C, its cap), by a loop; tis_capped counts the tokens whose
    raw weight exp(old − rollout) the effective cap truncated; the loss weighs each token by its capped weight."""
    logp, old, rollout, _, adv, mask = _batch(11)
    rows = np.array([0.5, 9.0, 1.0, 1.2], np.float32)  # row 1 keeps C = 2; the others are clipped harder
    config = LossConfig(policy="reinforce", tis_cap=2.0)
    loss, metrics = policy_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), config=config,
                                old_logp=jnp.asarray(old), rollout_logp=jnp.asarray(rollout),
                                tis_cap_rows=jnp.asarray(rows))
    raw = np.exp(old.astype(np.float64) - rollout)
    cap = np.minimum(2.0, rows)[:, None]
    w = np.where(mask, np.minimum(raw, cap), 0.0)
    assert float(metrics["tis_weight"]) == pytest.approx(w[mask].mean(), rel=1e-5)
    assert float(metrics["tis_capped"]) == pytest.approx((raw > cap)[mask].mean(), abs=1e-6)
    assert float(loss) == pytest.approx((w * -adv[:, None] * logp)[mask].sum() / mask.sum(), rel=1e-5)
    _, plain = policy_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), config=config,
                           old_logp=jnp.asarray(old), rollout_logp=jnp.asarray(rollout))
    assert float(metrics["tis_capped"]) > float(plain["tis_capped"])  # the lower caps bind on more tokens
    with pytest.raises(ValueError, match="TIS off"):
        policy_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), config=LossConfig(tis_cap=None),
                    tis_cap_rows=jnp.asarray(rows))


def test_validation():
    one = jnp.ones((1, 1))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(one, one, jnp.ones(1), one, dual_clip=0.5)
    with pytest.raises(ValueError, match="unknown estimator 'k4'"):
        kl_penalty(one, one, one, estimator="k4")
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(one, one, one, cap=0.0)
    with pytest.raises(ValueError, match=r"LossConfig\.aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="rollout_logp is required"):
        policy_loss(one, jnp.ones(1), one, config=LossConfig())
    with pytest.raises(ValueError, match="ref_logp is required"):
        policy_loss(one, jnp.ones(1), one, config=LossConfig(tis_cap=None, kl_beta=0.1))
