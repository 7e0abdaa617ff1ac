"""The packaging tests read pyproject.toml's [project] table and the lock (requirements*.txt) from the checkout."""

import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def project() -> dict:
    """pyproject.toml's [project] table."""
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]
