"""The experiments' menus: the optimizers the memory and device experiments compare, and the paper's numerics.

Shared by experiments/memory (run.py, breakdown.py) and experiments/device (step_check.py, sync_check.py); import
it with the repository root on sys.path (`python -m`, or PYTHONPATH=. as experiments/device/check.sh sets).
"""

from __future__ import annotations

from logra_jax.job.run_config import OptimizerSection
from logra_jax.models.config import ModelConfig, preset


def contender_sections(rank: int = 256) -> dict[str, OptimizerSection]:
    """The optimizers the memory and device experiments compare, as a run config names them.

    adamw: every parameter; adamw_targets: exactly LoGRA's targets, the rest frozen (like for like); galore
    (optax.contrib); adafactor; LoGRA in dense-gradient mode, sketch-native, and sketch-native with the
    predicted-KL controller (set its `probe_responses` for the mesh: the paper probes 2 sequences per device), and
    that with the sketch-space momentum (`optimizer.momentum`) or with bfloat16 weights (`optimizer.weight_dtype`).
    """
    return {
        "adamw": OptimizerSection(name="adamw", learning_rate=1e-6),
        "adamw_targets": OptimizerSection(name="adamw", learning_rate=1e-6, targets_only=True),
        "galore": OptimizerSection(name="galore", learning_rate=1e-6, rank=rank),
        "adafactor": OptimizerSection(name="adafactor", learning_rate=1e-6),
        "logra_dense_grad": OptimizerSection(name="logra", rank=rank, sketch_native=False),
        "logra_sketch_native": OptimizerSection(name="logra", rank=rank, sketch_native=True),
        "logra_sketch_native_kl": OptimizerSection(name="logra", rank=rank, sketch_native=True, kl_control=True),
        # the same with the sketch-space first moment (one fp32 [rows, r] array per target, issue 33)
        "logra_sketch_native_kl_momentum": OptimizerSection(name="logra", rank=rank, sketch_native=True,
                                                            kl_control=True, momentum=0.9, refresh_every=16),
        # LoGRA+KL with its matrices stored in bfloat16, merged with stochastic rounding (issue 34)
        "logra_sketch_native_kl_bf16": OptimizerSection(name="logra", rank=rank, sketch_native=True,
                                                        kl_control=True, weight_dtype="bfloat16"),
    }


def paper_numerics(name: str, seq_len: int = 4096) -> ModelConfig:
    """The preset at the paper's numerics: bf16 compute, fp32 weights, full remat per block, chunked attention."""
    return preset(name, dtype="bfloat16", remat="full", attention_impl="chunked", attention_chunk=512,
                  max_seq_len=max(seq_len, preset(name).max_seq_len))
