"""Procedural tasks and GSM8K/MATH records: answers checked by independent arithmetic, determinism, validation."""

import re
from collections import Counter

import pytest

from logra_jax.rl.answers import parse_expression
from logra_jax.rl.tasks import (
    Problem,
    TaskSpec,
    arithmetic_problem,
    countdown_problem,
    generate_problem,
    inner_carries,
    math_problem,
)

_QUESTION = re.compile(r"What is (\d+) ([+\-*]) (\d+)\?")


@pytest.mark.parametrize("difficulty", [1, 2, 5])
@pytest.mark.parametrize("operations", ["+-*", "-", "*"])
def test_arithmetic_answer_and_difficulty(difficulty, operations):
    spec = TaskSpec(kind="arithmetic", difficulty=difficulty, operations=operations, seed=3)
    seen_ops = set()
    for i in range(60):
        p = arithmetic_problem(spec, i)
        a, op, b = _QUESTION.match(p.question).groups()
        seen_ops.add(op)
        x, y = int(a), int(b)
        assert int(p.answer) == {"+": x + y, "-": x - y, "*": x * y}[op]
        for operand in (a, b):
            assert len(operand) == difficulty
        assert "\\boxed{}" in p.question and p.task == "arithmetic" and p.numbers == ()
    assert seen_ops == set(operations)


def test_generation_is_a_pure_function_of_seed_and_index():
    spec = TaskSpec(kind="arithmetic", seed=7)
    assert [generate_problem(spec, i) for i in range(20)] == [generate_problem(spec, i) for i in range(20)]
    assert generate_problem(spec, 5) == arithmetic_problem(spec, 5)
    assert len({generate_problem(spec, i).question for i in range(50)}) > 40
    other = TaskSpec(kind="arithmetic", seed=8)
    assert [generate_problem(spec, i) for i in range(10)] != [generate_problem(other, i) for i in range(10)]


@pytest.mark.parametrize("count, max_number", [(2, 10), (4, 100), (6, 50)])
def test_countdown_solution_uses_every_number_once_and_hits_the_target(count, max_number):
    spec = TaskSpec(kind="countdown", count=count, max_number=max_number, max_target=500, seed=1)
    for i in range(40):
        p = countdown_problem(spec, i)
        assert len(p.numbers) == count and all(1 <= n <= max_number for n in p.numbers)
        target = int(p.answer)
        assert 1 <= target <= 500
        value, literals = parse_expression(p.solution)
        assert value == target
        assert Counter(literals) == Counter(p.numbers)
        assert str(list(p.numbers)) in p.question and str(target) in p.question


def test_countdown_gives_up_with_a_clear_error():
    # Six numbers up to 10000 rarely combine to exactly 1: a single draw misses the target range.
    spec = TaskSpec(kind="countdown", count=6, max_number=10_000, max_target=1, seed=0)
    with pytest.raises(ValueError, match="countdown_problem"):
        countdown_problem(spec, 0, max_tries=1)


def test_math_problem_gsm8k_record():
    p = math_problem({"question": "Natalia sold 48 clips... How many?",
                      "answer": "In May she sold 48/2 = <<48/2=24>>24.\n48+24 = 72\n#### 72"})
    assert p.task == "math" and p.answer == "72" and p.question.startswith("Natalia")
    assert "\\boxed{}" in p.question


def test_math_problem_math_record_nested_boxed():
    p = math_problem({"problem": "Compute x.", "solution": r"We get $x = \boxed{\frac{\sqrt{3}}{2}}$."})
    assert p.answer == r"\frac{\sqrt{3}}{2}"


def test_math_problem_prefers_explicit_answer_field():
    p = math_problem({"problem": "?", "solution": r"\boxed{wrong}", "answer": "5"})
    assert p.answer == "5"
    assert math_problem({"prompt": "?", "answer": 12}).answer == "12"
    assert math_problem({"question": "?", "answer": "7"}, instruction="").question == "?"


@pytest.mark.parametrize("record, match", [
    ({"answer": "1"}, "no 'question'"),
    ({"question": "?"}, "no answer"),
    ({"question": "?", "solution": "no box here"}, "no answer"),
    ({"question": "  ", "answer": "1"}, "no 'question'"),
])
def test_math_problem_rejects_incomplete_records(record, match):
    with pytest.raises(ValueError, match=match):
        math_problem(record)


@pytest.mark.parametrize("kwargs, field", [
    ({"kind": "sorting"}, "kind"),
    ({"difficulty": 0}, "difficulty"),
    ({"operations": "+/"}, "operations"),
    ({"operations": "++"}, "operations"),
    ({"count": 1}, "count"),
    ({"max_number": 1}, "max_number"),
    ({"seed": -1}, "seed"),
    ({"carries": "few"}, "carries"),
    ({"carries": "none", "operations": "+-"}, "carries"),
    ({"carries": "some", "difficulty": 1, "operations": "+"}, "carries"),
])
def test_task_spec_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"TaskSpec\.{field}"):
        TaskSpec(**kwargs)


def test_problem_validation_and_spec_names():
    with pytest.raises(ValueError, match=r"Problem\.task"):
        Problem(task="poetry", question="?", answer="1")
    assert TaskSpec(kind="arithmetic", difficulty=3, operations="+*", seed=2).name == "arithmetic-d3-addmul-s2"
    assert TaskSpec(kind="countdown").name.startswith("countdown-c3-n20-t100")  # the run config's defaults too
    with pytest.raises(ValueError, match="index"):
        generate_problem(TaskSpec(), -1)


def _column_carries(a, b, digits):
    """Independent reference: add the digit strings right to left as on paper, counting carries."""
    xs, ys = str(a).zfill(digits)[::-1], str(b).zfill(digits)[::-1]
    carries, carry = [], 0
    for x, y in zip(xs, ys):
        carry = (int(x) + int(y) + carry) // 10
        carries.append(carry)
    return sum(carries[:-1])


def test_inner_carries_matches_column_addition():
    for digits in (1, 2, 3):
        for a in range(0, 10**digits, 7 if digits == 3 else 1):
            for b in range(0, 10**digits, 13 if digits == 3 else 1):
                assert inner_carries(a, b, digits) == _column_carries(a, b, digits), (a, b, digits)
    with pytest.raises(ValueError, match="operands"):
        inner_carries(-1, 2, 2)


@pytest.mark.parametrize("carries", ["none", "some"])
def test_carry_modes_hold_for_every_problem(carries):
    spec = TaskSpec(kind="arithmetic", difficulty=2, operations="+", carries=carries, seed=1)
    counts = []
    for i in range(200):
        a, op, b = _QUESTION.match(arithmetic_problem(spec, i).question).groups()
        assert op == "+" and int(arithmetic_problem(spec, i).answer) == int(a) + int(b)
        counts.append(_column_carries(int(a), int(b), 2))
    assert all((c > 0) == (carries == "some") for c in counts)
    assert spec.name == f"arithmetic-d2-add-carry_{carries}-s1"
    # "any" keeps both kinds, in about the proportion of the uniform operand draw
    anyspec = TaskSpec(kind="arithmetic", difficulty=2, operations="+", seed=1)
    mixed = [_column_carries(*map(int, _QUESTION.match(arithmetic_problem(anyspec, i).question).group(1, 3)), 2)
             for i in range(200)]
    assert 0.3 < sum(c > 0 for c in mixed) / 200 < 0.7
