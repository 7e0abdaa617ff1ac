"""List the functions of a package longer than a screen that give no reason for it.

  python tools/long_functions.py [PATH ...]   (default: logra_jax/)

A function's length is its lines of code: docstrings, comments and blank lines aside; a nested function's lines
count within the outermost function that holds it. One over LIMIT lines is listed as `path:line name N lines`
unless a comment line `# long: <why>` sits directly above its `def` (or above its decorators). Exit status 1
when any is listed, 0 otherwise.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

LIMIT = 60
REASON = "# long:"
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER, tokenize.ENCODING}
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _code_lines(source: str) -> set[int]:
    """The line numbers that hold a token of code (a multi-line string covers every line it spans)."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def _docstring_lines(tree: ast.AST) -> set[int]:
    """The lines of every docstring: a string statement first in a module, class or function body."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, *_FUNCTIONS)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _outermost_functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef]]:
    """(qualified name, node) of each function not nested in another function (methods included)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _FUNCTIONS):
            yield prefix + child.name, child
        elif isinstance(child, ast.ClassDef):
            yield from _outermost_functions(child, f"{prefix}{child.name}.")
        else:
            yield from _outermost_functions(child, prefix)


def _has_reason(function: ast.FunctionDef, source_lines: list[str]) -> bool:
    first = min([function.lineno, *(d.lineno for d in function.decorator_list)])
    above = source_lines[first - 2].strip() if first >= 2 else ""
    return above.startswith(REASON) and bool(above[len(REASON):].strip())


def long_functions(path: Path, limit: int = LIMIT) -> list[tuple[int, str, int]]:
    """(line, qualified name, lines of code) of each function in the file at `path` over `limit` lines of code
    without a `# long: <why>` comment directly above it."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    code = _code_lines(source) - _docstring_lines(tree)
    source_lines = source.splitlines()
    found = []
    for name, function in _outermost_functions(tree):
        length = sum(1 for line in range(function.lineno, function.end_lineno + 1) if line in code)
        if length > limit and not _has_reason(function, source_lines):
            found.append((function.lineno, name, length))
    return found


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path(__file__).resolve().parents[1] / "logra_jax"]
    files = sorted(p for root in roots for p in ([root] if root.is_file() else root.rglob("*.py")))
    listed = 0
    for path in files:
        for line, name, length in long_functions(path):
            print(f"{os.path.relpath(path)}:{line} {name} {length} lines")
            listed += 1
    return 1 if listed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
