"""The SFT warm start computed once per seed and reused: the reused weights are the trained ones bit for bit."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from logra_jax.job.sft import cached_warm_start
from logra_jax.job.train import train_and_evaluate
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_cached_warm_start_trains_once_and_reloads_bit_for_bit(tmp_path):
    trained = init_model(preset("tiny"), seed=0)
    calls = []

    def warm_start(model=trained):  # stands in for SFT: moves every weight
        calls.append(1)
        nnx.update(model, jax.tree.map(lambda x: x * 1.5 + 0.25, nnx.state(model, nnx.Param)))
        return {"sft_loss": 0.5}

    key = {"seed": 3, "sft": {"steps": 10}}
    metrics, cached = cached_warm_start(trained, warm_start, tmp_path, key)
    assert (metrics, cached, len(calls)) == ({"sft_loss": 0.5}, False, 1)
    fresh = init_model(preset("tiny"), seed=0)
    metrics, cached = cached_warm_start(fresh, lambda: pytest.fail("must not train again"), tmp_path, key)
    assert (metrics, cached) == ({"sft_loss": 0.5}, True)
    for a, b in zip(_params(trained), _params(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    # Another key trains again; a file that does not fit the model is an error naming it.
    cached_warm_start(init_model(preset("tiny"), seed=0), warm_start, tmp_path, {**key, "seed": 4})
    assert len(calls) == 2
    other = init_model(preset("tiny", hidden_size=32, head_dim=8), seed=0)
    with pytest.raises(ValueError, match=r"SFT cache .*sft-.*\.npz"):
        cached_warm_start(other, warm_start, tmp_path, key)


@pytest.mark.slow
def test_runs_from_the_cache_equal_the_run_that_filled_it(tmp_path):
    config = {
        "model": {"preset": "tiny", "overrides": {"max_seq_len": 16}},
        "task": {"kind": "arithmetic", "difficulty": 1, "operations": "+", "train_size": 64, "eval_size": 4,
                 "prompt_style": "compact"},
        "sft": {"steps": 3, "batch_size": 4, "cache_dir": str(tmp_path / "cache")},
        "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_new_tokens": 3},
        "optimizer": {"name": "adamw", "learning_rate": 1e-3},
        "train": {"steps": 1},
    }
    rows, sft = {}, {}
    for run in ("fills", "reuses"):
        sft[run] = train_and_evaluate(config, tmp_path / run)["sft"]
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        rows[run] = [{k: v for k, v in json.loads(line).items() if "time" not in k and "rss" not in k}
                     for line in lines]
    assert rows["fills"] == rows["reuses"]
    assert (sft["fills"].pop("cached"), sft["reuses"].pop("cached")) == (False, True)
    assert sft["fills"] == sft["reuses"]  # the warm start's losses come with its weights
    assert "loaded from the cache" in (tmp_path / "reuses" / "log.txt").read_text()
    assert len(list(Path(tmp_path / "cache").glob("sft-*.npz"))) == 1
