"""`pip install logra_jax` (the core alone) is enough for logra_jax.optim, logra_jax.kernels and the README's optax
example, and the RL entry points then name the extra to install.

No second venv: a subprocess runs with `python -I -S` (no site-packages) and a folder of symlinks to exactly the
installed distributions that the core requires, transitively by their own metadata (jax, jaxlib, numpy, optax and
what they pull in: scipy, ml-dtypes, opt-einsum, absl-py), plus the checkout's logra_jax. Everything else is as
absent there as in a fresh `pip install logra_jax`: find_spec returns None, importlib.metadata does not list it.
"""

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
# import under requires_extra
GUARDED = ("logra_jax.main", "logra_jax.job.train", "logra_jax.models", "logra_jax.native")
RL_PACKAGES = ("flax", "orbax", "grain", "tensorflow_datasets", "ml_collections", "tokenizers", "gguf")


def requirement_closure(requirements: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `requirements` need, following each one's Requires-Dist (markers evaluated here,
    extras only where a requirement asks for them)."""
    todo = [Requirement(line) for line in requirements]
    expanded: dict[str, set[str]] = {}
    found: dict[str, importlib.metadata.Distribution] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in expanded and set(req.extras) <= expanded[name]:
            continue
        expanded.setdefault(name, set()).update(req.extras)
        found[name] = importlib.metadata.distribution(req.name)
        for line in found[name].requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(dep)
    return found


def core_site(folder: Path, requirements: list[str], leave_out: tuple[str, ...] = ()) -> Path:
    """A folder holding symlinks to the closure of `requirements` (less `leave_out`) and the checkout's logra_jax."""
    folder.mkdir()
    for name, dist in requirement_closure(requirements).items():
        if name in leave_out:
            continue
        for top in sorted({f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}):  # packages, .libs, dist-info
            (folder / top).symlink_to(dist.locate_file(top))
    (folder / "logra_jax").symlink_to(REPO / "logra_jax")
    return folder


def run_isolated(site: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` in a Python that sees the standard library and `site` only."""
    script = f"import sys\nsys.path.insert(0, {str(site)!r})\n{code}"
    return subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=site)


def readme_optax_example() -> str:
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Use it in your own optax code\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert section, "README has no section 'Use it in your own optax code'"
    return re.findall(r"```python\n(.*?)```", section.group(1), flags=re.S)[0]


PROBE = """
import importlib, importlib.metadata, importlib.util, json
import logra_jax, logra_jax.kernels, logra_jax.optim
ns = {{}}
exec(compile({example!r}, "README.md", "exec"), ns)
updated = float((ns["params"]["mlp"]["up_proj"]["kernel"] != 1).mean())
missing = {{}}
for module in {guarded!r} + ("logra_jax.parallel.sharding",):
    try:
        importlib.import_module(module)
        missing[module] = None
    except ModuleNotFoundError as e:
        missing[module] = [e.name, str(e)]
print(json.dumps({{
    "version": logra_jax.__version__,
    "updated": updated,
    "missing": missing,
    "rl_found": [n for n in {rl!r} if importlib.util.find_spec(n) is not None],
    "distributions": sorted({{d.metadata["Name"] for d in importlib.metadata.distributions()}}),
}}))
"""


@pytest.fixture(scope="module")
def lean(tmp_path_factory, project) -> dict:
    site = core_site(tmp_path_factory.mktemp("core") / "site", project["dependencies"])
    code = PROBE.format(example=readme_optax_example(), guarded=GUARDED, rl=RL_PACKAGES)
    result = run_isolated(site, code)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_core_alone_runs_the_readme_optax_example(lean):
    import logra_jax

    assert lean["version"] == logra_jax.__version__
    assert lean["updated"] > 0.5  # the example's target moved off its initial ones


def test_the_isolated_python_sees_only_the_core(lean, project):
    """The probe's environment is lean: no RL package is findable, and exactly the core's closure is installed."""
    assert lean["rl_found"] == []
    expected = {canonicalize_name(n) for n in requirement_closure(project["dependencies"])}
    assert {canonicalize_name(n) for n in lean["distributions"]} == expected


def test_rl_entry_points_name_the_extra(lean):
    for module in GUARDED:
        name, message = lean["missing"][module]
        assert name in RL_PACKAGES or name.split(".")[0] in RL_PACKAGES, (module, name)
        assert f"{module} needs the optional dependencies of logra_jax[rl]" in message, message
        assert "pip install 'logra_jax[rl]'" in message
    # an unguarded module that imports flax fails here as a core module importing flax would
    assert lean["missing"]["logra_jax.parallel.sharding"][0] == "flax"


def test_the_probe_fails_when_a_core_package_is_left_out(tmp_path, project):
    """The harness can fail: without numpy (a core dependency), importing logra_jax.optim does."""
    site = core_site(tmp_path / "site", project["dependencies"], leave_out=("numpy",))
    result = run_isolated(site, "import logra_jax.optim")
    assert result.returncode != 0
    assert "No module named 'numpy'" in result.stderr, result.stderr[-2000:]
