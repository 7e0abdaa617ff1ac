"""Reading answers out of model text: final-answer extraction, numeric normalisation, arithmetic expressions.

Model text is parsed, never evaluated: every function here is a small hand-written scanner or parser whose
running time is linear in the length of its input, so adversarial text cannot execute code, recurse without
bound, or trigger regex backtracking.

Final answer: the content of the last `\\boxed{...}` (braces balanced, nesting allowed) or the rest of the line
after the last `####`, whichever marker comes last in the whole text, however much text follows it (the scan is
linear in the text's length).

Numbers are compared exactly as fractions: "1,234" = "1234", "0.5" = "1/2" = "\\frac{1}{2}", "$18" = "18 dollars"
= "18\\text{ dollars}", "50\\%" = "50", "2 million" = "2000000", "10^3" = "1 \\times 10^{3}" = "1000"; anything not
numeric is compared as normalised text. Words after a number leave its value alone when they name what is counted
or measured: units from UNIT_WORDS (currencies, measures, "per …" phrases), or a plural noun after a space ("5
apples") that is not in VALUE_WORDS, the words that change a value, name another one or hedge ("5 squared",
"2 thirds", "2 pi", "5 or six"); magnitude words are applied ("2 million"). A single letter
that is not a unit is a variable: "2x", "5i" are not numbers. Calculator E-notation ("1e3") is not a number: in
mathematical text e is Euler's number, and the math graders of verl and TRL (math_verify) reject it too.
The rules, each case and the reasons are in docs/grader.md.
"""

from __future__ import annotations

import re
from fractions import Fraction

# Longest answer normalised as text (the final answer, not the response: responses are scanned whole).
MAX_ANSWER_CHARS = 20_000
# Longest answer string considered numeric; longer ones are compared as text.
MAX_NUMBER_CHARS = 64
# Expression limits for countdown answers (tokens and parenthesis depth).
MAX_EXPRESSION_TOKENS = 128
MAX_EXPRESSION_DEPTH = 32

_BOXED = ("\\boxed", "\\fbox")
_HASH = "####"

_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")
_WORD = re.compile(r"\s*([A-Za-z]+|/)(?:\^\{?[23]\}?)?\.?")
_SQRT_SHORT = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
# Words that may follow a number and leave its value alone (compared lower-case, plural "s" optional):
# currencies, measures (SI and imperial, time, speed, angle), and the counted things of math word problems
# (Minerva's normalisation list). A single letter is a unit only here: "x", "i", "n" are variables.
UNIT_WORDS: frozenset[str] = frozenset({
    "dollar", "usd", "cent", "euro", "eur", "pound", "gbp", "yen", "yuan", "rupee", "buck",
    "meter", "metre", "m", "cm", "mm", "km", "kilometer", "kilometre",
    "centimeter", "centimetre", "millimeter", "millimetre", "inch", "in", "ft", "foot", "feet",
    "yard", "yd", "mile", "mi",
    "gram", "g", "kg", "kilogram", "mg", "milligram", "lb", "lbs", "ounce", "oz", "ton", "tonne",
    "liter", "litre", "l", "ml", "milliliter", "millilitre", "gallon", "gal", "quart", "pint", "cup",
    "second", "sec", "s", "minute", "min", "hour", "hr", "h", "day", "week", "month", "year", "yr", "decade", "century",
    "mph", "kph", "kmh", "degree", "deg", "radian", "percent",
    "square", "sq", "cubic",
    "unit", "point", "way", "integer", "digit", "student", "meal", "edge",
    "multiple", "time", "people", "person", "item", "piece", "page", "inches", "centuries",
})
# Words that may not follow a number as the name of what it counts: they change its value ("5 squared", "2 thirds"),
# name another quantity ("2 pi", "3 theta"), join or hedge ("5 or six", "5 to 6", "5 maybe"). Plural "s" optional.
VALUE_WORDS: frozenset[str] = frozenset({
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty",
    "fifty", "sixty", "seventy", "eighty", "ninety",
    "half", "halves", "third", "quarter", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
    "eleventh", "twelfth", "twentieth", "hundredth", "thousandth", "millionth",
    "plus", "minus", "times", "over", "divided", "multiplied", "squared", "cubed", "factorial", "sqrt", "power",
    "mod", "modulo", "choose", "log", "ln", "exp", "sin", "cos", "tan", "cot", "csc", "arcsin", "arccos", "arctan",
    "pi", "tau", "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
    "sigma", "phi", "chi", "psi", "omega", "infinity", "inf",
    "and", "or", "nor", "to", "than", "but", "not", "no", "either", "neither", "maybe", "perhaps", "probably",
    "possibly", "approximately", "approx", "roughly", "about", "around", "nearly", "almost", "least", "most",
})
# Plurals without a final "s" that may name what a number counts ("3 children").
IRREGULAR_PLURALS: frozenset[str] = frozenset({"children", "men", "women", "mice", "geese", "teeth", "sheep", "fish",
                                               "deer", "oxen", "dice", "cattle"})
