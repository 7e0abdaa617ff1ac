"""The README's code snippets run as written, in order (like a notebook), and do what the text says."""

import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

README = Path(__file__).resolve().parents[2] / "README.md"


def snippets(section: str) -> list[str]:
    """The ```python blocks of the README section whose heading is `section`."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert match, f"README has no section {section!r}"
    return re.findall(r"```python\n(.*?)```", match.group(1), flags=re.S)


def test_optax_snippet_merges_targets_and_freezes_the_rest():
    (code,) = snippets("Use it in your own optax code")
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert (np.asarray(ns["params"]["mlp"]["up_proj"]["kernel"]) != 1).any()
    np.testing.assert_array_equal(ns["params"]["norm"], np.ones(64))


def test_nnx_snippets_both_routes_give_the_same_weights_and_hyperparams_change():
    blocks = snippets("Use with Flax NNX")
    assert len(blocks) == 3
    ns: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)  # drop-in: nnx.Optimizer + dense_updates=True
    fresh = ns["MLP"](nnx.Rngs(0))
    moved = nnx.state(ns["model"], nnx.Param)
    assert np.isfinite(float(ns["loss"]))
    assert (np.asarray(moved["up_proj"]["kernel"][...]) != np.asarray(fresh.up_proj.kernel[...])).any()
    np.testing.assert_array_equal(moved["up_proj"]["bias"][...], fresh.up_proj.bias[...])  # non-target: frozen

    exec(compile(blocks[1], "README.md", "exec"), ns)  # memory-lean: split state + logra_jax apply_updates
    lean = nnx.state(ns["lean"], nnx.Param)
    for a, b in zip(jax.tree.leaves(lean), jax.tree.leaves(moved)):  # different jits: allow fusion rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

    exec(compile(blocks[2], "README.md", "exec"), ns)  # inject_hyperparams under nnx.Optimizer
    state = ns["optimizer"].opt_state
    assert isinstance(state, optax.InjectStatefulHyperparamsState)
    assert float(state.hyperparams["update_ratio"][...]) == pytest.approx(5e-4)
