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


def test_tally_counts_placements_and_each_optimizers_fits():
    rows = [{"variant": v, "target": t, "optimizer": o, "fits": f} for v, t, o, f in [
        ("7b", "h100:1", "logra_kl", True), ("7b", "h100:1", "adamw", True), ("7b", "h100:1", "adamw_targets", False),
        ("72b", "h100:8", "logra_kl", True), ("72b", "h100:8", "adamw", False)]]
    assert fits._render(*fits.tally_template(rows)) == (
        "Of the 2 placements planned, LoGRA + KL fits 2, AdamW-targets 0 and AdamW 1.")
