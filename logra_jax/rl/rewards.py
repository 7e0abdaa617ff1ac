"""Verifiable rewards: outcome correctness, an optional format bonus, and guarded batch scoring.

Outcome reward (docs/method.md §7, values configurable):
  R(response) = correct     if the response's final answer verifies against the problem
              = incorrect   otherwise (no answer, wrong answer, unparsable text)          (paper: 1 / −0.01)
  R += format_weight · 1[the response has a well-formed final answer]                    (optional, default 0)

Verification parses, never evaluates (see `answers`): math and arithmetic compare the extracted final answer
with the reference exactly as numbers or as normalised text; countdown parses the boxed expression and checks
that it uses every given number exactly once and equals the target.

`score_responses` runs each reward call in its own daemon thread with a time limit: a call that raises, returns a
non-finite or non-numeric value, or exceeds the limit scores 0 and is counted in `RewardStats`. A timed-out thread
cannot be killed; it finishes in the background and its result is discarded.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from logra_jax.rl.answers import answers_match, extract_answer, extract_boxed, parse_expression, parse_number
from logra_jax.rl.tasks import Problem

RewardFn = Callable[[str, Problem], float]


@dataclasses.dataclass(frozen=True, slots=True)
class RewardConfig:
    """Reward values and the per-call time limit.

    Attributes:
      correct: reward of a verified answer (paper: 1).
      incorrect: reward of anything else (paper: −0.01).
      format_weight: bonus added when the response has a well-formed final answer (0 disables it).
      timeout_s: wall-clock limit of one reward call in `score_responses`.
    """

    correct: float = 1.0
    incorrect: float = -0.01
    format_weight: float = 0.0
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("correct", "incorrect", "format_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"RewardConfig.{name} must be a finite number, got {value!r}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"RewardConfig.timeout_s must be > 0, got {self.timeout_s!r}")


class RewardStats(NamedTuple):
    """Counts from one `score_responses` call: calls made, calls that raised or returned a bad value, and calls
    that exceeded the time limit (the last two scored 0)."""

    num_scored: int
    num_failed: int
    num_timed_out: int


def countdown_correct(response: str, numbers: Sequence[int], target: int | str) -> bool:
    """True iff the response's final answer is an expression using each of `numbers` exactly once that equals
    `target` exactly.

    Example:
      >>> countdown_correct(r"\\boxed{(6 - 2) * 25 / 4}", [2, 4, 6, 25], 25)
      True
    """
    answer = extract_answer(response)
    if answer is None:
        return False
    parsed = parse_expression(answer)
    target_value = parse_number(str(target))
    if parsed is None or target_value is None:
        return False
    value, literals = parsed
    return value == target_value and sorted(literals) == sorted(int(n) for n in numbers)


def is_correct(response: str, problem: Problem) -> bool:
    """Verify `response` against `problem` with the task's verifier (never evaluates the text).

    Example:
      >>> from logra_jax.rl.tasks import Problem
      >>> is_correct("so \\\\boxed{1,000}", Problem(task="math", question="?", answer="1000"))
      True
    """
    if problem.task == "countdown":
        return countdown_correct(response, problem.numbers, problem.answer)
    return answers_match(extract_answer(response), problem.answer)


def has_answer_format(response: str) -> bool:
    """True iff the response has exactly one final-answer marker (one balanced non-empty `\\boxed{}` or one
    non-empty `####` line) — the shape the instructions ask for, whatever its content."""
    num_boxed = response.count("\\boxed") + response.count("\\fbox")
    num_hash = response.count("####")
    if num_boxed + num_hash != 1:
        return False
    answer = extract_boxed(response) if num_boxed else extract_answer(response)
    return answer is not None and bool(answer.strip())


def outcome_reward(response: str, problem: Problem, config: RewardConfig = RewardConfig()) -> float:
    """R = correct if `is_correct` else incorrect, plus format_weight · 1[has_answer_format].

    Example:
      >>> from logra_jax.rl.tasks import Problem
      >>> outcome_reward("#### 7", Problem(task="arithmetic", question="3+4?", answer="7"))
      1.0
    """
    value = config.correct if is_correct(response, problem) else config.incorrect
    if config.format_weight:
        value += config.format_weight * float(has_answer_format(response))
    return float(value)


def _call_with_timeout(fn: RewardFn, response: str, problem: Problem, timeout_s: float) -> tuple[str, float]:
    """('ok', value) | ('failed', 0) | ('timeout', 0)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn(response, problem)
        except Exception as e:  # the reward function is untrusted: any exception scores 0
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "timeout", 0.0
    value = box.get("value")
    if "error" in box or isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        return "failed", 0.0
    if not math.isfinite(float(value)):
        return "failed", 0.0
    return "ok", float(value)


def score_responses(responses: Sequence[str], problems: Sequence[Problem], *,
                    config: RewardConfig = RewardConfig(), reward_fn: RewardFn | None = None,
                    ) -> tuple[np.ndarray, RewardStats]:
    """Rewards [len(responses)] float32 for responses paired with their problems, each call time-limited.

    Args:
      responses: decoded response texts.
      problems: the problem of each response (repeat a problem n times for n samples per prompt).
      config: reward values and the time limit per call.
      reward_fn: (response, problem) → float; default `outcome_reward` with `config`.

    Returns:
      (rewards, stats): a call that raises, returns a non-finite or non-numeric value, or runs past
      `config.timeout_s` scores 0 and is counted in stats.num_failed / stats.num_timed_out.

    Raises:
      ValueError: if responses and problems differ in length.

    Example:
      >>> from logra_jax.rl.tasks import Problem
      >>> p = Problem(task="arithmetic", question="2+2?", answer="4")
      >>> rewards, stats = score_responses(["\\\\boxed{4}", "5"], [p, p])
      >>> float(rewards[0]), stats.num_failed
      (1.0, 0)
    """
    if len(responses) != len(problems):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(problems)} problems")
    fn = reward_fn if reward_fn is not None else (lambda r, p: outcome_reward(r, p, config))
    rewards = np.zeros(len(responses), np.float32)
    failed = timed_out = 0
    for i, (response, problem) in enumerate(zip(responses, problems)):
        status, value = _call_with_timeout(fn, response, problem, config.timeout_s)
        rewards[i] = value
        failed += status == "failed"
        timed_out += status == "timeout"
    return rewards, RewardStats(num_scored=len(responses), num_failed=failed, num_timed_out=timed_out)
