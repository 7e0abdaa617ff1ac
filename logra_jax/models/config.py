"""Decoder configurations: one frozen dataclass for Llama, Qwen2 and SmolLM2, plus named presets.

Every field is validated when the config is built; a bad value raises ValueError naming the field and value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

RopeScaling = Literal["linear", "llama3"]
Remat = Literal["none", "full", "save_dots", "save_sketch"]
AttentionImpl = Literal["dense", "chunked"]

_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama/Qwen2 family).

    Attributes:
      architecture: "llama" or "qwen2" (Qwen2 = Llama with q/k/v bias); informs checkpoint export.
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: shapes.
      rope_theta: RoPE base frequency.
      rope_interleaved: False = rotate-half (HF convention), True = interleaved pairs (GGUF/Meta convention).
      rope_scaling: None, "linear" or "llama3"; its numbers in `rope_scaling_factor`, `rope_low_freq_factor`,
        `rope_high_freq_factor`, `rope_original_max_position`.
      rms_norm_eps: RMSNorm epsilon.
      qkv_bias: q/k/v projections carry a bias (Qwen2).
      tie_embeddings: the output head reuses the input embedding.
      max_seq_len: longest sequence (prompt + generation) the model is used with.
      dtype: compute dtype ("float32" or "bfloat16").
      param_dtype: how the matrices (kernels, embeddings) are stored, "float32" or "bfloat16"; norm scales and
        biases are always float32. The run sets it from `optimizer.weight_dtype` for the RL phase.
      remat: activation checkpointing per block: "none", "full", "save_dots" or "save_sketch" (keep only the
        LoGRA projections X Aᵀ of sketch-native targets).
      attention_impl: "dense" materialises [T, T] scores; "chunked" runs an online softmax over key chunks.
      attention_chunk: key-chunk length of the chunked attention.
    """

    architecture: Literal["llama", "qwen2"] = "llama"
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10_000.0
    rope_interleaved: bool = False
    rope_scaling: RopeScaling | None = None
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = True
    max_seq_len: int = 512
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: Remat = "none"
    attention_impl: AttentionImpl = "dense"
    attention_chunk: int = 512

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_seq_len", "attention_chunk",
                     "rope_original_max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"ModelConfig.rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if self.architecture not in ("llama", "qwen2"):
            raise ValueError(f"ModelConfig.architecture must be 'llama' or 'qwen2', got {self.architecture!r}")
        if self.rope_scaling not in (None, "linear", "llama3"):
            raise ValueError(
                f"ModelConfig.rope_scaling must be None, 'linear' or 'llama3', got {self.rope_scaling!r}")
        if self.rope_scaling is not None and not self.rope_scaling_factor >= 1.0:
            raise ValueError(
                f"ModelConfig.rope_scaling_factor must be >= 1, got {self.rope_scaling_factor!r}")
        if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ValueError(
                "ModelConfig.rope_high_freq_factor must exceed rope_low_freq_factor, got "
                f"{self.rope_high_freq_factor!r} <= {self.rope_low_freq_factor!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.param_dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.param_dtype must be one of {_DTYPES}, got {self.param_dtype!r}")
        if self.remat not in ("none", "full", "save_dots", "save_sketch"):
            raise ValueError(
                f"ModelConfig.remat must be 'none', 'full', 'save_dots' or 'save_sketch', got {self.remat!r}")
        if self.attention_impl not in ("dense", "chunked"):
            raise ValueError(
                f"ModelConfig.attention_impl must be 'dense' or 'chunked', got {self.attention_impl!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"ModelConfig has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, L = self.hidden_size, self.intermediate_size, self.num_layers
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        block = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + L * block + d + head


PRESETS: dict[str, ModelConfig] = {
    # Unit tests and the CPU demo (character-level vocabulary).
    "tiny": ModelConfig(),
    # HuggingFaceTB/SmolLM2-135M(-Instruct).
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100_000.0, rms_norm_eps=1e-5,
        tie_embeddings=True, max_seq_len=8192),
    # Qwen/Qwen2.5-0.5B(-Instruct).
    "qwen2.5-0.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        qkv_bias=True, tie_embeddings=True, max_seq_len=32768),
    # Qwen/Qwen2.5-Math-1.5B (the paper's small model; rope base 10k, 4k context).
    "qwen2.5-1.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=10_000.0, rms_norm_eps=1e-6,
        qkv_bias=True, tie_embeddings=True, max_seq_len=4096),
    # Qwen/Qwen2.5-Math-7B.
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=10_000.0, rms_norm_eps=1e-6,
        qkv_bias=True, tie_embeddings=False, max_seq_len=4096),
    # A 27B-class dense decoder (Gemma-3-27B widths in the Llama layout), for shape-only memory analysis.
    "dense-27b": ModelConfig(
        architecture="llama", vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=62,
        num_heads=32, num_kv_heads=16, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_embeddings=True, max_seq_len=8192),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, optionally with fields overridden (e.g. dtype="bfloat16")."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
