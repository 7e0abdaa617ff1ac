"""`python -m logra_jax.plan`: its train step is the memory experiment's train step (same bytes), a phase that
does not fit exits 3 naming it and what to change, and the phases it builds are the job's (8 fake CPU devices)."""

from __future__ import annotations

import json

import jax
import pytest

from logra_jax import plan as plan_cli
from logra_jax.job.phases import job_mesh
from logra_jax.job.run_config import OptimizerSection, RunConfig
from logra_jax.models import preset
from logra_jax.parallel.sharding import FAST_CPU_COMPILE, MeshConfig, make_mesh
from logra_jax.planner import plan
from logra_jax.planner.memory_analysis import rl_step_memory

MODEL = {"preset": "tiny", "tokenizer": "char", "overrides": {"max_seq_len": 32}}


@pytest.mark.slow
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
    # no KL reference, and the colocated engine released its weights for the step: nothing beside it
    assert phase.name == "train step" and phase.others == 0
    assert abs(phase.program["argument"] - reference["argument"]) <= 1024, (phase.program, reference)
    assert abs(phase.program["total"] - reference["total"]) <= 0.05 * reference["total"], (phase.program, reference)


def test_bad_flags_name_the_culprit(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--config=configs/demo.py", "--target=cpu:2"])  # no HBM size for fake CPU devices
    assert e.value.code == 2 and "--hbm_gib" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["--config=configs/demo.py", "--target=tpu9:2x2", "--hbm_gib=1"])
    assert "target must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["--config=configs/demo.py", "--target=cpu:2", "--hbm_gib=1", "--config.rollout.nope=3"])
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


def _bytes_by_hand(model_config, weight_dtype: str, engine_dtype: str, devices: int) -> dict[str, int]:
    """Per-device bytes of the KL reference (the weights as the trainer stores them: matrices split over FSDP,
    norm scales whole) and of the engine's own copy (matrices in the compute dtype, whole on every device: the
    decode layout with tensor 1 replicates them; the float32 norm scales are the trainer's own, shared)."""
    from flax import nnx

    from logra_jax.models.decoder import abstract_model
    from logra_jax.rollout.sync import flat_params

    leaves = flat_params(nnx.state(abstract_model(model_config), nnx.Param))
    matrices = sum(x.size for p, x in leaves.items() if p.endswith(("kernel", "embedding")))
    norms = sum(x.size for p, x in leaves.items() if not p.endswith(("kernel", "embedding")))
    size = {"float32": 4, "bfloat16": 2}
    return {"ref": matrices * size[weight_dtype] // devices + norms * 4, "engine": matrices * size[engine_dtype]}


@pytest.mark.slow
def test_every_phase_counts_the_engine_and_reference_the_job_builds():
    """All eight phases compile on a tiny job (2 fake devices, FSDP) with bfloat16 weights, the two that hold the
    engine and the reference with float32 weights too; the train step's "beside it" (the KL reference: the engine
    released its copy for the step) and the policy sync's output (the engine's copy) equal a hand count from the
    model's shapes: the engine follows the trainer's model (bf16 compute: bf16 matrices) and the reference is
    stored as the trainer stores its weights."""
    mesh = job_mesh(RunConfig.from_dict({"train": {"mesh_fsdp": 2}}).train, jax.devices()[:2])
    for weight_dtype in ("float32", "bfloat16"):
        run = RunConfig.from_dict({
            "model": {**MODEL, "overrides": {"max_seq_len": 32, "dtype": "bfloat16"}},
            "rollout": {"prompts_per_step": 4, "num_samples": 2, "max_new_tokens": 8},
            "algorithm": {"kl_beta": 0.1}, "sft": {"steps": 2, "batch_size": 4},
            "optimizer": {"name": "logra", "rank": 4, "weight_dtype": weight_dtype},
            "train": {"microbatches": 1, "mesh_fsdp": 2}})
        only = None if weight_dtype == "bfloat16" else ("train step", "policy sync")
        phases = {p.name: p for p in plan.plan_phases(run, mesh, prompt_len=8, compiler_options=FAST_CPU_COMPILE,
                                                      only=only)}
        assert list(phases) == list(only or plan.PHASES), weight_dtype
        hand = _bytes_by_hand(preset("tiny", max_seq_len=32), weight_dtype, "bfloat16", 2)
        assert phases["train step"].others == hand["ref"], (weight_dtype, phases["train step"])
        sync = phases["policy sync"]
        # XLA:CPU adds the output tuple's table: 8 bytes per output leaf.
        assert 0 <= sync.program["output"] - hand["engine"] <= 8 * 16, (weight_dtype, sync.program)
        assert all(p.program["total"] > 0 for p in phases.values())


def test_policy_sync_with_every_leaf_shared_is_an_empty_program():
    """On one device with the trainer's own compute dtype the engine shares every array (it copies nothing; the
    engine's test checks that): the policy sync is still planned, as a program with no output, not a crash (the
    1.5B one-chip plan failed so once publish went in groups)."""
    run = RunConfig.from_dict({"model": MODEL, "optimizer": {"name": "logra", "rank": 4}, "sft": {"steps": 0},
                               "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_new_tokens": 4}})
    mesh = job_mesh(run.train, jax.devices()[:1])
    (sync,) = plan.plan_phases(run, mesh, prompt_len=8, compiler_options=FAST_CPU_COMPILE, only=("policy sync",))
    assert sync.name == "policy sync" and "(0 leaves in 1 programs;" in sync.note, sync.note
    assert sync.program["output"] <= 8, sync.program  # nothing built (XLA:CPU's output tuple table aside)


