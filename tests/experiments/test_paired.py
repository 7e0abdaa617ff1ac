"""experiments.sweep.paired, the verdict of the paired studies (bf16 − f32 storage, vLLM − our engine): the paired
per-seed differences' Student-t interval, by hand."""

import math

import pytest

from experiments.sweep import paired

T_975_DF2 = 4.303  # two-sided 95%, 2 degrees of freedom (printed tables)


def test_differences_spread_around_zero_are_level():
    # mean 0.03125, sample std 0.046875 (deviations ±0.046875 and 0)
    got = paired([0.078125, -0.015625, 0.03125], names=("bfloat16", "float32"))
    half = T_975_DF2 * 0.046875 / math.sqrt(3)
    assert got["mean"] == pytest.approx(0.03125) and got["std"] == pytest.approx(0.046875)
    assert got["interval"] == pytest.approx([0.03125 - half, 0.03125 + half], rel=1e-3)
    assert got["verdict"] == "level"


@pytest.mark.parametrize(("diffs", "verdict"), [([0.10, 0.12, 0.11], "bfloat16 higher"),
                                                ([-0.10, -0.12, -0.11], "bfloat16 lower")])
def test_an_interval_clear_of_zero_names_the_storage_that_ended_higher(diffs, verdict):
    got = paired(diffs, names=("bfloat16", "float32"))
    half = T_975_DF2 * 0.01 / math.sqrt(3)  # std 0.01
    assert got["interval"] == pytest.approx([got["mean"] - half, got["mean"] + half], rel=1e-3)
    assert got["verdict"] == verdict


def test_one_seed_supports_no_verdict():
    got = paired([0.078125], names=("vLLM", "ours"))
    assert got["std"] == 0.0 and got["interval"] == [-math.inf, math.inf]
    assert got["verdict"] == "undecided (one seed)"
