"""The wheel `pip wheel .` builds holds the whole package and its data, declares pyproject's dependencies and
carries logra_jax.__version__; configs/, tests/ and experiments/ stay in the repository.

Built with --no-deps --no-build-isolation (this venv's setuptools, no index) from a copy of the three inputs the
build reads, so that the checkout gets no build/ folder.
"""

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import logra_jax

REPO = Path(__file__).resolve().parents[2]
DIST_INFO = f"logra_jax-{logra_jax.__version__}.dist-info"  # a wheel of another version has none


# every test of the module on one xdist worker, the wheel built once (make test's --dist loadgroup; a
# module-scoped fixture is rebuilt when xdist interleaves another module's tests)
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    shutil.copytree(REPO / "logra_jax", src / "logra_jax", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(src)], check=True, capture_output=True,
                   timeout=120)
    (path,) = out.glob("logra_jax-*.whl")
    with zipfile.ZipFile(path) as whl:
        yield whl


def test_wheel_holds_every_module_and_the_typing_marker_and_nothing_else(wheel):
    package = {p.relative_to(REPO).as_posix() for p in (REPO / "logra_jax").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert "logra_jax/py.typed" in package
    names = set(wheel.namelist())
    assert {n for n in names if not n.startswith(DIST_INFO + "/")} == package


def test_wheel_metadata_carries_the_version_and_pyprojects_dependencies(wheel, project):
    meta = Parser().parsestr(wheel.read(f"{DIST_INFO}/METADATA").decode())
    assert meta["Version"] == logra_jax.__version__
    assert set(meta.get_all("Provides-Extra")) == set(project["optional-dependencies"])
    got = set()
    for line in meta.get_all("Requires-Dist"):
        req = Requirement(line)
        extra = re.fullmatch(r'extra == "([\w-]+)"', str(req.marker)) if req.marker else None
        req.marker = None
        got.add((extra.group(1) if extra else "core", str(req)))
    expected = {("core", str(Requirement(r))) for r in project["dependencies"]}
    expected |= {(group, str(Requirement(r))) for group, reqs in project["optional-dependencies"].items()
                 for r in reqs}
    assert got == expected
