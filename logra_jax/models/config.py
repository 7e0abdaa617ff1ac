"""Decoder configurations: one frozen dataclass for Llama, Qwen2, SmolLM2, Qwen3, Gemma 3 (text) and the
mixture-of-experts Qwen3-MoE and Mixtral, plus presets.

Every field is validated when the config is built; a bad value raises ValueError naming the field and value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

RopeScaling = Literal["linear", "llama3"]
Remat = Literal["none", "full", "save_dots", "save_sketch"]
AttentionImpl = Literal["dense", "chunked"]
Architecture = Literal["llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"]
Activation = Literal["silu", "gelu_tanh"]

ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral")
# The mixture-of-experts families (every layer's MLP is `logra_jax.models.moe.MoE`); the others are dense.
MOE_ARCHITECTURES: tuple[str, ...] = ("qwen3_moe", "mixtral")

_DTYPES = ("float32", "bfloat16")

# The ModelConfig fields that tell the families apart, and each family's values (a config with other values has
# no Hugging Face class): Qwen2 = Llama + q/k/v bias; Qwen3 = Llama + q/k norm; Gemma 3 = the rest. Gemma 3's
# attention fields (query_pre_attn_scalar, sliding_window, rope_local_theta) are None in the other families.
_FEATURE_DEFAULTS: dict[str, Any] = {"qkv_bias": False, "qk_norm": False, "norm_offset": 0.0, "post_norms": False,
                                     "mlp_activation": "silu", "scale_embeddings": False}
FAMILY_FEATURES: dict[str, dict[str, Any]] = {
    "llama": _FEATURE_DEFAULTS,
    "qwen2": {**_FEATURE_DEFAULTS, "qkv_bias": True},
    "qwen3": {**_FEATURE_DEFAULTS, "qk_norm": True},
    "gemma3": {**_FEATURE_DEFAULTS, "qk_norm": True, "norm_offset": 1.0, "post_norms": True,
               "mlp_activation": "gelu_tanh", "scale_embeddings": True},
    "qwen3_moe": {**_FEATURE_DEFAULTS, "qk_norm": True},
    "mixtral": {**_FEATURE_DEFAULTS, "norm_topk_prob": True},
}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama, Qwen2, Qwen3 and Gemma 3 families).

    The families differ only in the fields below; `architecture` names the checkpoint layout they export to:
    Llama (the base), Qwen2 (+ q/k/v bias), Qwen3 (+ per-head q/k RMSNorm, `head_dim` free of hidden / heads),
    Gemma 3 (+ q/k norm, (1 + w) norms, a norm after attention and after the MLP, GeGLU with tanh GELU,
    embeddings scaled by √hidden, scores scaled by `query_pre_attn_scalar`^-½, sliding-window layers).

    Attributes:
      architecture: "llama", "qwen2", "qwen3", "gemma3", "qwen3_moe" (Qwen3 with MoE MLPs) or "mixtral" (Llama
        with MoE MLPs); informs checkpoint export.
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: shapes.
      rope_theta: RoPE base frequency (of the global layers when some layers slide).
      rope_interleaved: False = rotate-half (HF convention), True = interleaved pairs (GGUF/Meta convention).
      rope_scaling: None, "linear" or "llama3"; its numbers in `rope_scaling_factor`, `rope_low_freq_factor`,
        `rope_high_freq_factor`, `rope_original_max_position`; it applies to the global layers only.
      rms_norm_eps: RMSNorm epsilon.
      norm_offset: every RMSNorm multiplies by (norm_offset + w): 0 (Llama, Qwen) or 1 (Gemma, whose stored w
        is centred on 0).
      qkv_bias: q/k/v projections carry a bias (Qwen2).
      qk_norm: an RMSNorm over head_dim on every query and key head before RoPE (Qwen3, Gemma 3).
      post_norms: the attention and MLP outputs are normed before their residual add (Gemma 3: four norms per
        block).
      mlp_activation: the gate's activation, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated GELU).
      scale_embeddings: token embeddings are multiplied by √hidden_size (Gemma).
      query_pre_attn_scalar: scores are scaled by query_pre_attn_scalar^-½; None = head_dim^-½.
      sliding_window: keys further than this many positions behind a query are masked on the sliding layers
        (a query sees itself and the sliding_window − 1 tokens before it); None = every layer global.
      sliding_window_pattern: with a sliding window, layer i is global when (i + 1) % pattern == 0 and slides
        otherwise (Gemma 3: 6, five local layers per global one).
      rope_local_theta: RoPE base frequency of the sliding layers (no RoPE scaling there); None = rope_theta.
      tie_embeddings: the output head reuses the input embedding.
      max_seq_len: longest sequence (prompt + generation) the model is used with.
      dtype: compute dtype ("float32" or "bfloat16").
      param_dtype: how the matrices (kernels, embeddings) are stored, "float32" or "bfloat16"; norm scales and
        biases are always float32. The run sets it from `optimizer.weight_dtype` for the RL phase.
      remat: activation checkpointing per block: "none", "full", "save_dots" or "save_sketch" (keep only the
        LoGRA projections X Aᵀ of sketch-native targets).
      attention_impl: "dense" materialises [T, T] scores; "chunked" runs an online softmax over key chunks.
      attention_chunk: key-chunk length of the chunked attention.
      num_experts: experts per MoE layer (`logra_jax.models.moe`); 0 = a dense model (architectures other than
        "qwen3_moe" and "mixtral").
      experts_per_token: k, the experts each token is routed to (0 in a dense model).
      expert_intermediate_size: each expert's hidden width F_e (0 in a dense model; Mixtral's equals
        intermediate_size).
      norm_topk_prob: the k routing weights are renormalised to sum to 1 (Qwen3-MoE's flag; always for Mixtral).
      moe_layer_step: layer i is MoE when (i + 1) % moe_layer_step == 0 and dense (intermediate_size) otherwise
        (Qwen3-MoE's decoder_sparse_step); 1 = every layer MoE. num_layers must be a multiple of it (the decoder
        scans over groups of moe_layer_step layers).
      decode_unroll: one module per layer (parameters blocks.{i}.<path>, `decoder.layer_source`) and a per-layer
        KV cache (`Decoder.init_cache`: one buffer per layer), the layers unrolled instead of scanned over stacks
        (the rollout engine sets it for GPUs: XLA:GPU then reads each layer's weights and KV cache in place, where
        a loop copies each layer's slices out of the stacks first). Decoding only: the trainer keeps the stacks.
    """

    architecture: Architecture = "llama"
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
    norm_offset: float = 0.0
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    mlp_activation: Activation = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int = 1
    rope_local_theta: float | None = None
    tie_embeddings: bool = True
    max_seq_len: int = 512
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: Remat = "none"
    attention_impl: AttentionImpl = "dense"
    attention_chunk: int = 512
    decode_unroll: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layer_step: int = 1

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
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"ModelConfig.norm_offset must be 0 or 1, got {self.norm_offset!r}")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ValueError(
                f"ModelConfig.mlp_activation must be 'silu' or 'gelu_tanh', got {self.mlp_activation!r}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(
                f"ModelConfig.query_pre_attn_scalar must be > 0 or None, got {self.query_pre_attn_scalar!r}")
        for name in ("sliding_window", "sliding_window_pattern"):
            value = getattr(self, name)
            if (value is not None or name == "sliding_window_pattern") and (
                    not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ValueError(f"ModelConfig.rope_local_theta must be > 0 or None, got {self.rope_local_theta!r}")
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
        self._check_experts()

    def _check_experts(self) -> None:
        """MoE fields: positive (1 <= k <= E) in an MoE architecture, zero in a dense one."""
        names = ("num_experts", "experts_per_token", "expert_intermediate_size")
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be a non-negative integer, got {value!r}")
        if self.architecture in MOE_ARCHITECTURES:
            for name in names:
                if getattr(self, name) <= 0:
                    raise ValueError(f"ModelConfig.{name} must be > 0 for architecture={self.architecture!r}, "
                                     f"got {getattr(self, name)}")
            if not isinstance(self.moe_layer_step, int) or self.moe_layer_step <= 0 or (
                    self.num_layers % self.moe_layer_step):
                raise ValueError(f"ModelConfig.moe_layer_step must be a positive divisor of num_layers "
                                 f"({self.num_layers}), got {self.moe_layer_step!r}")
            if self.experts_per_token > self.num_experts:
                raise ValueError(f"ModelConfig.experts_per_token ({self.experts_per_token}) exceeds num_experts "
                                 f"({self.num_experts})")
        else:
            for name, off in (*((n, 0) for n in names), ("norm_topk_prob", False), ("moe_layer_step", 1)):
                if getattr(self, name) != off:
                    raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} needs an MoE architecture "
                                     f"{MOE_ARCHITECTURES}, got architecture={self.architecture!r}")

    @property
    def moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is a mixture of experts (all False in a dense model)."""
        return tuple(self.moe and (i + 1) % self.moe_layer_step == 0 for i in range(self.num_layers))

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends through the sliding window (all False without a window)."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        return tuple((i + 1) % self.sliding_window_pattern != 0 for i in range(self.num_layers))

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
        if self.qk_norm:
            attn += 2 * self.head_dim
        norms = (4 if self.post_norms else 2) * d
        moe_layers = sum(self.moe_layers())
        moe = moe_layers * (self.num_experts * (d + 3 * d * self.expert_intermediate_size))
        dense = (L - moe_layers) * 3 * d * f
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + L * (attn + norms) + moe + dense + d + head


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> ModelConfig:
    """A Qwen3 dense preset: 8 KV heads of 128, q/k norm, RoPE base 1e6, vocabulary 151936."""
    return ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_embeddings=tied, max_seq_len=40960, **FAMILY_FEATURES["qwen3"])


def _gemma3(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
            query_pre_attn_scalar: int, window: int, linear_rope: float | None, max_len: int) -> ModelConfig:
    """A Gemma 3 text preset: five sliding layers (RoPE base 1e4) per global one (base 1e6, optionally
    linearly scaled), tied embeddings."""
    return ModelConfig(
        architecture="gemma3", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=1_000_000.0,
        rope_scaling=None if linear_rope is None else "linear", rope_scaling_factor=linear_rope or 1.0,
        rms_norm_eps=1e-6, query_pre_attn_scalar=float(query_pre_attn_scalar), sliding_window=window,
        sliding_window_pattern=6, rope_local_theta=10_000.0, tie_embeddings=True, max_seq_len=max_len,
        **FAMILY_FEATURES["gemma3"])


PRESETS: dict[str, ModelConfig] = {
    # Unit tests and the CPU demo (character-level vocabulary).
    "tiny": ModelConfig(),
    # The same size in the Qwen3 and Gemma 3 layouts (unit tests, runlocal runs): Qwen3's head_dim apart from
    # hidden / heads (4 × 32 on 64); Gemma 3's layers slide (window 8) and go global in turn.
    "tiny-qwen3": ModelConfig(architecture="qwen3", head_dim=32, rope_theta=1_000_000.0,
                              **FAMILY_FEATURES["qwen3"]),
    "tiny-gemma3": ModelConfig(architecture="gemma3", rope_theta=1_000_000.0, query_pre_attn_scalar=24.0,
                               sliding_window=8, sliding_window_pattern=2, rope_local_theta=10_000.0,
                               **FAMILY_FEATURES["gemma3"]),
    # The tiny size as a Qwen3-MoE (unit tests and the CPU demo): 4 experts of width 32, top-2, renormalised.
    "tiny-qwen3-moe": ModelConfig(architecture="qwen3_moe", head_dim=32, rope_theta=1_000_000.0, num_experts=4,
                                  experts_per_token=2, expert_intermediate_size=32, norm_topk_prob=True,
                                  **FAMILY_FEATURES["qwen3_moe"]),
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
    # Qwen/Qwen2.5-72B(-Instruct): its config.json (RMS-norm epsilon 1e-5, RoPE base 1e6, 128K context).
    "qwen2.5-72b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
        qkv_bias=True, tie_embeddings=False, max_seq_len=131072),
    # Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} (dense; the same names with -Base).
    **{f"qwen3-{name}": _qwen3(*shape) for name, shape in {
        "0.6b": (1024, 3072, 28, 16, True), "1.7b": (2048, 6144, 28, 16, True),
        "4b": (2560, 9728, 36, 32, True), "8b": (4096, 12288, 36, 32, False),
        "14b": (5120, 17408, 40, 40, False), "32b": (5120, 25600, 64, 64, False)}.items()},
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (+ -Base, -Instruct-2507, -Thinking-2507), their config.json:
    # 30B-A3B: hidden 2048, 48 layers, 32 heads / 4 KV heads of 128, 128 experts of width
    # (moe_intermediate_size) 768, top-8, norm_topk_prob, intermediate_size 6144 (unused: every layer is MoE,
    # decoder_sparse_step 1, mlp_only_layers []), vocabulary 151936, untied, RoPE base 1e6, 40960 positions.
    # 235B-A22B: hidden 4096, 94 layers, 64 heads / 4 KV heads of 128, 128 experts of width 1536, top-8,
    # intermediate_size 12288, the rest as 30B-A3B.
    **{f"qwen3-{name}": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=hidden, intermediate_size=dense_width,
        num_layers=layers, num_heads=heads, num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_embeddings=False, max_seq_len=40960, num_experts=128, experts_per_token=8,
        expert_intermediate_size=expert_width, norm_topk_prob=True, **FAMILY_FEATURES["qwen3_moe"])
       for name, (hidden, dense_width, layers, heads, expert_width) in {
           "30b-a3b": (2048, 6144, 48, 32, 768), "235b-a22b": (4096, 12288, 94, 64, 1536)}.items()},
    # google/gemma-3-1b-{pt,it} (text-only) and the text decoder of google/gemma-3-{4b,12b,27b}-{pt,it}.
    "gemma3-1b": _gemma3(262144, 1152, 6912, 26, 4, 1, 256, 256, 512, None, 32768),
    "gemma3-4b": _gemma3(262208, 2560, 10240, 34, 8, 4, 256, 256, 1024, 8.0, 131072),
    "gemma3-12b": _gemma3(262208, 3840, 15360, 48, 16, 8, 256, 256, 1024, 8.0, 131072),
    "gemma3-27b": _gemma3(262208, 5376, 21504, 62, 32, 16, 128, 168, 1024, 8.0, 131072),
    # A 27B-class dense decoder (Gemma-3-27B widths in the Llama layout), for shape-only memory analysis: the
    # committed AOT-kernel, sync and memory studies were measured on it (gemma3-27b is the real architecture).
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
