"""Our docstrings are plain text written to be read in a terminal: prose, equations indented under the line that
introduces them, `code` in single backticks, shapes such as (*batch, d, r). This extension turns each one into
reStructuredText that says the same before napoleon reads its Google sections (Args, Returns, Raises, Example):
an indented block under a prose line becomes a literal block (the equations keep their alignment), backticks
become inline code, and the characters reStructuredText would read as markup (* | \\ and a trailing _) are
escaped. Examples are left alone, so they stay doctest blocks.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tests import this module without Sphinx
    from sphinx.application import Sphinx

_SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Example|Examples|Attributes|Note|Notes|Warning|"
                      r"References|See Also):\s*$")
_EXAMPLE = re.compile(r"^(Example|Examples):\s*$")
_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_BULLET = re.compile(r"^(?:[-*+]|\d+[.)]|\w[.)])\s")


def _escape(text: str) -> str:
    """Prose → reStructuredText: `x` → ``x``, markup characters escaped outside the inline code."""
    parts = _CODE.split(text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            # inline code must touch neither a word character before nor after: "\ " joins without a space
            before = "\\ " if parts[i - 1][-1:].isalnum() else ""
            after = "\\ " if parts[i + 1][:1].isalnum() else ""
            out.append(f"{before}``{part.strip()}``{after}")
            continue
        part = part.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|").replace("`", "\\`")
        part = re.sub(r"(?<=\w)_(?=\W|$)", r"\\_", part)
        out.append(part)
    return "".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _literal(lines: list[str], i: int, out: list[str]) -> int:
    """Append the indented block starting at lines[i] as a literal block; return the index after it."""
    block = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > 0):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
    if out and out[-1].strip():
        out[-1] = out[-1] + " ::"
    else:
        out.append("::")
    out.append("")
    out.extend("    " + b if b.strip() else "" for b in block)
    out.append("")
    return i


def convert_prose(lines: list[str]) -> list[str]:
    """Prose lines (dedented) → RST: an indented block under a prose line becomes a literal block; a list item's
    continuation lines (indented up to the item's text) stay part of the item."""
    out: list[str] = []
    item_indent = None  # text column of the list item being continued, if any
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            out.append("")
            i += 1
            continue
        indent = _indent(line)
        if indent > 0:
            if item_indent is not None and indent <= item_indent:
                out.append(" " * item_indent + _escape(line.strip()))
                i += 1
                continue
            i = _literal(lines, i, out)
            continue
        bullet = _BULLET.match(line)
        if out and out[-1].strip() and (bullet is not None) != (item_indent is not None):
            out.append("")  # a list starts or ends: reStructuredText wants a blank line there
        item_indent = bullet.end() if bullet else None
        out.append(_escape(line))
        i += 1
    return out


def convert(lines: list[str]) -> list[str]:
    """A whole docstring: prose converted, Google sections escaped (examples untouched) for napoleon."""
    out: list[str] = []
    prose: list[str] = []
    mode = "prose"
    for line in lines:
        header = _SECTION.match(line)
        if header and _indent(line) == 0:
            if prose:
                out.extend(convert_prose(prose))
                prose = []
            if out and out[-1].strip():
                out.append("")
            out.append(line)
            mode = "example" if _EXAMPLE.match(line) else "section"
            continue
        if mode == "prose":
            prose.append(line)
        elif line.strip() and _indent(line) == 0:  # a section ends where the text comes back to the margin
            mode = "prose"
            out.append("")
            prose.append(line)
        elif mode == "example":
            out.append(line)
        else:
            out.append(_escape(line))
    out.extend(convert_prose(prose))
    return out


def _process(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    lines[:] = convert(list(lines))


def setup(app: Sphinx) -> dict[str, bool]:
    app.connect("autodoc-process-docstring", _process, priority=100)  # before napoleon (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
