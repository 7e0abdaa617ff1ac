"""No function of the package runs past a screen (tools/long_functions.py: 60 lines of code) without a written
reason (`# long: <why>` directly above it)."""

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("long_functions", ROOT / "tools" / "long_functions.py")
long_functions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(long_functions)


def test_no_function_of_the_package_is_long_without_a_reason(capsys):
    status = long_functions.main([str(ROOT / "logra_jax")])
    assert status == 0, capsys.readouterr().out


def _function(name: str, statements: int, nested: bool = False) -> str:
    body = "".join(f"    x{i} = {i}  # a comment\n\n" for i in range(statements))
    if nested:  # a nested function's lines count within its parent
        body = "    def inner():\n" + textwrap.indent(body, "    ") + "    return inner\n"
    return f'def {name}():\n    """A docstring\n    of three lines\n    does not count."""\n{body}'


def test_lists_a_long_function_without_a_reason_and_not_one_with_a_reason(tmp_path, capsys):
    path = tmp_path / "sample.py"
    path.write_text("\n\n".join([
        _function("short", 59),  # the def line + 59 statements: 60 lines of code
        _function("long_without", 60),
        "# long: one table of cases, read top to bottom\n" + _function("long_with", 60),
        "# long: the decorator is part of the function\n@staticmethod\n" + _function("decorated_with", 80),
        "class Holder:\n" + textwrap.indent(_function("method", 70), "    "),
        _function("nested", 60, nested=True),
    ]))
    found = long_functions.long_functions(path)
    assert {name: n for _, name, n in found} == {"long_without": 61, "Holder.method": 71, "nested": 63}
    assert found[0][0] == path.read_text().splitlines().index("def long_without():") + 1
    assert long_functions.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path.name}:" in out and "long_without 61 lines" in out and "long_with " not in out
    (tmp_path / "sample.py").write_text(_function("short", 10))
    assert long_functions.main([str(path)]) == 0
