"""Our docstrings are plain text written to be read in a terminal: prose, equations indented under the line that
introduces them, `code` in single backticks, shapes such as (*batch, d, r). This extension turns each one into
reStructuredText that says the same before napoleon reads its Google sections (Args, Returns, Raises, Example):
an indented block under a prose line becomes a literal block (the equations keep their alignment), backticks
become inline code, and the characters reStructuredText would read as markup (* | \\ and a trailing _) are
escaped. Examples are left alone, so they stay doctest blocks.
"""

from __future__ import annotations

import re

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


def convert_prose(lines: list[str]) -> list[str]:
    """Prose lines (dedented) → RST: indented blocks under a prose line become literal blocks."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() and _indent(line) > 0 and (not out or out[-1].strip()):
            prev = out[-1] if out else ""
            continuation = _BULLET.match(prev.lstrip()) and _indent(line) <= _indent(prev) + 3
            if not continuation:
                block = []
                while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > 0):
                    block.append(lines[i])
                    i += 1
                while block and not block[-1].strip():
                    block.pop()
                if out:
                    out[-1] = out[-1] + " ::"
                else:
                    out.append("::")
                out.append("")
                out.extend("    " + b if b.strip() else "" for b in block)
                out.append("")
                continue
        if line.strip() and _indent(line) > 0 and out and not out[-1].strip():
            # an indented block after a blank line: a quotation in RST; keep it verbatim as a literal block
            block = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > 0):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out.append("::")
            out.append("")
            out.extend("    " + b if b.strip() else "" for b in block)
            out.append("")
            continue
        if line.strip():
            bullet = bool(_BULLET.match(line))
            prev = out[-1] if out else ""
            in_list = bool(prev.strip()) and (bool(_BULLET.match(prev)) or _indent(prev) > 0)
            if prev.strip() and bullet != in_list:
                out.append("")  # a list starts or ends: reStructuredText wants a blank line there
        out.append(_escape(line) if line.strip() else "")
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


def _process(app, what, name, obj, options, lines):
    lines[:] = convert(list(lines))


def setup(app):
    app.connect("autodoc-process-docstring", _process, priority=100)  # before napoleon (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
