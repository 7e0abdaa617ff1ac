"""Shared by the main-job tests: a tiny run config and its metrics without the machine-dependent timings."""

import json
from pathlib import Path

import jax
import pytest
from jax._src import compilation_cache as compilation_cache_module  # reset_cache: no public equivalent

# Metrics that measure the machine, not the run.
TIMING = ("step_time", "rollout_time", "rollout_wait_time", "sync_time", "sync_bytes", "host_rss_bytes",
          "host_peak_rss_bytes")


def make_tiny_config(**sections):
    config = {
        "model": {"preset": "tiny", "overrides": {"max_seq_len": 16}},
        "task": {"kind": "arithmetic", "difficulty": 1, "operations": "+", "train_size": 64, "eval_size": 4,
                 "prompt_style": "compact"},
        "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_new_tokens": 3},
        "optimizer": {"name": "logra", "rank": 4, "update_ratio": 1e-2},
        "train": {"steps": 3, "microbatches": 2, "mesh_fsdp": 1},  # one device unless a test asks for a mesh
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def metrics_of(workdir):
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


@pytest.fixture(scope="session")
def tiny_config():
    """make_tiny_config(**sections): the tiny model on one-digit additions, 3 LoGRA steps, sections overridable."""
    return make_tiny_config


@pytest.fixture(scope="session")
def read_metrics():
    """metrics_of(workdir): metrics.jsonl's records without the timing and memory fields."""
    return metrics_of


@pytest.fixture(autouse=True)
def compilation_cache(monkeypatch):
    """The tests here run the tiny job again and again (a resumed run compiles what the straight run compiled, a
    second run what the first did): the session's persistent compilation cache (tests/conftest.py) turns each
    repeat into a load, in this process and in the job subprocesses a test starts. Measured on 2 cores:
    tests/train 400 s without it, 269 s with it."""
    monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "true")
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache_module.reset_cache()  # is_cache_used() remembers its first answer
    yield
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache_module.reset_cache()


@pytest.fixture(scope="session")
def finish_tiny_run(tmp_path_factory, tiny_config):
    """finish(name, **train) -> (workdir, config): the tiny run with these train fields, run to its end in a new
    directory named after `name` (a session fixture's finished run, shared by the tests that copy it)."""
    from logra_jax.job.train import train_and_evaluate

    def finish(name, **train):
        workdir = tmp_path_factory.mktemp(name)
        config = tiny_config(train=train)
        train_and_evaluate(config, workdir)
        return workdir, config

    return finish
