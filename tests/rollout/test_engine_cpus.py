"""rollout.engine_cpus: an engine process pinned to the CPUs named, it and every thread it starts (XLA's pools)."""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.rollout.process import CPUS_ENV, cpu_list
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.sync import PolicySync
from logra_jax.rollout.worker import WorkerProcessTransport


def test_cpu_lists_parse_like_taskset_and_name_the_culprit():
    assert cpu_list("") == set() and cpu_list("0") == {0}
    assert cpu_list("0, 3-5,7", check_host=False) == {0, 3, 4, 5, 7}
    with pytest.raises(ValueError, match=rf"{CPUS_ENV}='1-x': not a CPU list"):
        cpu_list("1-x")
    with pytest.raises(ValueError, match=rf"{CPUS_ENV}='4096': this host has CPUs 0-"):
        cpu_list("4096")


def test_a_pinned_worker_and_all_its_threads_run_on_the_cpus_named():
    model = init_model(preset("tiny"))
    with WorkerProcessTransport(preset("tiny"), SamplingConfig(max_new_tokens=2, eos_id=1, pad_id=0),
                                env={CPUS_ENV: "0"}) as worker:
        PolicySync(worker.sync, nnx.state(model, nnx.Param))  # its weights: XLA's thread pools start
        worker.generate(jnp.array([[5, 6]]), jnp.array([[1, 1]]), jax.random.key(0))
        threads = list(Path(f"/proc/{worker.pid}/task").iterdir())
        allowed = {frozenset(os.sched_getaffinity(int(t.name))) for t in threads}
    assert len(threads) > 1 and allowed == {frozenset({0})}  # XLA's threads too
