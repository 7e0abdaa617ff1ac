"""Held-out evaluation: greedy decoding of every problem once, scored by the task's verifier."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from logra_jax.rl.prompts import PromptFormat, TextTokenizer, decode_responses, encode_prompts
from logra_jax.rl.rewards import is_correct
from logra_jax.rl.tasks import Problem
from logra_jax.rollout.sampling import Rollout

Generate = Callable[[np.ndarray, np.ndarray, jax.Array], Rollout]


def greedy_accuracy(generate: Generate, problems: Sequence[Problem], tokenizer: TextTokenizer,
                    fmt: PromptFormat, prompt_length: int, batch_size: int) -> tuple[float, list[str]]:
    """Fraction of `problems` whose greedy response is correct, and the responses.

    Args:
      generate: (prompts [B, P], mask, key) -> Rollout with one greedy sample per prompt (a Sampler with
        temperature 0, or a rollout worker's equivalent).
      problems: the held-out set.
      tokenizer, fmt, prompt_length: how prompts are encoded (P fixed for the run).
      batch_size: prompts per call; the last batch is padded with repeats (not counted), so shapes stay fixed.
    """
    if not problems:
        raise ValueError("greedy_accuracy: no problems to evaluate")
    responses: list[str] = []
    key = jax.random.key(0)  # unused by greedy decoding; fixed for reproducibility
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start:start + batch_size])
        real = len(chunk)
        chunk += [chunk[-1]] * (batch_size - real)
        prompts, mask = encode_prompts(chunk, tokenizer, fmt, prompt_length)
        out = generate(prompts, mask, key)
        responses += decode_responses(np.asarray(out.tokens), np.asarray(out.response_mask), tokenizer,
                                      prompt_length)[:real]
    correct = [is_correct(fmt.scoring_text(r), p) for r, p in zip(responses, problems)]
    return float(np.mean(correct)), responses
