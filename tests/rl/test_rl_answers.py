"""Answer extraction, numeric normalisation and expression parsing, on ordinary and adversarial text."""

import ast
import builtins
import operator
import random
from fractions import Fraction

import pytest

from logra_jax.rl.answers import (
    answers_match,
    extract_answer,
    extract_boxed,
    extract_hash_answer,
    normalize_answer,
    parse_expression,
    parse_number,
)


@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{a{b{c}}d} tail", "a{b{c}}d"),
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"first \boxed{7} then a cut \boxed{8", None),
    (r"\boxed{", None),
    (r"no box at all", None),
    (r"\boxed 5 apples", "5"),
    (r"\fbox{3}", "3"),
    (r"\boxed{}", ""),
    (r"}}}\boxed{x}}}}", "x"),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 1\n#### 2\n#### 3 \n", "3"),
    ("#### 1,000 dollars\nextra line", "1,000 dollars"),
    ("####   \n", None),
    ("no marker", None),
])
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


def test_extract_answer_takes_the_marker_that_comes_last():
    assert extract_answer(r"#### 3 but actually \boxed{4}") == "4"
    assert extract_answer(r"\boxed{4} hmm no\n#### 5") == "5"
    assert extract_answer(r"\boxed{4} then an empty ####") == "4"
    assert extract_answer("plain text") is None


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)),
    ("-7", Fraction(-7)),
    ("−7", Fraction(-7)),
    ("+3", Fraction(3)),
    ("1,234,567", Fraction(1234567)),
    ("$1,234.50", Fraction(2469, 2)),
    ("0.5", Fraction(1, 2)),
    (".25", Fraction(1, 4)),
    ("3/4", Fraction(3, 4)),
    ("-3/4", Fraction(-3, 4)),
    (r"\frac{3}{4}", Fraction(3, 4)),
    (r"-\dfrac{10}{4}", Fraction(-5, 2)),
    (r"\tfrac{1}{3}", Fraction(1, 3)),
    (r"\frac12", Fraction(1, 2)),
    ("18 dollars", Fraction(18)),
    ("18 dollars per day.", Fraction(18)),
    (r"18\text{ dollars}", Fraction(18)),
    ("5cm", Fraction(5)),
    (r"50\%", Fraction(50)),
    ("50%", Fraction(50)),
    (r"90^\circ", Fraction(90)),
    ("x = 12", Fraction(12)),
    (r"\$ 3", Fraction(3)),
    ("72.", Fraction(72)),
    (r"\left( 3 \right)", None),
    ("1,2", None),
    ("12,34", None),
    ("3/0", None),
    (r"\frac{1}{0}", None),
    ("seven", None),
    ("", None),
    ("1 2", None),
    ("9" * 100, None),
    # units: real ones are ignored, magnitude words applied, anything else makes the text not a number
    ("5 km/h", Fraction(5)),
    ("10 m^2", Fraction(10)),
    ("3 square feet", Fraction(3)),
    ("12 inches", Fraction(12)),
    ("60 mph", Fraction(60)),
    ("7 students", Fraction(7)),
    ("1/2 dollars", Fraction(1, 2)),
    ("100 million", Fraction(10**8)),
    ("1.5 million dollars", Fraction(1_500_000)),
    ("2 dozen", Fraction(24)),
    ("2x", None),  # a variable
    ("2 x", None),
    ("5i", None),  # an imaginary unit
    ("2 pi", None),
    ("5 or six", None),  # hedged
    ("5 or 6", None),
    ("5 dollars per", None),
    # what is counted (a plural noun after a space) leaves the value alone; words that change it, name another
    # quantity or hedge do not (docs/grader.md)
    ("7 apples", Fraction(7)),
    ("5 pencils per box", Fraction(5)),
    (r"5\text{ apples}", Fraction(5)),
    ("3 children", Fraction(3)),
    ("5 apples per basket", Fraction(5)),
    ("19 qwe", None),  # not a plural noun: junk after a number is not what it counts
    ("5apples", None),  # no space: a product of variables to the parser, as "2abc" is
    ("5 squared", None),
    ("2 thirds", None),
    ("3 halves", None),
    ("5 factorial", None),
    ("2 theta", None),
    ("5 maybe", None),
    ("5 to six", None),
    # powers of ten as mathematics writes them; calculator E-notation is not a number
    ("10^3", Fraction(1000)),
    (r"10^{12}", Fraction(10**12)),
    ("10^12", None),  # TeX: 10^1 followed by 2
    (r"1 \times 10^{3}", Fraction(1000)),
    (r"-2.5\times10^{-3}", Fraction(-1, 400)),
    (r"3 \cdot 10^8", Fraction(3 * 10**8)),
    ("1e3", None),
    ("2.5E-3", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("predicted, reference, match", [
    ("1,000", "1000", True),
    ("1000.00", "1,000", True),
    (r"\frac{1}{2}", "0.5", True),
    ("0.50 dollars", "1/2", True),
    ("72", "72.0", True),
    ("-0", "0", True),
    ("71", "72", False),
    (r"\left(1, 2\right)", "(1,2)", True),
    (r"\text{(A)}", "(A)", True),
    ("x^2 + 1", "x^2+1", True),
    ("x^2 + 2", "x^2+1", False),
    (None, "1", False),
    ("   ", "", False),
    ("18 dollars per day", "18", True),
    ("2x", "2", False),
    ("5i", "5", False),
    ("100 million", "100", False),
    ("100 million", "100,000,000", True),
    ("5 or six", "5", False),
    ("2", "2x", False),  # a reference "2x" is not the number 2
    ("2x", "2x", True),
    (r"\sqrt3", r"\sqrt{3}", True),
    (r"2\sqrt3", r"2 \sqrt{3}", True),
    (r"\sqrt12", r"\sqrt{12}", False),  # TeX: \sqrt12 is \sqrt{1}2
    ("5 apples", "5", True),
    ("5 apples", "6", False),
    ("5 squared", "25", False),  # not evaluated: compared as text
    ("1e3", "1000", False),
    ("1e3", "1e3", True),  # as text
    (r"10^{3}", "1000", True),
])
def test_answers_match(predicted, reference, match):
    assert answers_match(predicted, reference) is match


def test_normalize_answer_canonical_forms():
    assert normalize_answer("0.750") == "3/4"
    assert normalize_answer(r"\dfrac{6}{8}") == "3/4"
    assert normalize_answer("-4.0") == "-4"
    assert normalize_answer(r"\left( 1, 2 \right)") == "(1,2)"


_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _oracle(expr: str) -> Fraction:
    """Independent reference: Python's own grammar (ast, never executed) folded with exact fractions."""
    def walk(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        return _AST_OPS[type(node.op)](walk(node.left), walk(node.right))
    return walk(ast.parse(expr, mode="eval").body)


def _random_expression(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        return str(rng.randint(1, 99))
    left, right = _random_expression(rng, depth - 1), _random_expression(rng, depth - 1)
    op = rng.choice("+-*/")
    return f"({left} {op} {right})" if rng.random() < 0.5 else f"{left} {op} {right}"


def test_parse_expression_matches_python_grammar_on_random_expressions():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        expr = _random_expression(rng, 4)
        try:
            expected = _oracle(expr)
        except ZeroDivisionError:
            assert parse_expression(expr) is None
            continue
        value, literals = parse_expression(expr)
        assert value == expected, expr
        assert list(literals) == [int(t) for t in expr.replace("(", " ").replace(")", " ").split() if t.isdigit()]
        checked += 1
    assert checked > 250


@pytest.mark.parametrize("text, value", [
    ("(6 - 2) * 25 / 4 = 25", Fraction(25)),
    ("3 × 4 ÷ 2", Fraction(6)),
    ("2x3", Fraction(6)),
    ("10 - 2 - 3", Fraction(5)),
    ("64 / 4 / 2", Fraction(8)),
    ("1 / 3 + 1 / 6", Fraction(1, 2)),
])
def test_parse_expression_values(text, value):
    assert parse_expression(text)[0] == value


@pytest.mark.parametrize("text", [
    "", "()", "1 +", "(1 + 2", "1 + 2)", "-1 + 2", "1 + -2", "2 ** 3", "1 / (2 - 2)", "1.5 + 2", "abs(3)",
    "__import__('os').system('true')", "(lambda: 1)()", "1; 2", "1234567890123 + 1",
    "(" * 1000 + "1" + ")" * 1000, "1+" * 1000 + "1", "(" * 40 + "1" + ")" * 40, "1+" * 100 + "1",
])
def test_parse_expression_rejects(text):
    assert parse_expression(text) is None


def test_adversarial_text_is_parsed_never_executed(monkeypatch, tmp_path):
    called = []

    def trap(*args, **kwargs):
        called.append(args)
        raise AssertionError("executed model text")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, trap)
    sentinel = tmp_path / "pwned"
    injections = [
        rf"\boxed{{__import__('pathlib').Path('{sentinel}').touch()}}",
        f"#### __import__('os').system('touch {sentinel}')",
        r"\boxed{eval('1+1')}",
        r"\boxed{1 if __import__('sys') else 2}",
        r"\boxed{{}}}{{\boxed{{{\boxed{",
        "\\boxed{" * 5000,
        "#### " + "9" * 10_000,
        r"\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",
    ]
    for text in injections:
        answer = extract_answer(text)
        assert not answers_match(answer, "2")
        if answer is not None:
            normalize_answer(answer)
            assert parse_expression(answer) is None
    monkeypatch.undo()
    assert called == []
    assert not sentinel.exists()


# The three labelled cases, as whole responses graded by the reward (the decisions: docs/grader.md).
_SUFFIX = " Let me double-check this: the computation above is consistent, nothing changes." * 400  # 33,600 chars


@pytest.mark.parametrize("response, reference, correct", [
    (r"There are $\boxed{5 apples}$ left.", "5", True),
    (r"There are $\boxed{5 \text{apples}}$ left.", "5", True),
    (r"So $x = \boxed{1e3}$.", "1000", False),
    (r"So $x = \boxed{10^{3}}$.", "1000", True),
    (r"The answer is $\boxed{42}$." + _SUFFIX, "42", True),
    (r"The answer is $\boxed{42}$." + _SUFFIX + r" No: $\boxed{41}$.", "42", False),
    ("x" * 50_000 + r" \boxed{5}", "5", True),
])
def test_labelled_cases(response, reference, correct):
    assert answers_match(extract_answer(response), reference) is correct

