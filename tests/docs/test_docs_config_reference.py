"""The generated configuration reference (docs/configs.md) lists every RunConfig field with a meaning."""

import dataclasses
import importlib.util
from collections.abc import Mapping
from pathlib import Path

import pytest

from logra_jax.job import run_config

_PATH = Path(__file__).resolve().parents[2] / "docs" / "_ext" / "config_reference.py"


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.spec_from_file_location("config_reference", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _all_fields():
    for section in dataclasses.fields(run_config.RunConfig):
        for field in dataclasses.fields(type(section.default)):
            yield section.name, field


def test_every_field_has_a_meaning_and_no_entry_is_stale(reference):
    missing, stale = reference.missing_meanings()
    assert not missing, f"RunConfig fields without a meaning (add to FIELD_MEANINGS in {_PATH}): {missing}"
    assert not stale, f"FIELD_MEANINGS entries for fields that do not exist: {stale}"


def test_the_page_lists_every_field_with_its_type_and_default(reference):
    page = reference.reference_markdown()
    for section, field in _all_fields():
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        default = dict(default) if isinstance(default, Mapping) else default
        assert f"| `{section}.{field.name}` | " in page
        assert f"| `{default!r}` |" in page.split(f"| `{section}.{field.name}` |", 1)[1].split("\n", 1)[0]


def test_choices_come_from_the_code(reference):
    row = next(r for r in reference.fields() if r["key"] == "algorithm.estimator")
    for name in run_config.ESTIMATORS:
        assert f"`{name}`" in row["meaning"]


def test_a_field_without_a_meaning_is_reported(reference, monkeypatch):
    meanings = dict(reference.FIELD_MEANINGS)
    del meanings["train.log_every"]  # TrainSection's docstring speaks of "log periods", not of log_every
    meanings["train.no_such_field"] = "x"
    monkeypatch.setattr(reference, "FIELD_MEANINGS", meanings)
    assert reference.missing_meanings() == (["train.log_every"], ["train.no_such_field"])
    with pytest.raises(ValueError, match=r"train\.log_every"):
        reference.reference_markdown()
