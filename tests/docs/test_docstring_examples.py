"""The runnable examples in the docstrings of every logra_jax module run and print what they claim.

Every module whose source holds a `>>>` example is collected, none listed by hand; the modules that
tests/optim/test_optim_docs.py and tests/ckpt/test_ckpt_fingerprint.py already run are read from those files
and left to them. An example that needs files or an accelerator says so with `# doctest: +SKIP` in its own
docstring, where a reader sees it.
"""

import ast
import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "logra_jax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tested_elsewhere() -> set[str]:
    """Modules whose examples other tests run: test_optim_docs.py's MODULES list, and the fingerprint module."""
    tree = ast.parse((ROOT / "tests" / "optim" / "test_optim_docs.py").read_text(encoding="utf-8"))
    names = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "MODULES" for t in node.targets))
    fingerprint_test = (ROOT / "tests" / "ckpt" / "test_ckpt_fingerprint.py").read_text(encoding="utf-8")
    assert "doctest.testmod(fingerprint_module" in fingerprint_test
    return {f"logra_jax.optim.{name}" for name in names} | {"logra_jax.core.fingerprint"}


WITH_EXAMPLES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py") if ">>>" in p.read_text(encoding="utf-8"))
MODULES = [name for name in WITH_EXAMPLES if name not in _tested_elsewhere()]


def test_the_modules_tested_elsewhere_have_examples():
    """A module named in the other doctest tests but without examples would be covered by nobody."""
    assert _tested_elsewhere() <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder().find(module, name)
    examples = [e for t in tests for e in t.examples]
    assert examples, f"{name} has '>>>' in its source but doctest found no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    skipped = sum(bool(e.options.get(doctest.SKIP)) for e in examples)
    assert result.attempted + skipped == len(examples)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
