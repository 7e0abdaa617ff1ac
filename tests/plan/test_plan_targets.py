"""Planning the job's train step for every listed TPU target in one process (the order matters: each target names
its own accelerator type to libtpu, and TPU v4's per-TensorCore devices go through the job's own mesh builder).

Runs only under the TPU compile-only venv (skipped, with the command that creates it, elsewhere):
  JAX_PLATFORMS=cpu .venv-tpu/bin/python -m pytest -q tests/plan/test_plan_targets.py    # make venv-tpu
"""

from __future__ import annotations

import os

import pytest

from logra_jax.job.phases import job_mesh
from logra_jax.job.run_config import RunConfig
from logra_jax.planner import aot, plan

TPU_TARGETS = tuple(t for t in aot.TARGETS if aot.target_info(t).platform == "tpu")


SINGLE_CHIPS = ("v5e:1x1", "v6e:1x1")  # a Colab TPU v5e is one chip


def tiny_run() -> RunConfig:
    return RunConfig.from_dict({
        "model": {"preset": "tiny", "tokenizer": "char", "overrides": {"max_seq_len": 32}},
        "rollout": {"prompts_per_step": 8, "num_samples": 1, "max_new_tokens": 8},
        "algorithm": {"estimator": "reinforce", "policy": "reinforce", "tis_cap": 2.0},
        "optimizer": {"name": "logra", "rank": 4, "sketch_native": True},
        "train": {"microbatches": 1, "mesh_fsdp": -1}})


def test_every_tpu_target_plans_the_tiny_train_step():
    if not aot.compiler_available(TPU_TARGETS[0]):
        pytest.skip("the TPU compiler is not installed here (make venv-tpu; run under .venv-tpu)")
    run = tiny_run()
    for target in (*TPU_TARGETS, *SINGLE_CHIPS):
        info = aot.target_info(target)
        mesh = job_mesh(run.train, aot.devices(target))
        assert os.environ["TPU_ACCELERATOR_TYPE"] == aot.accelerator_type(target)
        assert mesh.devices.size == info.num_devices and mesh.devices.flat[0].device_kind == info.device_kind
        (phase,) = plan.plan_phases(run, mesh, prompt_len=8, only=("train step",))
        assert 0 < phase.program["total"] < info.hbm_bytes, (target, phase.program)


def test_hosts_of_a_topology_smaller_than_libtpus_default_host_are_named():
    # libtpu's default host is 2x2x1 chips: a smaller topology names its own, a divisible one keeps the default
    assert aot._chips_per_host("1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert aot._chips_per_host("1x2") == {"chips_per_host_bounds": (1, 2, 1)}
    assert aot._chips_per_host("2x4") == aot._chips_per_host("2x2x1") == {}
    assert aot.target_for("v5e", 1) == "v5e:1x1" and aot.accelerator_type("v5e:1x1") == "v5litepod-1"
