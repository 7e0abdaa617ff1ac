"""Problems ↔ token batches: prompt formats, left-padded prompt batches, SFT examples and response texts.

Formats:
  - "plain": the problem's question followed by a newline; responses are scored as written.
  - "chat": the question as the user turn of the tokenizer's chat template (generation prompt added).
  - "compact" (arithmetic only, for character-level models): prompt "12+7=", response "19"; the response is
    scored as the final answer ("#### " + response), so the model need not learn an answer marker.
Shapes are fixed by the caller (prompt length P), so the sampler and train step never recompile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from logra_jax.rl.tasks import Problem


class TextTokenizer(Protocol):
    """The tokenizer interface this module needs (logra_jax.models.tokenizer.Tokenizer provides it)."""

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...

    def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> list[int]: ...


PROMPT_STYLES: tuple[str, ...] = ("plain", "chat", "compact")


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How problems become prompts, SFT targets and scored responses."""

    style: Literal["plain", "chat", "compact"] = "plain"

    def __post_init__(self) -> None:
        if self.style not in PROMPT_STYLES:
            raise ValueError(f"PromptFormat.style must be 'plain', 'chat' or 'compact', got {self.style!r}")

    def _compact_question(self, problem: Problem) -> str:
        if problem.task != "arithmetic" or " = " not in problem.solution:
            raise ValueError(f"PromptFormat 'compact' supports arithmetic problems only, got task "
                             f"{problem.task!r} ({problem.question!r})")
        return problem.solution.split(" = ")[0].replace(" ", "") + "="

    def prompt_ids(self, problem: Problem, tokenizer: TextTokenizer) -> list[int]:
        """Token ids of the prompt (BOS as the tokenizer adds it)."""
        if self.style == "chat":
            return tokenizer.encode_chat([{"role": "user", "content": problem.question}])
        text = self._compact_question(problem) if self.style == "compact" else problem.question + "\n"
        return tokenizer.encode(text)

    def target_text(self, problem: Problem) -> str:
        """The response an SFT warm start teaches."""
        return problem.answer if self.style == "compact" else f"\\boxed{{{problem.answer}}}"

    def scoring_text(self, response: str) -> str:
        """The text the reward function verifies."""
        return f"#### {response.strip()}" if self.style == "compact" else response


def left_pad(rows: Sequence[Sequence[int]], length: int, pad_id: int, *, what: str = "prompt"
             ) -> tuple[np.ndarray, np.ndarray]:
    """int32 [B, length] left-padded ids and their bool mask.

    Raises:
      ValueError: a row is empty or longer than `length` (names the row and its length).
    """
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, row in enumerate(rows):
        if not 0 < len(row) <= length:
            raise ValueError(f"{what} {i} has {len(row)} tokens; it must have 1..{length}")
        ids[i, length - len(row):] = row
        mask[i, length - len(row):] = True
    return ids, mask


def encode_prompts(problems: Sequence[Problem], tokenizer: TextTokenizer, fmt: PromptFormat, length: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt batch [B, length] and mask for the sampler."""
    return left_pad([fmt.prompt_ids(p, tokenizer) for p in problems], length, tokenizer.pad_id)


def max_prompt_length(problems: Sequence[Problem], tokenizer: TextTokenizer, fmt: PromptFormat) -> int:
    """Longest prompt in tokens (fixes P for a whole run)."""
    return max(len(fmt.prompt_ids(p, tokenizer)) for p in problems)


def encode_sft(problems: Sequence[Problem], tokenizer: TextTokenizer, fmt: PromptFormat, length: int
               ) -> dict[str, np.ndarray]:
    """Teacher-forcing batch: prompt + target + EOS, left-padded to `length`; loss_mask marks target tokens.

    Returns 'tokens' int32 [B, length], 'attention_mask' and 'loss_mask' (bool [B, length]).
    """
    rows, target_lengths = [], []
    for p in problems:
        target = [*tokenizer.encode(fmt.target_text(p), add_bos=False), tokenizer.eos_id]
        rows.append(fmt.prompt_ids(p, tokenizer) + target)
        target_lengths.append(len(target))
    tokens, mask = left_pad(rows, length, tokenizer.pad_id, what="SFT example")
    loss_mask = np.zeros_like(mask)
    for i, n in enumerate(target_lengths):
        loss_mask[i, length - n:] = True
    return {"tokens": tokens, "attention_mask": mask, "loss_mask": loss_mask}


def decode_responses(tokens: np.ndarray, response_mask: np.ndarray, tokenizer: TextTokenizer,
                     prompt_length: int) -> list[str]:
    """Response texts (special tokens, EOS included, dropped) of sampler rows [prompt | response]."""
    responses = np.asarray(tokens)[:, prompt_length:]
    mask = np.asarray(response_mask).astype(bool)
    return [tokenizer.decode(row[m].tolist()) for row, m in zip(responses, mask)]
