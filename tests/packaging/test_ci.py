"""CI's guards against a skip hiding a failure: LOGRA_TEST_REQUIRE (tests/conftest.py) fails a skip for want of a
required venv, and .ci/summary.py fails when a test the core step skipped for want of a venv passed nowhere later."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _summary():
    spec = importlib.util.spec_from_file_location("ci_summary", ROOT / ".ci" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


def _pytest(folder: Path, require: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOGRA_TEST_REQUIRE": require}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           str(folder)], cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def skipping_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test and a module that skip for want of `make venv-foo`, under this suite's own skip hooks."""
    folder = tmp_path_factory.mktemp("skips")
    (folder / "conftest.py").write_text(textwrap.dedent(f"""
        import runpy
        _hooks = runpy.run_path({str(ROOT / "tests" / "conftest.py")!r})
        pytest_runtest_makereport = _hooks["pytest_runtest_makereport"]
        pytest_make_collect_report = _hooks["pytest_make_collect_report"]
    """))
    (folder / "test_one.py").write_text(textwrap.dedent("""
        import pytest

        def test_needs_foo():
            pytest.skip("its compiler is not installed here (make venv-foo; run under .venv-foo)")

        def test_runs():
            pass
    """))
    (folder / "test_module.py").write_text(textwrap.dedent("""
        import pytest
        pytest.skip("foo is not installed: run `make venv-foo`", allow_module_level=True)
    """))
    return folder


def test_a_skip_for_a_required_venv_fails(skipping_tests: Path):
    run = _pytest(skipping_tests, "venv-foo")
    assert run.returncode != 0, run.stdout
    assert "skipped for want of venv-foo" in run.stdout, run.stdout
    assert "test_module.py" in run.stdout and "error" in run.stdout, run.stdout


def test_a_skip_for_another_venv_stays_a_skip(skipping_tests: Path):
    run = _pytest(skipping_tests, "venv-bar")
    assert run.returncode == 0, run.stdout
    assert "1 passed, 2 skipped" in run.stdout, run.stdout


def _junit(folder: Path, name: str, cases: str) -> None:
    (folder / f"{name}.xml").write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')


SKIPPED_FOR_TPU = ('<testcase classname="tests.plan.test_x" name="test_a"><skipped message="v5e:2x4: its compiler '
                   'is not installed here (make venv-tpu; run under .venv-tpu)"/></testcase>')
SKIPPED_MODULE = ('<testcase classname="" name="tests.vllm.test_v"><skipped message="collection skipped">'
                  "('tests/vllm/test_v.py', 25, 'Skipped: vLLM is not installed: run `make venv-vllm`')"
                  "</skipped></testcase>")
PASSED_A = '<testcase classname="tests.plan.test_x" name="test_a"/>'
PASSED_V = '<testcase classname="tests.vllm.test_v" name="test_engine"/>'
NOTEBOOK = '<testcase classname="tests.colab.test_notebooks" name="test_notebook_runs[quickstart.ipynb]"/>'


def test_summary_passes_when_every_venv_skip_ran_later(tmp_path: Path, capsys: pytest.CaptureFixture):
    _junit(tmp_path, "core", SKIPPED_FOR_TPU + SKIPPED_MODULE + NOTEBOOK)
    _junit(tmp_path, "aot-tpu", PASSED_A)
    _junit(tmp_path, "vllm", PASSED_V)
    assert _summary().main([str(tmp_path), "core", "aot-tpu", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "core: 1 passed, 0 failed, 2 skipped" in out and "notebooks: 1 passed, 0 failed, 0 skipped" in out
    assert out.rstrip().endswith("total: 3 passed, 0 failed, 2 skipped")


def test_summary_fails_on_a_venv_skip_that_ran_nowhere(tmp_path: Path, capsys: pytest.CaptureFixture):
    _junit(tmp_path, "core", SKIPPED_FOR_TPU + SKIPPED_MODULE)
    _junit(tmp_path, "aot-tpu", SKIPPED_FOR_TPU)  # a broken venv: the test skipped there too
    _junit(tmp_path, "vllm", PASSED_V)
    assert _summary().main([str(tmp_path), "core", "aot-tpu", "vllm"]) == 1
    assert "not run anywhere: tests.plan.test_x::test_a (skipped for want of venv-tpu)" in capsys.readouterr().out


def test_summary_fails_on_a_failure_or_a_missing_report(tmp_path: Path, capsys: pytest.CaptureFixture):
    _junit(tmp_path, "core", '<testcase classname="tests.a" name="test_b"><failure message="no"/></testcase>')
    assert _summary().main([str(tmp_path), "core"]) == 1
    _junit(tmp_path, "core", PASSED_A)
    assert _summary().main([str(tmp_path), "core", "vllm"]) == 1
    assert "vllm: no report" in capsys.readouterr().out
