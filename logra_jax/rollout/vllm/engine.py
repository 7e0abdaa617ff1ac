"""vLLM as the rollout engine, fed by low-rank sync (`rollout.engine = "vllm"`).

`VLLMEngine` starts `python -m logra_jax.rollout.vllm.server` with the interpreter of the vLLM venv (`make
venv-vllm`), on a Hugging Face folder of the job's model (`logra_jax.models.hf.export`, or the user's checkpoint),
as an engine process of logra_jax.rollout.process (`VLLMProcess`), and drives it as our worker is driven
(`logra_jax.rollout.engine.WorkerEngine`, the `RolloutEngine` interface):
  publish(updates, params) -> SyncReport    the same payloads as the JAX worker (`PolicySync`): U and seeds, never
                                            dense weights; the server merges them into float32 masters in torch
                                            (logra_jax.rollout.vllm.extension) and reloads the changed tensors into
                                            vLLM;
  generate(prompts, prompt_mask, key, config=None) -> Rollout;   resyncs; close().
Drift check: after every `probe_every` publications the trainer sends, for `probe_entries` fixed random entries of
every parameter, its float32 values; the server answers with its masters' and the engine sends a full snapshot when
any differs by more than `probe_tolerance` · max|W| of its leaf (the bitwise fingerprint of the JAX worker does not
apply: torch's U·A may round differently from XLA's).

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, the log-probability of the sampled token under the
distribution it was drawn from (after temperature, top-k and top-p). Without truncation (top_k = 0, top_p = 1)
that is log softmax(z/τ), what our sampler returns; with truncation it is the renormalised truncated distribution
(our sampler returns the tempered one before truncation). Either way it is the behaviour policy's probability, and
the TIS cap corrects the remaining rollout/trainer mismatch (kernels, dtype).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.core.tree_paths import flat_params
from logra_jax.models.config import ModelConfig
from logra_jax.models.hf import hf_tensor_names, rope_heads
from logra_jax.rollout.engine import WorkerEngine
from logra_jax.rollout.process import EngineProcess, WorkerError
from logra_jax.rollout.sampling import Rollout, SamplingConfig
from logra_jax.rollout.sync import SyncReport, snapshot_payload
from logra_jax.rollout.vllm.settings import VLLMSettings
from logra_jax.rollout.wire import new_secret, pack


def hf_table(config: ModelConfig) -> dict[str, list[Any]]:
    """{parameter path: [HF name with "{i}", transposed?, RoPE heads or None, interleaved RoPE?]}: the export
    mapping (logra_jax.models.hf) the server needs to turn masters into vLLM's checkpoint tensors."""
    return {path: [name, transpose, rope_heads(name, config), config.rope_interleaved]
            for path, name, transpose in hf_tensor_names(config)}


