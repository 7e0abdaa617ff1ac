"""docs/_ext/docstring_blocks.py: plain-text docstrings become reStructuredText that says the same."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "docs" / "_ext" / "docstring_blocks.py"
_spec = importlib.util.spec_from_file_location("docstring_blocks", _PATH)
blocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(blocks)

DOC = """Scale by α (see `scale_by_x`), shapes (*batch, d):
  v ← β₂ v + (1 − β₂) s²
  ρ = sqrt(v)
then the rest; a name_ and a | bar.
- item one `a`
  continued
- item two
After the list.

Args:
  x: the (*batch, r) input.

Example:
  >>> 1 + 1  # *not* escaped
  2
"""


def test_equations_become_literal_blocks_and_prose_is_escaped():
    out = blocks.convert(DOC.splitlines())
    text = "\n".join(out)
    assert out[0] == r"Scale by α (see ``scale_by_x``), shapes (\*batch, d): ::"
    assert "      v ← β₂ v + (1 − β₂) s²" in out and "      ρ = sqrt(v)" in out  # indentation kept
    assert r"a name\_ and a \| bar." in text
    assert "- item one ``a``\n  continued\n- item two\n\nAfter the list." in text
    assert "  x: the (\\*batch, r) input." in out
    assert "  >>> 1 + 1  # *not* escaped" in out and "  2" in out


def test_inline_code_touching_a_word_is_joined_with_an_escaped_space():
    assert blocks.convert(["`Linear.kernel`s"]) == [r"``Linear.kernel``\ s"]
