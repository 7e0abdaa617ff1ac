"""The runnable examples in logra_jax.optim's docstrings run and print what they claim."""

import doctest
import importlib

import pytest

MODULES = ["alias", "lowrank", "lowrank_scale", "momentum", "predicted_kl", "projection", "row_adam", "sketch", "spec",
           "targets", "update_ratio"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"logra_jax.optim.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
