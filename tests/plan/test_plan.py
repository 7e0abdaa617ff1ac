"""`python -m logra_jax.plan`: its train step is the memory experiment's train step (same bytes), a phase that
does not fit exits 3 naming it and what to change, and the phases it builds are the job's (8 fake CPU devices)."""

from __future__ import annotations

import jax

from logra_jax import plan
from logra_jax.memory_analysis import rl_step_memory
from logra_jax.models import preset
from logra_jax.phases import job_mesh
from logra_jax.run_config import OptimizerSection, RunConfig
from logra_jax.sharding import FAST_CPU_COMPILE, MeshConfig, make_mesh

MODEL = {"preset": "tiny", "tokenizer": "char", "overrides": {"max_seq_len": 32}}


def test_train_step_bytes_agree_with_the_memory_experiment():
    """The plan's train step (the job's step from the run config) and `memory_analysis.rl_step_memory` (the memory
    tables' step) compile the same sharded program for the same shapes: equal bytes up to the updates the job's
    step also returns for policy sync (rank-4 factors of the tiny model's targets)."""
    run = RunConfig.from_dict({
        "model": MODEL, "rollout": {"prompts_per_step": 4, "num_samples": 1, "max_new_tokens": 8},
        "algorithm": {"estimator": "reinforce", "policy": "reinforce", "tis_cap": 2.0},
        "optimizer": {"name": "logra", "rank": 4, "sketch_native": True},
        "train": {"microbatches": 1, "mesh_fsdp": 4}})
    mesh = job_mesh(run.train, jax.devices()[:4])
    (phase,) = plan.plan_phases(run, mesh, prompt_len=8, compiler_options=FAST_CPU_COMPILE, only=("train step",))
    reference = rl_step_memory(preset("tiny", max_seq_len=32), OptimizerSection(name="logra", rank=4),
                               make_mesh(MeshConfig(fsdp=4), jax.devices()[:4]), seq_len=16, prompt_len=8)
    assert phase.name == "train step" and phase.others > 0  # the colocated engine's weights beside the step
    assert abs(phase.program["argument"] - reference["argument"]) <= 1024, (phase.program, reference)
    assert abs(phase.program["total"] - reference["total"]) <= 0.05 * reference["total"], (phase.program, reference)


def test_a_phase_that_does_not_fit_exits_3_naming_it(capsys):
    args = ["--config=configs/demo.py:runlocal", "--target=cpu:2", "--prompt_len=8", "--phases", "start",
            "trainer init", "--set", "sft.steps=0"]
    assert plan.main([*args, "--hbm_gib=1e-6"]) == 3
    out = capsys.readouterr().out
    assert "start needs" in out and "more devices (train.mesh_fsdp)" in out and "do not fit" in out
    assert plan.main([*args, "--hbm_gib=1"]) == 0
    assert "every phase fits" in capsys.readouterr().out


def test_bad_flags_name_the_culprit(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        plan.main(["--config=configs/demo.py", "--target=cpu:2"])  # no HBM size for fake CPU devices
    assert e.value.code == 2 and "--hbm_gib" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--config=configs/demo.py", "--target=tpu9:2x2", "--hbm_gib=1"])
    assert "target must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--config=configs/demo.py", "--target=cpu:2", "--hbm_gib=1", "--set", "rollout.nope=3"])
    assert "config has no field rollout.nope" in capsys.readouterr().err


def test_default_mesh_uses_every_device():
    """train.mesh_fsdp = -1 (the default): FSDP over all devices; fixed sizes still take the first devices and
    an impossible product is an error naming the fields."""
    import pytest

    assert job_mesh(RunConfig().train, jax.devices()).shape == {"data": 1, "fsdp": 8, "tensor": 1}
    fixed = RunConfig.from_dict({"train": {"mesh_fsdp": 2, "mesh_data": 2}}).train
    assert job_mesh(fixed, jax.devices()).devices.size == 4
    with pytest.raises(ValueError, match=r"mesh_data × mesh_fsdp × mesh_tensor = 3 × -1 × 1"):
        job_mesh(RunConfig.from_dict({"train": {"mesh_data": 3}}).train, jax.devices())


def test_device_bytes_counts_shards_keys_and_skips_static_arguments():
    mesh = make_mesh(MeshConfig(fsdp=4), jax.devices()[:4])
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    tree = {"rows": jax.ShapeDtypeStruct((8, 3), jax.numpy.float32, sharding=split),  # 2 rows per device
            "whole": jax.ShapeDtypeStruct((5,), jax.numpy.bfloat16),
            "key": jax.eval_shape(lambda: jax.random.key(0)), "graph": "static"}
    assert plan.device_bytes(tree) == 2 * 3 * 4 + 5 * 2 + 8
