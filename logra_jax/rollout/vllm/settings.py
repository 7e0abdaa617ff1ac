"""What the job passes through to vLLM (`VLLMSettings`): the one definition that config.rollout.vllm_* takes its
fields and defaults from (logra_jax.job.run_config), the trainer's `VLLMEngine` starts vLLM with, and the server
builds `vllm.LLM` from. The standard library only: the server reads it in vLLM's venv.
"""

from __future__ import annotations

import dataclasses

VLLM_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class VLLMSettings:
    """vLLM's settings, each field config.rollout.vllm_<field>.

    Attributes:
      python: the vLLM venv's interpreter (`make venv-vllm` makes .venv-vllm/bin/python).
      tensor_parallel: vLLM's tensor-parallel degree (its `tensor_parallel_size`).
      memory_fraction: vLLM's memory fraction on a GPU (its `gpu_memory_utilization`; ignored by its CPU build).
      dtype: the dtype vLLM holds and computes in ("float32", "bfloat16", "float16").
      max_seqs: sequences vLLM decodes at once (its `max_num_seqs`).
      kv_cache_gib: VLLM_CPU_KVCACHE_SPACE for the CPU build (GiB).
      devices: CUDA_VISIBLE_DEVICES for the engine ("" leaves it as it is).

    Raises:
      ValueError: a field out of range (named config.rollout.vllm_<field>, with the value).
    """

    python: str = ".venv-vllm/bin/python"
    tensor_parallel: int = 1
    memory_fraction: float = 0.3
    dtype: str = "bfloat16"
    max_seqs: int = 256
    kv_cache_gib: int = 2
    devices: str = ""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "max_seqs", "kv_cache_gib"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.rollout.vllm_{name} must be a positive integer, got {value!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"config.rollout.vllm_memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"config.rollout.vllm_dtype must be one of {VLLM_DTYPES}, got {self.dtype!r}")
