"""requires_extra names the extra for a missing third-party package and leaves every other error alone."""

import importlib

import pytest

from logra_jax.core.extras import requires_extra


def test_a_missing_package_names_the_extra_and_keeps_the_module_name():
    with pytest.raises(ModuleNotFoundError) as info, requires_extra("rl", "logra_jax.some_module"):
        importlib.import_module("a_package_not_installed.sub")
    assert str(info.value) == ("logra_jax.some_module needs the optional dependencies of logra_jax[rl] (no module "
                               "named 'a_package_not_installed'): pip install 'logra_jax[rl]'")
    assert info.value.name == "a_package_not_installed"
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_a_missing_logra_jax_module_and_other_errors_pass_unchanged():
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'logra_jax.no_such_module'$"), \
            requires_extra("rl", "logra_jax.some_module"):
        importlib.import_module("logra_jax.no_such_module")
    with pytest.raises(RuntimeError, match=r"^inside$"), requires_extra("rl", "logra_jax.some_module"):
        raise RuntimeError("inside")


def test_an_unknown_extra_is_refused():
    refused = pytest.raises(ValueError, match=r"extra must be one of \('rl', 'vllm'\), got 'gpu'")
    with refused, requires_extra("gpu", "m"):
        pass
