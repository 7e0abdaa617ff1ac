"""Every measured figure experiments/REPORT.md, README.md and the docs pages quote agrees with its results file.

The figures are registered in `experiments/figures.py` (its docstring says how to add one): each is a passage of a
document with its numbers as format fields, filled from a committed results file. A rerun that changes a number
fails here, naming the passage and the file, until the text says the new number. Every number in the sections of
`figures.CHECKED` (all of REPORT.md, its "In brief" list included) must belong to a registered passage or be a setting
(`figures.SETTINGS`: seeds, steps, ranks, meshes, dates), so a figure added there without a source fails too.

To register a figure, add `q(REPORT, "the passage with its {:.2f} fields", value, ...)` to the function of
experiments/figures.py that reads its results file; a failure here names the passage, its file and what the
document says instead. The test suite's timings (docs/testing.md) have no results file and are not checked.
"""

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # as `python -m experiments...` has it
from experiments import figures  # noqa: E402

# A number, not part of a name ("Qwen2.5-Math-1.5B", "MATH-500", "H100", "7B@4").
NUMBER = re.compile(r"(?<![\w.@])(?<!\w-)\d+(?:[.,]\d+)*(?:e-?\d+)?(?!\w|\.\d)")


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _document(doc: str) -> str:
    return _normalised((ROOT / doc).read_text(encoding="utf-8"))


def _section(text: str, heading: str | None) -> tuple[int, int]:
    """The span of `heading`'s section of normalised `text` (all of it for None)."""
    if heading is None:
        return 0, len(text)
    start = text.index(heading + " ")
    end = text.find(" ## ", start + len(heading))
    return start, len(text) if end < 0 else end


def missing_quotes(text: str, quotes: list[figures.Quote]) -> list[str]:
    """The quotes whose rendered text normalised `text` does not hold, each with the passage that stands there."""
    out = []
    for quote in quotes:
        rendered = quote.render()
        if rendered in text:
            continue
        anchor = max((piece for piece, is_figure in quote.pieces() if not is_figure), key=len, default="")
        where = text.find(anchor) if len(anchor) >= 8 else -1
        start = max(where - rendered.index(anchor), 0)
        found = text[start:start + len(rendered) + 20] if where >= 0 else "(no passage like it)"
        out.append(f"{quote.doc}: {rendered!r}\n    from {quote.source}; the document has: …{found}…")
    return out


def unregistered_numbers(text: str, span: tuple[int, int], quotes: list[figures.Quote]) -> list[str]:
    """Numbers in `text[span]` that are neither a field of a quote found in `text` nor part of a setting."""
    covered = [False] * len(text)
    for quote in quotes:
        pieces = list(quote.pieces())
        rendered = "".join(piece for piece, _ in pieces)
        for match in re.finditer(re.escape(rendered), text):
            at = match.start()
            for piece, is_figure in pieces:
                if is_figure:
                    covered[at:at + len(piece)] = [True] * len(piece)
                at += len(piece)
    for pattern in figures.SETTINGS:
        for match in re.finditer(pattern, text):
            covered[match.start():match.end()] = [True] * (match.end() - match.start())
    start, end = span
    return [f"{m.group(0)!r} in …{text[max(m.start() - 50, 0):m.end() + 30]}…"
            for m in NUMBER.finditer(text, start, end) if not all(covered[m.start():m.end()])]


@pytest.fixture(scope="module")
def by_doc() -> dict[str, list[figures.Quote]]:
    out = defaultdict(list)
    for quote in figures.quotes():
        out[quote.doc].append(quote)
    return out


def test_every_quoted_figure_matches_its_results_file(by_doc):
    missing = [line for doc, quotes in by_doc.items() for line in missing_quotes(_document(doc), quotes)]
    assert not missing, ("figures that disagree with their results files (fix the text, or the registration in "
                         "experiments/figures.py if the passage was reworded):\n" + "\n".join(missing))


@pytest.mark.parametrize("doc", sorted(figures.CHECKED))
def test_every_number_in_the_checked_sections_is_registered(doc, by_doc):
    text = _document(doc)
    found = unregistered_numbers(text, _section(text, figures.CHECKED[doc]), by_doc[doc])
    assert not found, (f"{doc}: numbers with no results file behind them (register them in experiments/figures.py, "
                       "or add a pattern to its SETTINGS if they are settings, not measurements):\n" + "\n".join(found))


def test_a_changed_digit_fails_naming_the_figure(by_doc):
    """The check itself: one digit changed in a registered figure is a missing quote and an unregistered number."""
    text = _document("experiments/REPORT.md")
    quote = by_doc["experiments/REPORT.md"][0]
    figure = next(piece for piece, is_figure in quote.pieces() if is_figure)
    changed = figure[:-1] + str((int(figure[-1]) + 1) % 10)
    edited = text.replace(quote.render(), quote.render().replace(figure, changed, 1))
    assert [quote.render() in line for line in missing_quotes(edited, [quote])] == [True]
    assert any(repr(changed) in line for line in unregistered_numbers(edited, (0, len(edited)), [quote]))