_VOWELS = frozenset("aeiouy")
# Magnitude words after a number multiply it ("2 million" = 2000000); they are applied, never ignored.
MAGNITUDE_WORDS: dict[str, int] = {"dozen": 12, "hundred": 100, "thousand": 10**3, "million": 10**6,
                                   "billion": 10**9, "trillion": 10**12}
# Scientific notation as mathematics writes it: "10^3", "2.5 \\times 10^{-3}", "3 \\cdot 10^8" (exponent ≤ 3 digits).
_POWER_OF_TEN = re.compile(r"(?:([+-]?(?:\d+(?:\.\d+)?|\.\d+))\s*(?:\\times|\\cdot|×|·|\*)\s*)?10\s*\^\s*"
                           r"(?:\{\s*([+-]?\d{1,3})\s*\}|(\d))")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"([+-]?)\\[dt]?frac(\d)(\d)")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")
_LHS = re.compile(r"[A-Za-z]\w{0,15}\s*=")
_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "\\%", "$", "%", "^\\circ", "^{\\circ}",
          "°", "\\displaystyle")


def _last_boxed(text: str) -> tuple[int, str | None]:
    """(start index, content) of the last boxed macro; content None when it is unbalanced or empty of a group.

    Only the last occurrence counts (an earlier box is never the final answer), which keeps the scan linear.
    """
    start = max(text.rfind(macro) for macro in _BOXED)
    if start < 0:
        return -1, None
    macro = next(m for m in _BOXED if text.startswith(m, start))
    return start, _braced_after(text, start + len(macro))