def test_the_exit_status_says_which_phase_does_not_fit(capsys, tmp_path):
    """A limit between the trainer init's bytes (the optimizer state from the donated weights) and the start's
    (the weights being created): the start is named with what to change, the trainer init fits."""
    args = ["--config=configs/demo.py:runlocal", "--target=cpu:2", "--prompt_len=8", "--phases", "start",
            "--phases=trainer init", "--config.sft.steps=0"]
    assert plan_cli.main([*args, "--hbm_gib=1", f"--json={tmp_path / 'plan.json'}"]) == 0
    assert "every phase fits" in capsys.readouterr().out
    total = {p["name"]: p["total"] for p in json.loads((tmp_path / "plan.json").read_text())["phases"]}
    assert 0 < total["trainer init"] < total["start"], total
    assert plan_cli.main([*args, f"--hbm_gib={(total['start'] + total['trainer init']) / 2 / 2**30}"]) == 3
    out = capsys.readouterr().out
    assert "start needs" in out and "trainer init needs" not in out and "1 phase(s) do not fit" in out
    assert "more devices (train.mesh_fsdp)" in out  # what to change


def test_config_fields_are_overridden_as_for_main(capsys):
    """`--config.<section>.<field>=<value>` as `python -m logra_jax.main` takes it; a bad override, config file or
    flag exits 2 naming it."""
    fv = plan_cli.parse_flags(["--config=configs/demo.py:runlocal", "--target=cpu:2", "--config.rollout.slots=64",
                               "--phases=rollout", "--phases=train step"])
    assert fv.config.rollout.slots == 64 and fv.phases == ["rollout", "train step"]
    assert fv["config"].config_filename == "configs/demo.py:runlocal"
    for argv, culprit in ((["--config.rollout.slots=abc"], "--config.rollout.slots=abc"),
                          (["--set", "rollout.slots=64"], "set"), (["--phases=nope"], "--phases=nope")):
        with pytest.raises(SystemExit) as e:
            plan_cli.parse_flags(["--config=configs/demo.py", "--target=cpu:2", *argv])
        assert e.value.code == 2 and culprit in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        plan_cli.parse_flags(["--config=configs/nope.py", "--target=cpu:2"])
    assert e.value.code == 2 and "configs/nope.py" in capsys.readouterr().err
