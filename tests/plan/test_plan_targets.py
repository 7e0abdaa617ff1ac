"""Planning the job's train step for every listed TPU target in one process (the order matters: each target names
its own accelerator type to libtpu, and TPU v4's per-TensorCore devices go through the job's own mesh builder).

Runs only under the TPU compile-only venv (skipped, with the command that creates it, elsewhere):
  JAX_PLATFORMS=cpu .venv-tpu/bin/python -m pytest -q tests/plan/test_plan_targets.py    # make venv-tpu
"""

from __future__ import annotations

import os

import pytest

from logra_jax import aot, plan
from logra_jax.phases import job_mesh
from logra_jax.run_config import RunConfig

TPU_TARGETS = tuple(t for t in aot.TARGETS if aot.target_info(t).platform == "tpu")


def test_every_tpu_target_plans_the_tiny_train_step():
    if not aot.compiler_available(TPU_TARGETS[0]):
        pytest.skip("the TPU compiler is not installed here (make venv-tpu; run under .venv-tpu)")
    run = RunConfig.from_dict({
        "model": {"preset": "tiny", "tokenizer": "char", "overrides": {"max_seq_len": 32}},
        "rollout": {"prompts_per_step": 8, "num_samples": 1, "max_new_tokens": 8},
        "algorithm": {"estimator": "reinforce", "policy": "reinforce", "tis_cap": 2.0},
        "optimizer": {"name": "logra", "rank": 4, "sketch_native": True},
        "train": {"microbatches": 1, "mesh_fsdp": -1}})
    for target in TPU_TARGETS:
        info = aot.target_info(target)
        mesh = job_mesh(run.train, aot.devices(target))
        assert os.environ["TPU_ACCELERATOR_TYPE"] == aot.accelerator_type(target)
        assert mesh.devices.size == info.num_devices and mesh.devices.flat[0].device_kind == info.device_kind
        (phase,) = plan.plan_phases(run, mesh, prompt_len=8, only=("train step",))
        assert 0 < phase.program["total"] < info.hbm_bytes, (target, phase.program)
