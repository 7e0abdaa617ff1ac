"""The Colab notebooks run top to bottom in a Jupyter kernel with their smallest settings (LOGRA_NOTEBOOK_SMOKE=1).

Each notebook is executed by nbclient in a fresh kernel of this interpreter; a failing cell fails its test with
the cell's source and traceback. The notebooks are committed without outputs.
"""

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

COLAB = Path(__file__).resolve().parents[2] / "colab"
# Seconds a single cell may run before its notebook fails: a guard against hangs, several times the smoke runs.
CELL_TIMEOUT_S = {"quickstart.ipynb": 300, "rl_demo.ipynb": 600, "memory_analysis.ipynb": 300,
                  "rl_tpu.ipynb": 600}
SMOKE_SWITCH = "LOGRA_NOTEBOOK_SMOKE"
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernelspec "python3" that runs this interpreter (whatever kernelspecs the machine has)."""
    prefix = tmp_path_factory.mktemp("jupyter")
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", "python3"],
                   check=True, capture_output=True)
    return prefix / "share" / "jupyter"


def test_every_notebook_is_executed_here():
    assert sorted(p.name for p in COLAB.glob("*.ipynb")) == sorted(CELL_TIMEOUT_S)


@pytest.mark.parametrize("name", sorted(CELL_TIMEOUT_S))
def test_notebook_is_committed_clean(name: str):
    """No outputs or execution counts (small diffs, nothing stale), a python3 kernel, and the smoke switch."""
    nb = nbformat.read(COLAB / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    dirty = [i for i, cell in enumerate(code) if cell.outputs or cell.execution_count is not None]
    assert not dirty, f"{name}: code cells {dirty} hold outputs; clear them before committing"
    assert any(SMOKE_SWITCH in cell.source for cell in code)


@pytest.mark.parametrize("name", sorted(CELL_TIMEOUT_S))
@pytest.mark.slow
def test_notebook_runs(name: str, jupyter_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The kernel inherits this environment: the fake CPU devices and the cheaper XLA:CPU code generation of
    # conftest.py (the compiled programs run a few steps; compile time dominates).
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    monkeypatch.setenv(SMOKE_SWITCH, "1")
    monkeypatch.setenv("LOGRA_DEMO_WORKDIR", str(tmp_path / "demo"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws the figures
    nb = nbformat.read(COLAB / name, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S[name], kernel_name="python3",
                            resources={"metadata": {"path": str(COLAB)}})
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{name} failed:\n{ANSI_COLOUR.sub('', str(err))}", pytrace=False)
    figures = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert figures, f"{name} drew no figure"
