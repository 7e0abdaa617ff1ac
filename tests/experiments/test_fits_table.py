"""The "what fits where" tables in README.md and experiments/REPORT.md are the ones experiments/memory/fits.py
generates from the committed plans (experiments/memory/fits.json): no figure typed by hand, none stale."""

import json

import pytest

from experiments.memory import fits


def test_fits_json_rows_are_its_plans_rows():
    plans = json.loads(fits.OUT.with_suffix(".json").read_text())["plans"]
    assert fits.load_rows() == fits.ordered([fits.row(p) for p in plans])


@pytest.mark.parametrize("path", fits.BLOCK_FILES, ids=lambda p: str(p.relative_to(fits.REPO)))
def test_the_block_is_generated_from_fits_json(path):
    text = path.read_text()
    assert fits.replace_block(text, fits.block(fits.load_rows()), str(path)) == text, (
        f"{path.name}'s what-fits-where table differs from experiments/memory/fits.json: run "
        "python -m experiments.memory.fits --table_only")


def test_replace_block_names_a_file_without_markers():
    with pytest.raises(ValueError, match=r"README\.md: no"):
        fits.replace_block("no block here", "x", "README.md")