class VLLMProcess(EngineProcess):
    """The vLLM server process (`python -m logra_jax.rollout.vllm.server` with the vLLM venv's interpreter): the
    transport `VLLMEngine` drives (sync, generate, probe, fetch).

    Args:
      model_config: the trainer's model config.
      sampling: the rollout's sampling settings (`generate`'s default).
      shapes: {path: shape} of the trainer's parameters (the server's float32 masters).
      model_dir, settings, start_timeout_s, request_timeout_s, secret: as `VLLMEngine`.

    Raises:
      WorkerError: the interpreter is missing, or vLLM exits or does not come up in time (with its log).
      ValueError: `model_dir` holds no config.json.
    """

    label = "vLLM engine"

    def __init__(self, model_config: ModelConfig, sampling: SamplingConfig, shapes: Mapping[str, tuple[int, ...]],
                 *, model_dir: str | Path, settings: VLLMSettings, start_timeout_s: float, request_timeout_s: float,
                 secret: bytes | None):
        python = Path(settings.python)
        if not python.is_file():
            raise WorkerError(f"config.rollout.vllm_python = {str(python)!r} does not exist: run `make venv-vllm`")
        if not Path(model_dir, "config.json").is_file():
            raise ValueError(f"VLLMEngine: model_dir {str(model_dir)!r} holds no config.json (export the model "
                             "with logra_jax.models.hf.export)")
        self.sampling = sampling
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib), "TOKENIZERS_PARALLELISM": "false"}
        env.pop("XLA_FLAGS", None)
        if settings.devices:
            env["CUDA_VISIBLE_DEVICES"] = settings.devices
        hello = {"model_dir": str(Path(model_dir).resolve()), "vllm": dataclasses.asdict(settings),
                 "table": hf_table(model_config), "shapes": {p: list(shape) for p, shape in shapes.items()},
                 "max_model_len": int(model_config.max_seq_len)}
        super().__init__([str(python), "-m", "logra_jax.rollout.vllm.server"], env,
                         new_secret() if secret is None else secret, pack(hello, {}),
                         start_timeout_s=start_timeout_s, request_timeout_s=request_timeout_s,
                         cwd=Path(__file__).resolve().parents[3])

    def generate(self, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                 config: SamplingConfig | None = None) -> Rollout:
        """Sample with vLLM (config: other sampling settings, e.g. greedy); rows as our sampler's (prompt-major)."""
        config = config or self.sampling
        data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        seed = int(np.asarray(data, np.uint32).reshape(-1)[-1])
        body = pack({"sampling": dataclasses.asdict(config), "seed": seed},
                    {"prompts": np.asarray(prompts, np.int32), "prompt_mask": np.asarray(prompt_mask, bool)})
        _, arrays = self._request("generate", body)
        return Rollout.from_arrays(arrays)

    def probe(self, index: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{path: the masters' float32 values at these flat indices}."""
        _, arrays = self._request("probe", pack({}, {p: i.astype(np.int32) for p, i in index.items()}))
        return arrays


class VLLMEngine(WorkerEngine):
    """vLLM in its own process, fed by low-rank sync (see the module docstring).

    Args:
      model_config: the trainer's model config.
      sampling: the rollout's sampling settings.
      params: the trainer's weights (nnx.State of the Params) at `version`.
      model_dir: a Hugging Face folder of this model (vLLM builds its model from it; weights come by snapshot).
      settings: VLLMSettings (None: its defaults).
      version, trained: as `PolicySync`.
      probe_every, probe_entries, probe_tolerance: the drift check (module docstring); probe_every=0 turns it off.
      start_timeout_s, request_timeout_s: how long vLLM may take to come up, and one request.
      secret: the run secret (None: a fresh one).

    Raises:
      WorkerError: the interpreter is missing, or vLLM exits or does not come up in time (with its log).
    """

    def __init__(self, model_config: ModelConfig, sampling: SamplingConfig, params: Any, *, model_dir: str | Path,
                 settings: VLLMSettings | None = None, version: int = 0, trained: Collection[str] = (),
                 probe_every: int = 1, probe_entries: int = 64, probe_tolerance: float = 1e-4,
                 start_timeout_s: float = 600.0, request_timeout_s: float = 1800.0, secret: bytes | None = None):
        flat = flat_params(params)
        rng = np.random.default_rng(0)
        self._probe_index = {p: np.sort(rng.choice(a.size, min(probe_entries, a.size), replace=False))
                             for p, a in flat.items()}
        self.probe_every, self.probe_tolerance = probe_every, probe_tolerance
        self.probe_resyncs = 0
        self.last_drift: dict[str, float] = {}
        transport = VLLMProcess(model_config, sampling, {p: tuple(a.shape) for p, a in flat.items()},
                                model_dir=model_dir, settings=settings or VLLMSettings(),
                                start_timeout_s=start_timeout_s, request_timeout_s=request_timeout_s, secret=secret)
        super().__init__(transport, params, version=version, trained=trained)

    @property
    def resyncs(self) -> int:
        return self.sync.resyncs + self.probe_resyncs

    def publish(self, updates: Any, params: Any) -> SyncReport:
        """Push the update as a delta; every `probe_every` publications check drift and resync past tolerance."""
        report = self.sync.push(updates, params)
        if self.probe_every and self.sync.version % self.probe_every == 0:
            start = time.perf_counter()
            self.last_drift = self.drift(params)
            leaf_max = {p: float(np.abs(v).max()) for p, v in self._trainer_probe(params).items()}
            over = [p for p, d in self.last_drift.items() if d > self.probe_tolerance * max(leaf_max[p], 1e-30)]
            if over:
                self.probe_resyncs += 1
                snap = self.sync.send(snapshot_payload(params, self.sync.version), params, start)
                return report._replace(nbytes=report.nbytes + snap.nbytes, seconds=report.seconds + snap.seconds,
                                       reply=snap.reply, resync_reason=f"drift past tolerance in {over[:3]}")
        return report

    def _trainer_probe(self, params: Any) -> dict[str, np.ndarray]:
        flat = flat_params(params)
        return jax.device_get({p: jnp.asarray(flat[p]).reshape(-1)[i] for p, i in self._probe_index.items()})

    def drift(self, params: Any) -> dict[str, float]:
        """{path: max |W_engine − W_trainer|} over the probed entries (float32 masters on the engine side)."""
        ours = self._trainer_probe(params)
        theirs = self.transport.probe(self._probe_index)
        return {p: float(np.abs(theirs[p].astype(np.float64) - ours[p].astype(np.float64)).max()) for p in ours}
