"""logra_jax.optim knows no model: its modules import neither logra_jax.models (nor anything above it) nor flax.

The sketch-native hooks and the predicted-KL probe, where a model meets the optimizer, live in logra_jax.native.
"""

import ast
import subprocess
import sys
from pathlib import Path

OPTIM = Path(__file__).resolve().parents[2] / "logra_jax" / "optim"
ALLOWED_PROJECT = ("logra_jax.optim", "logra_jax.kernels", "logra_jax.core.tree_paths",
                   "logra_jax.parallel.derived_specs", "logra_jax.core.giles")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_optim_modules_import_only_kernels_bottom_modules_optax_and_jax():
    offenders = {}
    for path in sorted(OPTIM.glob("*.py")):
        bad = {name for name in _imports(path)
               if name.split(".")[0] == "flax"
               or (name.startswith("logra_jax") and not name.startswith(ALLOWED_PROJECT))}
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, offenders


def test_importing_optim_loads_no_model_code():
    code = ("import sys, logra_jax.optim; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flax' or m.startswith("
            "('logra_jax.models', 'logra_jax.native', 'logra_jax.rl', 'logra_jax.job.train'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_bottom_modules_import_only_jax():
    """The modules optim may import from below kernels import nothing of the project and no flax."""
    root = OPTIM.parent
    offenders = {}
    for name in ("core/tree_paths.py", "parallel/derived_specs.py", "core/giles.py"):
        bad = {m for m in _imports(root / name) if m.split(".")[0] in ("flax", "logra_jax", "optax")}
        if bad:
            offenders[name] = sorted(bad)
    assert not offenders, offenders
