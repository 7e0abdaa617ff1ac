"""Tasks with verifiable answers: procedurally generated arithmetic and countdown, and GSM8K/MATH-style records.

A task yields `Problem`s: plain strings and integers, no tokens (tokenisation and chat formatting belong to the
tokenizer). Generation is a pure function of (seed, index), so any example can be regenerated on any host and
a dataset's content does not depend on the order it was produced in.

- arithmetic, difficulty d ≥ 1: `a op b` with op ∈ {+, -, *} and two d-digit operands (d = 1 allows 0);
  additions can be restricted to those that carry between operand columns, or to those that never do
  (`carries`; see `inner_carries`).
- countdown: `count` numbers in [1, max_number] and a target reachable by combining every number exactly once
  with + - * / (exact intermediate integers only, so a solution without fractions always exists); the problem
  keeps one such solution.
- math: a record from a GSM8K (`question`, `answer` with `####`) or MATH (`problem`, `solution` with
  `\\boxed{}`, optional `answer`) JSON object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from logra_jax.rl.answers import extract_answer

TaskKind = Literal["arithmetic", "countdown", "math"]
TASK_KINDS: tuple[str, ...] = ("arithmetic", "countdown", "math")
GENERATED_KINDS: tuple[str, ...] = ("arithmetic", "countdown")  # the kinds TaskSpec generates
CARRY_MODES: tuple[str, ...] = ("any", "none", "some")

BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """One prompt and what it takes to check a response.

    Attributes:
      task: "arithmetic", "countdown" or "math"; selects the verifier in `rewards`.
      question: the prompt text (instructions included).
      answer: the reference answer (a number as text; for countdown the target).
      numbers: countdown's available numbers (each must be used exactly once); empty otherwise.
      solution: a worked solution or reference expression when known (never used for scoring).
    """

    task: str
    question: str
    answer: str
    numbers: tuple[int, ...] = ()
    solution: str = ""

    def __post_init__(self) -> None:
        if self.task not in TASK_KINDS:
            raise ValueError(f"Problem.task must be one of {TASK_KINDS}, got {self.task!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class TaskSpec:
    """How to generate a procedural task.

    Attributes:
      kind: "arithmetic" or "countdown".
      seed: base seed; example i is drawn from numpy's Generator seeded with (seed, i).
      difficulty: arithmetic operand digits (1-9).
      operations: arithmetic operators drawn from, a subset of "+-*".
      count: countdown numbers per problem (2-6).
      max_number: countdown numbers are drawn from [1, max_number].
      max_target: countdown targets lie in [1, max_target].
      carries: additions only ("+"): "any" (no restriction), "none" (no carry between operand columns) or
        "some" (at least one); operands are redrawn from the example's generator until the rule holds.
    """

    kind: str = "arithmetic"
    seed: int = 0
    difficulty: int = 2
    operations: str = "+"
    count: int = 3
    max_number: int = 20
    max_target: int = 100
    carries: str = "any"

    def __post_init__(self) -> None:
        if self.kind not in GENERATED_KINDS:
            raise ValueError(f"TaskSpec.kind must be 'arithmetic' or 'countdown', got {self.kind!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"TaskSpec.seed must be a non-negative integer, got {self.seed!r}")
        if not 1 <= self.difficulty <= 9:
            raise ValueError(f"TaskSpec.difficulty must be in [1, 9], got {self.difficulty!r}")
        if not self.operations or set(self.operations) - set("+-*") or len(set(self.operations)) != len(
                self.operations):
            raise ValueError(f"TaskSpec.operations must be distinct characters of '+-*', got {self.operations!r}")
        if not 2 <= self.count <= 6:
            raise ValueError(f"TaskSpec.count must be in [2, 6], got {self.count!r}")
        if not 2 <= self.max_number <= 10_000:
            raise ValueError(f"TaskSpec.max_number must be in [2, 10000], got {self.max_number!r}")
        if self.max_target < 1:
            raise ValueError(f"TaskSpec.max_target must be >= 1, got {self.max_target!r}")
        if self.carries not in CARRY_MODES:
            raise ValueError(f"TaskSpec.carries must be one of {CARRY_MODES}, got {self.carries!r}")
        if self.carries != "any":
            if self.kind != "arithmetic" or self.operations != "+":
                raise ValueError(f"TaskSpec.carries={self.carries!r} needs kind='arithmetic' and operations='+', "
                                 f"got kind={self.kind!r}, operations={self.operations!r}")
            if self.carries == "some" and self.difficulty < 2:
                raise ValueError("TaskSpec.carries='some' needs difficulty >= 2: one-digit operands have a single "
                                 "column, so nothing carries between operand columns")

    @property
    def name(self) -> str:
        """A short identifier of the spec (used for on-disk dataset configs)."""
        if self.kind == "arithmetic":
            ops = self.operations.replace("+", "add").replace("-", "sub").replace("*", "mul")
            carries = "" if self.carries == "any" else f"-carry_{self.carries}"
            return f"arithmetic-d{self.difficulty}-{ops}{carries}-s{self.seed}"
        return f"countdown-c{self.count}-n{self.max_number}-t{self.max_target}-s{self.seed}"


def _operand(rng: np.random.Generator, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


def inner_carries(a: int, b: int, digits: int) -> int:
    """How many of the `digits - 1` lower columns of the column addition a + b (a, b ≥ 0) carry into the next.

    Column i (units: i = 0) carries when a_i + b_i + (carry into i) ≥ 10. A carry out of the top operand column
    is not counted: it only prepends a 1 to the answer (12 + 91 = 103 has none, 15 + 17 = 32 has one).

    Example:
      >>> inner_carries(15, 17, 2), inner_carries(12, 91, 2), inner_carries(999, 1, 3)
      (1, 0, 2)
    """
    if a < 0 or b < 0:
        raise ValueError(f"inner_carries: operands must be >= 0, got {a} and {b}")
    count, carry = 0, 0
    for i in range(digits - 1):
        carry = int((a // 10**i) % 10 + (b // 10**i) % 10 + carry >= 10)
        count += carry
    return count


def _carries_ok(spec: TaskSpec, a: int, b: int) -> bool:
    if spec.carries == "any":
        return True
    return (inner_carries(a, b, spec.difficulty) > 0) == (spec.carries == "some")


def arithmetic_problem(spec: TaskSpec, index: int, *, max_tries: int = 10_000) -> Problem:
    """The `index`-th arithmetic problem of `spec`: `a op b` with `difficulty`-digit operands.

    With spec.carries other than "any", operands are redrawn from the same generator until they satisfy it.

    Raises:
      ValueError: no operands satisfying spec.carries in `max_tries` draws.

    Example:
      >>> p = arithmetic_problem(TaskSpec(kind="arithmetic", difficulty=3), 0)
      >>> p.task, len(p.question) > 0
      ('arithmetic', True)
    """
    rng = np.random.default_rng((spec.seed, index))
    for _ in range(max_tries):
        a, b = _operand(rng, spec.difficulty), _operand(rng, spec.difficulty)
        if _carries_ok(spec, a, b):
            break
    else:
        raise ValueError(f"arithmetic_problem: no operands with carries={spec.carries!r} in {max_tries} draws "
                         f"for {spec}")
    op = spec.operations[int(rng.integers(len(spec.operations)))]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(task="arithmetic", question=f"What is {a} {op} {b}? {BOXED_INSTRUCTION}", answer=str(value),
                   solution=f"{a} {op} {b} = {value}")


def _combine(rng: np.random.Generator, items: list[tuple[int, str]]) -> tuple[int, str]:
    """Fold the (value, expression) items into one by random binary operations with integer results."""
    items = list(items)
    while len(items) > 1:
        i, j = rng.choice(len(items), size=2, replace=False)
        (x, ex), (y, ey) = items[i], items[j]
        options = [(x + y, f"({ex} + {ey})"), (x * y, f"{ex} * {ey}")]
        if x > y:
            options.append((x - y, f"({ex} - {ey})"))
        if y > 0 and x % y == 0:
            options.append((x // y, f"{ex} / ({ey})"))
        value, expr = options[int(rng.integers(len(options)))]
        items = [it for k, it in enumerate(items) if k not in (i, j)] + [(value, expr)]
    return items[0]


def countdown_problem(spec: TaskSpec, index: int, *, max_tries: int = 64) -> Problem:
    """The `index`-th countdown problem of `spec`: numbers, a target in [1, max_target] and one solution.

    Raises:
      ValueError: if no target in range was found in `max_tries` draws (a spec whose numbers cannot reach it).

    Example:
      >>> p = countdown_problem(TaskSpec(kind="countdown", count=3, max_number=20), 0)
      >>> len(p.numbers), 1 <= int(p.answer) <= 1000
      (3, True)
    """
    rng = np.random.default_rng((spec.seed, index))
    for _ in range(max_tries):
        numbers = [int(n) for n in rng.integers(1, spec.max_number + 1, size=spec.count)]
        target, expr = _combine(rng, [(n, str(n)) for n in numbers])
        if 1 <= target <= spec.max_target:
            question = (f"Using the numbers {numbers}, each exactly once, and the operations +, -, *, / with "
                        f"parentheses, write an expression equal to {target}. Put the expression in \\boxed{{}}.")
            return Problem(task="countdown", question=question, answer=str(target), numbers=tuple(numbers),
                           solution=expr)
    raise ValueError(f"countdown_problem: no target in [1, {spec.max_target}] after {max_tries} draws for {spec}")


def generate_problem(spec: TaskSpec, index: int) -> Problem:
    """The `index`-th problem of a procedural task (arithmetic or countdown)."""
    if index < 0:
        raise ValueError(f"generate_problem: index must be >= 0, got {index}")
    if spec.kind == "arithmetic":
        return arithmetic_problem(spec, index)
    return countdown_problem(spec, index)


def _first_text(record: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = record.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def math_problem(record: Mapping[str, Any], *, instruction: str = BOXED_INSTRUCTION) -> Problem:
    """A `Problem` from a GSM8K- or MATH-style JSON object.

    The question is the first of `question`, `problem`, `prompt`; the answer is `answer` (its `####` or
    `\\boxed{}` part when it has one, else the whole field) or else the final answer of `solution`.

    Raises:
      ValueError: if the record has no question or no extractable answer.

    Example:
      >>> math_problem({"question": "2+2?", "answer": "2+2=4\\n#### 4"}).answer
      '4'
    """
    question = _first_text(record, ("question", "problem", "prompt"))
    if question is None:
        raise ValueError(f"math_problem: record has no 'question', 'problem' or 'prompt' text: keys {sorted(record)}")
    answer_field = record.get("answer")
    solution = _first_text(record, ("solution", "answer")) or ""
    answer = None
    if isinstance(answer_field, (int, float)) and not isinstance(answer_field, bool):
        answer = str(answer_field)
    elif isinstance(answer_field, str) and answer_field.strip():
        answer = extract_answer(answer_field) or answer_field.strip()
    elif solution:
        answer = extract_answer(solution)
    if answer is None:
        raise ValueError(f"math_problem: no answer in 'answer' or 'solution' of record with keys {sorted(record)}")
    text = f"{question.strip()} {instruction}".strip() if instruction else question.strip()
    return Problem(task="math", question=text, answer=answer, solution=solution)
