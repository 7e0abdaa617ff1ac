"""Outcome and format rewards, countdown verification, and the guarded batch scorer (failures, timeouts)."""

import threading

import numpy as np
import pytest

from logra_jax.rl.rewards import (
    RewardConfig,
    countdown_correct,
    has_answer_format,
    is_correct,
    outcome_reward,
    score_responses,
)
from logra_jax.rl.tasks import Problem, TaskSpec, countdown_problem

ARITH = Problem(task="arithmetic", question="What is 1200 - 166?", answer="1034")
GSM = Problem(task="math", question="?", answer="1,000")
COUNTDOWN = Problem(task="countdown", question="?", answer="24", numbers=(2, 3, 4, 6))


@pytest.mark.parametrize("response, problem, correct", [
    (r"1200 - 166 = 1034, so \boxed{1034}", ARITH, True),
    ("#### 1,034", ARITH, True),
    (r"\boxed{1034.0}", ARITH, True),
    (r"\boxed{1035}", ARITH, False),
    ("the answer is 1034", ARITH, False),
    (r"\boxed{1034} no wait \boxed{1033}", ARITH, False),
    (r"\boxed{1000 dollars}", GSM, True),
    ("#### 1000", GSM, True),
    (r"\boxed{(2 + 6) * (4 - 3)}", COUNTDOWN, False),
    (r"\boxed{6 * 4 * (3 - 2)}", COUNTDOWN, True),
    (r"\boxed{(6 - 2) * (4 + 3) - 4}", COUNTDOWN, False),
    (r"\boxed{6 * 4}", COUNTDOWN, False),
    (r"\boxed{6 / (1 - 3 / 4) + 2 - 2}", COUNTDOWN, False),
    (r"\boxed{6 * 4 * (3 - 2) = 24}", COUNTDOWN, True),
    (r"\boxed{24}", COUNTDOWN, False),
    (r"\boxed{__import__('os').system('true')}", COUNTDOWN, False),
])
def test_is_correct(response, problem, correct):
    assert is_correct(response, problem) is correct


def test_countdown_correct_exact_fractions():
    assert countdown_correct(r"\boxed{8 / (3 - 8 / 3)}", [3, 3, 8, 8], 24)
    assert not countdown_correct(r"\boxed{8 / (3 - 8 / 3)}", [3, 3, 8, 8], 23)
    assert not countdown_correct(r"\boxed{8 / (3 - 3)}", [3, 3, 8], 24)


def test_generated_countdown_solutions_score_correct():
    spec = TaskSpec(kind="countdown", count=4, seed=11)
    for i in range(20):
        p = countdown_problem(spec, i)
        assert is_correct(f"\\boxed{{{p.solution}}}", p)
        assert not is_correct(f"\\boxed{{{p.solution} + 1}}", p)


def test_outcome_reward_values_and_format_bonus():
    paper = RewardConfig()
    assert outcome_reward(r"\boxed{1034}", ARITH, paper) == 1.0
    assert outcome_reward(r"\boxed{1}", ARITH, paper) == pytest.approx(-0.01)
    custom = RewardConfig(correct=2.0, incorrect=0.0, format_weight=0.5)
    assert outcome_reward(r"\boxed{1034}", ARITH, custom) == 2.5
    assert outcome_reward(r"\boxed{1}", ARITH, custom) == 0.5
    assert outcome_reward("1034", ARITH, custom) == 0.0
    assert outcome_reward(r"\boxed{1034} \boxed{1034}", ARITH, custom) == 2.0


@pytest.mark.parametrize("response, ok", [
    (r"\boxed{3}", True), ("#### 3", True), (r"\boxed{3} #### 3", False), (r"\boxed{}", False),
    (r"\boxed{3", False), ("####", False), ("3", False), (r"\boxed{1}\boxed{2}", False),
])
def test_has_answer_format(response, ok):
    assert has_answer_format(response) is ok


def test_score_responses_default_reward():
    rewards, stats = score_responses([r"\boxed{1034}", "no idea", "#### 1034"], [ARITH] * 3)
    np.testing.assert_array_equal(rewards, np.array([1.0, -0.01, 1.0], np.float32))
    assert rewards.dtype == np.float32
    assert stats.num_scored == 3 and stats.num_failed == 0 and stats.num_timed_out == 0


def test_failing_and_hanging_reward_functions_score_zero_and_are_counted():
    release = threading.Event()

    def reward_fn(response, problem):
        if response == "raise":
            raise RuntimeError("boom")
        if response == "hang":
            release.wait()
            return 1.0
        if response == "nan":
            return float("nan")
        if response == "text":
            return "1.0"
        return 0.75

    responses = ["fine", "raise", "hang", "nan", "text", "fine"]
    try:
        rewards, stats = score_responses(responses, [ARITH] * 6, reward_fn=reward_fn,
                                         config=RewardConfig(timeout_s=0.05))
    finally:
        release.set()
    np.testing.assert_array_equal(rewards, np.array([0.75, 0, 0, 0, 0, 0.75], np.float32))
    assert stats.num_failed == 3 and stats.num_timed_out == 1 and stats.num_scored == 6


def test_reward_config_and_input_validation():
    with pytest.raises(ValueError, match="timeout_s"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="incorrect"):
        RewardConfig(incorrect=float("nan"))
    with pytest.raises(ValueError, match="2 responses but 1 problems"):
        score_responses(["a", "b"], [ARITH])