def _braced_after(text: str, i: int) -> str | None:
    """Content of the `{...}` group starting at text[i] (after optional spaces); None if absent or unbalanced.

    A macro followed by a space and a bare token (`\\boxed 5`) yields that token.
    """
    n = len(text)
    j = i
    while j < n and text[j] == " ":
        j += 1
    if j >= n:
        return None
    if text[j] != "{":
        if j == i:
            return None
        k = j
        while k < n and not text[k].isspace() and text[k] not in "$}":
            k += 1
        return text[j:k] or None
    depth = 0
    for k in range(j, n):
        c = text[k]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced, possibly nested braces.

    Example:
      >>> extract_boxed(r"so \\boxed{\\frac{1}{2}} and")
      '\\\\frac{1}{2}'
    """
    return _last_boxed(text)[1]


def extract_hash_answer(text: str) -> str | None:
    """The rest of the line after the last `####` (GSM8K convention), stripped; None if absent or empty.

    Example:
      >>> extract_hash_answer("48 + 24 = 72\\n#### 72")
      '72'
    """
    i = text.rfind(_HASH)
    if i < 0:
        return None
    line = text[i + len(_HASH):].split("\n", 1)[0].strip()
    return line or None


def extract_answer(text: str) -> str | None:
    """The final answer: whichever of the last `\\boxed{}` and the last `####` comes later in the text.

    Returns None when the text has neither marker (or only unbalanced ones).

    Example:
      >>> extract_answer(r"#### 3 ... actually \\boxed{4}")
      '4'
    """
    box_at, boxed = _last_boxed(text)
    hash_at = text.rfind(_HASH)
    if hash_at > box_at:
        hashed = extract_hash_answer(text)
        if hashed is not None:
            return hashed
    return boxed


def _strip_noise(s: str) -> str:
    s = s.strip().replace("−", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)  # \sqrt3 is \sqrt{3} (TeX takes one token)
    s = _TEXT_MACRO.sub(r" \1", s)
    for token in _NOISE:
        s = s.replace(token, "")
    s = s.strip()
    m = _LHS.match(s)
    if m:
        s = s[m.end():]
    return s.strip().rstrip(".").strip()


def _in(word: str, words: frozenset[str]) -> bool:
    """word (lower case) or its singular (plural "s") is in `words`."""
    return word in words or (len(word) > 2 and word.endswith("s") and word[:-1] in words)


def _is_unit(word: str, spaced: bool, after_per: bool) -> bool:
    """A unit from UNIT_WORDS, or (after a space) the name of what is counted and not a word of VALUE_WORDS: a
    plural noun ("apples", "pencils": four or more letters ending in "s" with a vowel before it, or an irregular
    plural such as "children"), or after "per" any word of three or more letters with a vowel ("per basket").
    Plural only, so that junk after a number ("19 qwe") does not pass for what it counts."""
    if _in(word, UNIT_WORDS):
        return True
    if not spaced or _in(word, VALUE_WORDS) or _VOWELS.isdisjoint(word[:-1]):
        return False
    if after_per:
        return len(word) >= 3
    return (len(word) >= 4 and word.endswith("s")) or word in IRREGULAR_PLURALS


def _units(rest: str) -> int | None:
    """The product of the magnitude words that start `rest`, if the rest is a unit phrase (unit words or counted
    things, with "per" or "/" between units: "dollars per day", "km/h", "m^2", "apples"); None for anything else
    (variables, hedges, words that change the value)."""
    rest, words, spaced, i = rest.rstrip(), [], [], 0
    while i < len(rest):
        m = _WORD.match(rest, i)
        if m is None:
            return None
        words.append(m.group(1).lower())
        spaced.append(m.start(1) > i or words[-2:-1] == ["/"])
        i = m.end()
    scale = 1
    while words and words[0] in MAGNITUDE_WORDS:
        scale *= MAGNITUDE_WORDS[words.pop(0)]
        spaced.pop(0)
    after_unit = False  # "per" and "/" need a unit on both sides
    for k, word in enumerate(words):
        if word in ("per", "/"):
            if not after_unit or k + 1 == len(words):
                return None
            after_unit = False
        elif _is_unit(word, spaced[k], k > 0 and words[k - 1] in ("per", "/")):
            after_unit = True
        else:
            return None
    return scale


def _plain_number(s: str) -> Fraction | None:
    """A decimal or thousands-separated integer, optionally followed by magnitude words (applied) and a unit
    phrase ("18 dollars per day", "2 million dollars")."""
    m = _NUMBER.match(s)
    if m is None:
        return None
    scale = _units(s[m.end():])
    if scale is None:
        return None
    return Fraction(m.group(0).replace(",", "")) * scale


def parse_number(text: str) -> Fraction | None:
    """The exact value of a numeric answer, or None if the text is not a number.

    Accepts: integers and decimals with an optional sign (ASCII or Unicode minus), thousands commas (groups of
    exactly three digits, so "1,2" is not a number), `a/b`, `\\frac{a}{b}` (also \\dfrac, \\tfrac, \\frac12),
    currency and percent signs, degrees, a leading `x =`, powers of ten (`10^{3}`, `2.5 \\times 10^{-3}`), and
    after the number magnitude words (applied: "2 million") and the names of what it counts or measures, plain or
    in `\\text{}` ("18 dollars per day", "5 km/h", "5 apples"). Anything else after the number makes it not a
    number: "2x", "5i", "5 or six", "5 squared"; so does E-notation ("1e3").

    Example:
      >>> parse_number("$1,234.50 dollars")
      Fraction(2469, 2)
      >>> parse_number("5 apples"), parse_number("1e3")
      (Fraction(5, 1), None)
      >>> parse_number(r"2.5 \\times 10^{-3}")
      Fraction(1, 400)
      >>> parse_number(r"-\\frac{3}{4}") == parse_number("-0.75")
      True
    """
    if len(text) > MAX_NUMBER_CHARS:
        return None
    s = _strip_noise(text)
    m = _POWER_OF_TEN.fullmatch(s)
    if m:
        return Fraction(m.group(1) or 1) * Fraction(10) ** int(m.group(2) or m.group(3))
    for pattern in (_FRAC, _FRAC_SHORT):
        m = pattern.fullmatch(s)
        if m:
            num, den = _plain_number(m.group(2).strip()), _plain_number(m.group(3).strip())
            if num is None or den is None or den == 0:
                return None
            return -num / den if m.group(1) == "-" else num / den
    left, slash, right = s.partition("/")
    if slash and _NUMBER.fullmatch(left.strip()):  # a/b; otherwise "/" can only be a unit's ("5 km/h")
        num, den = _plain_number(left.strip()), _plain_number(right.strip())
        if num is None or den is None or den == 0:
            return None
        return num / den
    return _plain_number(s)


def normalize_answer(text: str) -> str:
    """Canonical form of an answer: the reduced fraction for numbers ("3/4", "-2"), else de-noised text.

    Text normalisation drops spaces and LaTeX spacing/sizing macros, `$`, `\\text{}` wrappers and a trailing
    period, and unifies `\\dfrac`/`\\tfrac` to `\\frac`.

    Example:
      >>> normalize_answer("0.750"), normalize_answer(r"\\left( 1, 2 \\right)")
      ('3/4', '(1,2)')
    """
    value = parse_number(text)
    if value is not None:
        return str(value)
    return "".join(_strip_noise(text[:MAX_ANSWER_CHARS]).split())


def answers_match(predicted: str | None, reference: str) -> bool:
    """True iff `predicted` equals `reference` as numbers (exactly) or, when either is not numeric, as
    normalised text. A missing prediction (None or blank) never matches.

    Example:
      >>> answers_match("1,000", "1000.0"), answers_match("\\\\frac{1}{2}", "0.5"), answers_match(None, "1")
      (True, True, False)
    """
    if predicted is None or not predicted.strip():
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return normalize_answer(predicted) == normalize_answer(reference)


_OPS = {"+": "+", "-": "-", "*": "*", "/": "/", "×": "*", "÷": "/", "x": "*", "(": "(", ")": ")"}


def _tokenize(expr: str) -> list[str | int] | None:
    tokens: list[str | int] = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c.isspace():
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < n and "0" <= expr[j] <= "9":
                j += 1
            if j - i > 9:
                return None
            tokens.append(int(expr[i:j]))
            i = j
        elif c in _OPS:
            tokens.append(_OPS[c])
            i += 1
        else:
            return None
        if len(tokens) > MAX_EXPRESSION_TOKENS:
            return None
    return tokens


class _ExpressionParser:
    """Recursive descent over expr := term (('+'|'-') term)*; term := atom (('*'|'/') atom)*;
    atom := integer | '(' expr ')'. No unary operators: every number must appear exactly as given."""

    def __init__(self, tokens: list[str | int]):
        self.tokens, self.i, self.literals = tokens, 0, []

    def _peek(self) -> str | int | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.i]
            self.i += 1
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.atom(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.i]
            self.i += 1
            rhs = self.atom(depth)
            if op == "/" and rhs == 0:
                raise ValueError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def atom(self, depth: int) -> Fraction:
        tok = self._peek()
        self.i += 1
        if isinstance(tok, int):
            self.literals.append(tok)
            return Fraction(tok)
        if tok == "(" and depth < MAX_EXPRESSION_DEPTH:
            value = self.expr(depth + 1)
            if self._peek() != ")":
                raise ValueError("unbalanced parenthesis")
            self.i += 1
            return value
        raise ValueError(f"unexpected token {tok!r}")


def parse_expression(text: str) -> tuple[Fraction, tuple[int, ...]] | None:
    """Value and integer literals of an arithmetic expression over + - * / × ÷ and parentheses.

    A trailing `= <anything>` is ignored (the claimed result is not trusted). Returns None for anything
    else: unknown characters, unary signs, division by zero, over-long numbers or expressions, or nesting deeper
    than MAX_EXPRESSION_DEPTH. Arithmetic is exact (fractions).

    Example:
      >>> parse_expression("(6 - 2) * 25 / 4 = 25")
      (Fraction(25, 1), (6, 2, 25, 4))
    """
    if len(text) > 4 * MAX_EXPRESSION_TOKENS:
        return None
    expr = text.split("=", 1)[0]
    tokens = _tokenize(expr)
    if not tokens:
        return None
    parser = _ExpressionParser(tokens)
    try:
        value = parser.expr(0)
    except ValueError:
        return None
    if parser.i != len(tokens):
        return None
    return value, tuple(parser.literals)
