"""Shared by the tests of the PyTorch side of the rollout engines (the projection port, vLLM's receiver)."""

import pytest


@pytest.fixture(scope="session")
def torch():
    """torch, imported by the tests that use it, not at collection (every xdist worker collects every module; the
    modules that use torch are one xdist group, "torch": tests/models/conftest.py)."""
    return pytest.importorskip("torch")
