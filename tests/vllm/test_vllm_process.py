"""The vLLM side without vLLM: the server imports no JAX and runs the engine loop it shares with our worker
(logra_jax.rollout.process), its settings are the config's vllm_* fields, and `VLLMEngine` is a `RolloutEngine`
whose server starts, proves the run secret and reports vLLM's absence from its hello."""

import dataclasses
import subprocess
import sys

import pytest
from flax import nnx

from logra_jax.job.run_config import RolloutSection, RunConfig
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.rollout.engine import RolloutEngine
from logra_jax.rollout.process import WorkerError
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.vllm.engine import VLLMEngine
from logra_jax.rollout.vllm.settings import VLLMSettings


def test_the_server_side_imports_no_jax(torch):
    code = ("import sys, logra_jax.rollout.vllm.server\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


def test_config_vllm_fields_are_the_settings_fields():
    rollout = RolloutSection()
    config = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout) if f.name.startswith("vllm_")}
    assert config == {f"vllm_{name}": value for name, value in dataclasses.asdict(VLLMSettings()).items()}
    run = RunConfig.from_dict({"rollout": {"engine": "vllm", "vllm_max_seqs": 8, "vllm_memory_fraction": 0.5}})
    assert run.rollout.vllm_settings() == VLLMSettings(max_seqs=8, memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"config\.rollout\.vllm_max_seqs must be a positive integer, got 0"):
        RunConfig.from_dict({"rollout": {"engine": "vllm", "vllm_max_seqs": 0}})


def test_vllm_engine_is_a_rollout_engine_and_names_a_missing_vllm(tmp_path, torch):
    assert issubclass(VLLMEngine, RolloutEngine)
    (tmp_path / "config.json").write_text("{}")
    config = preset("tiny")
    params = nnx.state(init_model(config), nnx.Param)
    with pytest.raises(WorkerError, match=r"vLLM engine 'hello' request failed: .*No module named 'vllm'"):
        VLLMEngine(config, SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0), params, model_dir=tmp_path,
                   settings=VLLMSettings(python=sys.executable))
