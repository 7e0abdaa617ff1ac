"""The package's floors, bottom to top: a module imports only from its own floor's package and the floors below.

README's Layout lists the same packages, one line each. Imports inside functions count too (they are still a
dependency); `logra_jax.optim`'s stricter rule (no model, no flax) is tests/optim/test_optim_layering.py.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "logra_jax"
FLOORS = (
    "core",  # tree paths, fingerprints, erfinv coefficients, optional imports: nothing of the project
    "kernels",  # Pallas kernels and their references
    "parallel",  # meshes, logical axis rules, derived specs, multihost
    "optim",  # the optax transformations
    "models",  # the NNX decoder, checkpoints in and out, tokenizers
    "native",  # where the model meets the optimizer: sketch probes, the KL probe
    "rollout",  # sampling, the decode engine, the engines, policy sync, vLLM
    "rl",  # tasks, rewards, advantages, losses, evaluation
    "job",  # the RL job: config, train step, phases, loop, checkpoints, metrics
    "planner",  # compile-only plans of the job
    "main", "plan",  # the command lines
)


def _floor(module: str) -> int:
    return FLOORS.index(module.split(".")[1])


def _project_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" if node.module == "logra_jax" else node.module
                         for alias in node.names)
    return {name for name in names if name.startswith("logra_jax.")}


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(ROOT).with_suffix("").parts): path for path in PACKAGE.rglob("*.py")
            if path.name != "__init__.py" or path.parent != PACKAGE}


def test_the_package_root_holds_only_the_floors():
    entries = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert entries == {*FLOORS, "__init__"}, sorted(entries ^ {*FLOORS, "__init__"})


def test_every_import_points_to_its_floor_or_below():
    upward = []
    for module, path in sorted(_modules().items()):
        if module == "logra_jax.__init__":
            continue
        for name in sorted(_project_imports(path)):
            if _floor(name) > _floor(module):
                upward.append(f"{module} ({FLOORS[_floor(module)]}) imports {name} ({FLOORS[_floor(name)]})")
    assert not upward, "imports that point up a floor:\n" + "\n".join(upward)


def test_readme_layout_lists_every_package_once():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `logra_jax/(\w+)(?:/|\.py)`", layout, flags=re.MULTILINE)
    assert listed == list(FLOORS), listed
