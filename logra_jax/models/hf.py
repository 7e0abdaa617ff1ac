"""Hugging Face checkpoints: config.json ↔ ModelConfig and safetensors ↔ the stacked decoder parameters.

Loading is sharded from the first byte: safetensors files are memory-mapped (pages come from the file, not the
heap) and each parameter is assembled shard by shard on the devices that hold it (`place_leaf`): a process reads
only the slices its own devices hold (q/k rows through the RoPE permutation, transposed kernels through the
transpose), and the host holds one layer's slice of one parameter at a time, never a whole model or a whole
weight that the shardings split. `LoadStats` counts the bytes read.
Export streams the other way, one leaf at a time from the device into the file.

The safetensors format (8-byte little-endian header length, JSON header, raw little-endian data) is read and
written here directly rather than through the `safetensors` package, whose numpy API has no bfloat16 (the dtype
of most released checkpoints) and whose writer needs every tensor in host memory at once.

Layout: a Hugging Face Linear weight is [out, in]; our kernel is [in, out], so every projection is transposed.
Rotary embeddings use the rotate-half convention; a model held in the interleaved convention
(`rope_interleaved=True`, e.g. GGUF weights kept as llama.cpp wrote them) gets its q/k rows reordered on export.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from logra_jax.models.config import FAMILY_FEATURES, ModelConfig
from logra_jax.models.decoder import Decoder, abstract_model, parameter_shardings
from logra_jax.models.jsonfile import read_json_object
from logra_jax.models.tokenizer import Tokenizer

# config.json "architectures" entry → ModelConfig.architecture, and ours → config.json "model_type".
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
               "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}
# Per MoE family: the MLP's tensor-name prefix and its experts' gate, up, down names (what save_pretrained writes;
# transformers fuses them into experts.gate_up_proj [E, 2F, D] and experts.down_proj [E, D, F] in memory only).
_MOE_NAMES = {"qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
              "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2"))}
# Multimodal checkpoints whose text decoder we load: architecture → (config.json field holding the decoder's
# config, prefix of its tensor names, prefixes of the tensors of the other modalities, which are skipped).
MULTIMODAL = {"Gemma3ForConditionalGeneration": ("text_config", "language_model.",
                                                 ("vision_tower.", "multi_modal_projector."))}
# transformers' Gemma3TextConfig defaults: the multimodal checkpoints' text_config lists only what differs.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096}
# Fields only Gemma 3 sets (None elsewhere).
_GEMMA_ONLY = ("query_pre_attn_scalar", "sliding_window", "rope_local_theta")
_SLIDING, _FULL = "sliding_attention", "full_attention"
# Fields a caller may change at load time: numerics and memory, never shapes (those belong to the checkpoint).
RUNTIME_FIELDS = ("dtype", "remat", "attention_impl", "attention_chunk", "max_seq_len")

# ModelConfig field → the config.json field it comes from, where the names differ (for error messages).
_HF_FIELDS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads", "max_seq_len": "max_position_embeddings",
              "rope_scaling_factor": "rope_scaling.factor", "rope_low_freq_factor": "rope_scaling.low_freq_factor",
              "rope_high_freq_factor": "rope_scaling.high_freq_factor",
              "rope_original_max_position": "rope_scaling.original_max_position_embeddings",
              "sliding_window_pattern": "layer_types", "rope_local_theta": "rope_local_base_freq",
              "experts_per_token": "num_experts_per_tok", "expert_intermediate_size": "moe_intermediate_size",
              "moe_layer_step": "decoder_sparse_step"}
_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
              "F64": np.dtype("<f8")}


def rope_rows_to_interleaved(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder the rows of a q/k weight [H·hd, ...] (or bias) from rotate-half to interleaved RoPE order.

    Per head, row j·hd/2 + i (pair (i, i + hd/2) rotated by frequency i) moves to row 2i + j (pair (2i, 2i + 1));
    this is llama.cpp's converter permutation. q·k is unchanged when both sides are reordered alike.
    """
    hd = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_rows_to_half(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of `rope_rows_to_interleaved`: interleaved RoPE row order → rotate-half order."""
    hd = w.shape[0] // num_heads
    return w.reshape(num_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_names(config: ModelConfig) -> list[tuple[str, str, bool]]:
    """(parameter path, Hugging Face tensor name with "{i}" for the layer, transposed?) for every leaf.

    Llama's "post_attention_layernorm" is the norm before the MLP; Gemma 3's is the norm after attention (its
    pre-MLP norm is "pre_feedforward_layernorm"). An MoE model's expert kernels [L, E, in, out] are one tensor
    per layer and expert, "{e}" in the name standing for the expert. "{i}" is the Hugging Face layer number, which
    `hf_layer` gives for an index into our stacks.
    """
    layer = "model.layers.{i}."
    rows = [("embed.embedding", "model.embed_tokens.weight", False),
            ("blocks.attn_norm.scale", layer + "input_layernorm.weight", False),
            ("final_norm.scale", "model.norm.weight", False)]
    if config.post_norms:
        rows += [("blocks.post_attn_norm.scale", layer + "post_attention_layernorm.weight", False),
                 ("blocks.mlp_norm.scale", layer + "pre_feedforward_layernorm.weight", False),
                 ("blocks.post_mlp_norm.scale", layer + "post_feedforward_layernorm.weight", False)]
    else:
        rows.append(("blocks.mlp_norm.scale", layer + "post_attention_layernorm.weight", False))
    rows += [(f"blocks.attn.{p}_proj.kernel", f"{layer}self_attn.{p}_proj.weight", True) for p in "qkvo"]
    if config.qkv_bias:
        rows += [(f"blocks.attn.{p}_proj.bias", f"{layer}self_attn.{p}_proj.bias", False) for p in "qkv"]
    if config.qk_norm:
        rows += [(f"blocks.attn.{p}_norm.scale", f"{layer}self_attn.{p}_norm.weight", False) for p in "qk"]
    if config.moe_layer_step > 1:  # the MoE layers' attention and norms in moe_blocks, with the same names
        shared = [(f"moe_{path}", name, t) for path, name, t in rows if path.startswith("blocks.")]
        rows += _mlp_names(layer, None) + shared + [(f"moe_{path}", name, t)
                                                    for path, name, t in _mlp_names(layer, config.architecture)]
    else:
        rows += _mlp_names(layer, config.architecture if config.moe else None)
    if not config.tie_embeddings:
        rows.append(("lm_head.kernel", "lm_head.weight", True))
    return rows


def _mlp_names(layer: str, moe_architecture: str | None) -> list[tuple[str, str, bool]]:
    """`hf_tensor_names`' rows of a block's MLP: dense, or the router and experts of an MoE family."""
    if moe_architecture is None:
        return [(f"blocks.mlp.{p}_proj.kernel", f"{layer}mlp.{p}_proj.weight", True) for p in ("gate", "up", "down")]
    prefix, experts = _MOE_NAMES[moe_architecture]
    return [("blocks.mlp.router.kernel", f"{layer}{prefix}gate.weight", True)] + [
        (f"blocks.mlp.{p}_proj.kernel", f"{layer}{prefix}experts.{{e}}.{hf}.weight", True)
        for p, hf in zip(("gate", "up", "down"), experts)]


def hf_layer(config: ModelConfig, path: str, index: int) -> int:
    """The Hugging Face layer number ("{i}") of layer `index` of the stack holding parameter `path`: the same
    number, except with moe_layer_step = s > 1, where `blocks` stacks the dense layers and `moe_blocks` the MoE
    ones (layer g·s + s − 1 of each group g).

    Example:
      >>> from logra_jax.models.config import preset
      >>> c = preset("tiny-qwen3-moe", num_layers=6, moe_layer_step=3)
      >>> [hf_layer(c, "blocks.attn.q_proj.kernel", i) for i in range(4)], hf_layer(c, "moe_blocks.attn_norm.scale", 1)
      ([0, 1, 3, 4], 5)
    """
    s = config.moe_layer_step
    if s == 1:
        return index
    if path.startswith("moe_blocks."):
        return index * s + s - 1
    return index // (s - 1) * s + index % (s - 1)


def _stacked_keys(name: str) -> tuple[str, ...]:
    """The placeholders of a tensor-name pattern, in our leaf's leading-axis order: () for a tensor outside the
    layers, ("i",) for a per-layer one, ("i", "e") for a per-layer, per-expert one."""
    return tuple(key for key in ("i", "e") if f"{{{key}}}" in name)


def rope_heads(name: str, config: ModelConfig) -> int | None:
    """Heads whose rows the RoPE convention orders, for a q/k weight or bias name (1 for a per-head q/k norm,
    whose [head_dim] weight follows the rows of every head); None for other tensors."""
    if ".self_attn.q_proj." in name:
        return config.num_heads
    if ".self_attn.k_proj." in name:
        return config.num_kv_heads
    if ".self_attn.q_norm." in name or ".self_attn.k_norm." in name:
        return 1
    return None


@dataclasses.dataclass
class LoadStats:
    """What a load read: `bytes_read` of the checkpoint's tensor data (in the file's dtype) out of `bytes_total`
    for the tensors the model uses. A process of a sharded load reads only the slices its devices hold."""

    bytes_read: int = 0
    bytes_total: int = 0


def place_leaf(shape: tuple[int, ...], sharding: jax.sharding.Sharding | None,
               read_slice: Callable[[tuple[slice, ...]], np.ndarray], *, stacked: bool = False) -> jax.Array:
    """A float32 array of `shape` in `sharding` (default: this process's first device) whose every shard is
    `read_slice(index)` for the index that shard holds, read only for this process's devices.

    Shards are read one distinct index at a time (devices holding the same slice share one read) and each is on
    its device before the next is read: the host holds one shard, never the whole array. `stacked`: the leading
    axis stacks layers, and a shard is read one layer at a time and joined on its device, so that the host holds
    one layer's slice (about one checkpoint tensor) at a time.
    """
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    by_index: dict[tuple[tuple[int, int, int], ...], list[jax.Device]] = {}
    indices = sharding.addressable_devices_indices_map(shape)
    for device, index in indices.items():
        key = tuple(slice(None) if s is None else s for s in index)
        by_index.setdefault(tuple(k.indices(n) for k, n in zip(key, shape)), []).append(device)
    shards: dict[jax.Device, jax.Array] = {}
    for bounds, devices in by_index.items():
        index = tuple(slice(*b) for b in bounds)
        parts = [index] if not stacked else [(slice(i, i + 1), *index[1:]) for i in range(*bounds[0])]
        pieces: dict[jax.Device, list[jax.Array]] = {device: [] for device in devices}
        for part in parts:
            host = np.ascontiguousarray(read_slice(part), np.float32)
            for device in devices:
                # Wait for each transfer: an asynchronous device_put keeps its host buffer alive.
                pieces[device].append(jax.device_put(host, device).block_until_ready())
            del host
        for device, arrays in pieces.items():
            shards[device] = arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=0)
    return jax.make_array_from_single_device_arrays(shape, sharding, [shards[d] for d in indices])


def build_model(config: ModelConfig, read: Callable[[str], np.ndarray], *, source: str,
                shardings: Mapping[str, jax.sharding.Sharding] | Mesh | None = None,
                stats: LoadStats | None = None) -> tuple[Decoder, set[str]]:
    """A decoder whose parameters come from `read(hf_name)` (an array in Hugging Face layout), slice by slice.

    `read` returns a lazily indexed view (a memory-mapped safetensors tensor: only the bytes of the slices taken
    are read) or one tensor's worth of fresh memory. Each parameter goes to its devices (`shardings[path]`, else
    this process's first device) shard by shard (`place_leaf`): a process reads only the slices its own devices
    hold, and the host holds one layer's slice of one parameter at a time (a Mesh for `shardings`: the
    logical-axis rules' shardings on it, `parameter_shardings`). q/k rows are reordered to the
    interleaved convention when config.rope_interleaved (the slice is taken through the permutation).

    Returns:
      (model, names read) so the caller can reject tensors the checkpoint has but the model does not use.

    Raises:
      ValueError: a tensor's shape differs from the one the config implies (tensor, expected, found named).
    """
    if isinstance(shardings, Mesh):
        shardings = parameter_shardings(config, shardings)
    graphdef, state = nnx.split(abstract_model(config))
    table = {path: (name, transpose) for path, name, transpose in hf_tensor_names(config)}
    used: set[str] = set()
    stats = LoadStats() if stats is None else stats

    def tensor(name: str, shape: tuple[int, ...], transpose: bool) -> Any:
        w = read(name)
        expected = shape[::-1] if transpose else shape
        if tuple(w.shape) != expected:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(w.shape)}, expected {expected} "
                             "from the model config")
        if name not in used:
            stats.bytes_total += int(np.prod(w.shape, dtype=np.int64)) * w.dtype.itemsize
            used.add(name)
        return w

    def tensor_slice(name: str, shape: tuple[int, ...], transpose: bool, index: tuple[slice, ...]) -> np.ndarray:
        """Our-layout slice `index` of tensor `name` (shape `shape` in our layout), read from its HF layout."""
        w = tensor(name, shape, transpose)
        hf_index = index[::-1] if transpose else index
        heads = rope_heads(name, config)
        if config.rope_interleaved and heads is not None:  # row j of ours is row perm[j] of the file
            rows = rope_rows_to_interleaved(np.arange(w.shape[0]), heads)[hf_index[0]]
            part = np.asarray(w[rows])[(slice(None), *hf_index[1:])]
        else:
            part = np.asarray(w[hf_index])
        stats.bytes_read += part.size * w.dtype.itemsize
        # A fresh copy: a CPU device_put may alias its host buffer, which must not be the checkpoint's memory.
        return np.array(part.T if transpose else part, np.float32, order="C", copy=True)

    for path_tuple, variable in nnx.to_flat_state(state):
        path = ".".join(map(str, path_tuple))
        name, transpose = table[path]
        shape = tuple(variable.get_value().shape)

        def read_slice(index: tuple[slice, ...], name: str = name, shape: tuple[int, ...] = shape,
                       transpose: bool = transpose, path: str = path) -> np.ndarray:
            stacked = _stacked_keys(name)  # the leading axes (layer, expert) that index checkpoint tensors
            n = len(stacked)
            outer = [range(size)[s] for size, s in zip(shape[:n], index[:n])]
            out = np.empty((*map(len, outer), *(len(range(m)[s]) for m, s in zip(shape[n:], index[n:]))),
                           np.float32)
            for at in np.ndindex(*map(len, outer)):
                keys = {key: outer[axis][j] for axis, (key, j) in enumerate(zip(stacked, at))}
                if "i" in keys:
                    keys["i"] = hf_layer(config, path, keys["i"])
                out[at] = tensor_slice(name.format(**keys), shape[n:], transpose, index[n:])
            return out

        variable.set_value(place_leaf(shape, None if shardings is None else shardings.get(path), read_slice,
                                      stacked=bool(_stacked_keys(name))))
    return nnx.merge(graphdef, state), used


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json", **overrides: Any) -> ModelConfig:
    """ModelConfig from a parsed config.json (Llama, Qwen2, Qwen3, Gemma 3 text, Qwen3-MoE or Mixtral;
    transformers 4.x or 5.x rope and layer-type fields), with runtime `overrides` (`RUNTIME_FIELDS`) applied;
    `source` names the file in error messages. Gemma 3 fields a config.json leaves out take Gemma3TextConfig's
    defaults. For a multimodal checkpoint (`MULTIMODAL`: Gemma3ForConditionalGeneration) the config is that of its
    text decoder.

    Raises:
      ValueError: unknown architecture, unsupported feature (activation, bias, sliding window, softcapping, rope
        type, layer pattern, dense layers among MoE ones), missing or out-of-range field — the message names the
        file and the field.
    """
    archs = hf.get("architectures")
    supported = sorted({*ARCHITECTURES, *MULTIMODAL})
    if not archs:
        raise ValueError(f"{source}: missing field 'architectures' (one of {supported})")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str) or archs[0] not in supported:
        raise ValueError(f"{source}: unsupported architecture {archs!r}; supported: {supported}")
    if archs[0] in MULTIMODAL:
        text = hf.get(MULTIMODAL[archs[0]][0])
        if not isinstance(text, Mapping):
            raise ValueError(f"{source}: {archs[0]} needs an object {MULTIMODAL[archs[0]][0]!r}, got {text!r}")
        hf = {"tie_word_embeddings": hf.get("tie_word_embeddings"), **text, "architectures": ["Gemma3ForCausalLM"]}
    architecture = ARCHITECTURES[hf["architectures"][0]]
    if architecture == "gemma3":
        hf = {**_GEMMA3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    bad_overrides = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if bad_overrides:
        raise ValueError(f"cannot override {bad_overrides} when loading {source}: only {RUNTIME_FIELDS}")

    def field(name: str, default: Any = ...) -> Any:
        if name not in hf or hf[name] is None:
            if default is ...:
                raise ValueError(f"{source}: missing field {name!r}")
            return default
        return hf[name]

    _reject_unsupported(architecture, field, source)
    gemma = architecture == "gemma3"
    heads, hidden = field("num_attention_heads"), field("hidden_size")
    default_head_dim = {"qwen3": 128, "gemma3": 256}.get(architecture) or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None)
    layers = field("num_hidden_layers")
    family: dict[str, Any] = dict(FAMILY_FEATURES[architecture])
    if gemma:
        family.update(query_pre_attn_scalar=field("query_pre_attn_scalar", 256), sliding_window=field(
            "sliding_window", 4096), sliding_window_pattern=_sliding_pattern(field, layers, source))
    if architecture in _MOE_NAMES:
        family.update(_moe_fields(architecture, field, layers, source))
    try:
        config = ModelConfig(
            architecture=architecture, vocab_size=field("vocab_size"), hidden_size=hidden,
            intermediate_size=field("intermediate_size"), num_layers=layers,
            num_heads=heads, num_kv_heads=field("num_key_value_heads", heads),
            head_dim=field("head_dim", default_head_dim), rms_norm_eps=field("rms_norm_eps", 1e-6),
            tie_embeddings=bool(field("tie_word_embeddings", gemma)),
            max_seq_len=field("max_position_embeddings", 2048), **_rope_fields(architecture, field, source),
            **family)
        return config.replace(**overrides) if overrides else config
    except (ValueError, TypeError) as err:
        renamed = [hf for ours, hf in _HF_FIELDS.items() if re.search(rf"\b{ours}\b", str(err))]
        note = f" (config.json field{'s' * (len(renamed) > 1)} {', '.join(map(repr, renamed))})" if renamed else ""
        raise ValueError(f"{source}: {err}{note}") from err


def _reject_unsupported(architecture: str, field: Callable[..., Any], source: str) -> None:
    """Raise ValueError naming the config.json field of a feature the decoder does not implement."""
    if architecture == "gemma3":
        if field("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"{source}: hidden_activation={field('hidden_activation')!r} is not supported "
                             "(only 'gelu_pytorch_tanh')")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if field(name, None) is not None:
                raise ValueError(f"{source}: {name}={field(name)!r} is not supported (only null, as in Gemma 3)")
        if field("use_bidirectional_attention", False):
            raise ValueError(f"{source}: use_bidirectional_attention=true is not supported")
    elif field("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={field('hidden_act')!r} is not supported (only 'silu')")
    if field("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    if architecture == "mixtral" and field("sliding_window", None) is not None:
        raise ValueError(f"{source}: sliding_window={field('sliding_window')!r} is not supported for mixtral "
                         "(only null)")
    if architecture != "qwen2" and field("attention_bias", False):
        raise ValueError(f"{source}: attention_bias=true (q/k/v/o bias) is not supported for {architecture}")
    if architecture in ("qwen2", "qwen3", "qwen3_moe") and field("use_sliding_window", False):
        raise ValueError(f"{source}: use_sliding_window=true is not supported for {architecture}")


def _moe_fields(architecture: str, field: Callable[..., Any], num_layers: Any, source: str) -> dict[str, Any]:
    """The ModelConfig expert fields of a Qwen3-MoE or Mixtral config.json (`num_experts` or, as transformers 5
    writes it, `num_local_experts`).

    Raises:
      ValueError: a Qwen3-MoE with dense layers listed in `mlp_only_layers`, or a `decoder_sparse_step` that does
        not divide the layers: the decoder scans over stacks of like groups, so the dense layers must be periodic.
    """
    experts = field("num_experts", None)
    out = {"num_experts": field("num_local_experts") if experts is None else experts,
           "experts_per_token": field("num_experts_per_tok", 2)}
    if architecture == "mixtral":
        return {**out, "expert_intermediate_size": field("intermediate_size")}
    if field("mlp_only_layers", []):
        raise ValueError(f"{source}: mlp_only_layers={field('mlp_only_layers')!r} is not supported (every layer "
                         "must be MoE: []); dense layers among MoE ones are not implemented")
    step = field("decoder_sparse_step", 1)
    if not isinstance(step, int) or step <= 0 or not isinstance(num_layers, int) or num_layers % step:
        raise ValueError(f"{source}: decoder_sparse_step={step!r} is not supported (only a divisor of "
                         f"num_hidden_layers={num_layers!r}: the decoder scans over groups of that many layers)")
    return {**out, "expert_intermediate_size": field("moe_intermediate_size"),
            "norm_topk_prob": bool(field("norm_topk_prob", False)), "moe_layer_step": step}


def _rope_fields(architecture: str, field: Callable[..., Any], source: str) -> dict[str, Any]:
    """The ModelConfig RoPE fields from `rope_parameters` (transformers 5; for Gemma 3 one entry per layer type)
    or `rope_theta` + `rope_scaling` (+ Gemma's `rope_local_base_freq`, transformers 4)."""
    rope_key = "rope_parameters" if field("rope_parameters", None) else "rope_scaling"
    rope = field(rope_key, None) or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"{source}: field {rope_key!r} is {rope!r}, not an object")
    out: dict[str, Any] = {}
    if architecture == "gemma3":
        local: Any = {}
        if _FULL in rope or _SLIDING in rope:
            local, rope = rope.get(_SLIDING) or {}, rope.get(_FULL) or {}
            if not isinstance(local, Mapping) or not isinstance(rope, Mapping):
                raise ValueError(f"{source}: field {rope_key!r} entries must be objects, got {field(rope_key)!r}")
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: {rope_key}.{_SLIDING}.rope_type={local['rope_type']!r} is not "
                             "supported (sliding layers use plain RoPE)")
        out["rope_local_theta"] = local.get("rope_theta", field("rope_local_base_freq", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default, linear, llama3)")
    out["rope_theta"] = rope.get("rope_theta", field("rope_theta", 1_000_000.0 if architecture == "gemma3"
                                                     else 10_000.0))
    if rope_type != "default":
        out.update(rope_scaling=rope_type, rope_scaling_factor=rope.get("factor", 1.0))
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=rope.get("low_freq_factor", 1.0),
                   rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
                   rope_original_max_position=rope.get("original_max_position_embeddings", 8192))
    return out


def _sliding_pattern(field: Callable[..., Any], num_layers: Any, source: str) -> int:
    """ModelConfig.sliding_window_pattern from Gemma 3's `layer_types` (transformers 5) or
    `sliding_window_pattern` (4.x; default 6)."""
    types = field("layer_types", None)
    if types is None:
        return field("sliding_window_pattern", 6)
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {_SLIDING, _FULL}:
        raise ValueError(f"{source}: layer_types must list {num_layers} entries of {_SLIDING!r} / {_FULL!r}, "
                         f"got {types!r}")
    pattern = types.index(_FULL) + 1 if _FULL in types else num_layers + 1
    if types != [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]:
        raise ValueError(f"{source}: layer_types {types!r} does not repeat ({pattern - 1} sliding layers, then "
                         "one full): only such patterns are supported")
    return pattern


def config_to_hf(config: ModelConfig, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """The Hugging Face config.json dict of `config` (rope and layer-type fields in the form transformers 4.x and
    5.x read).

    Raises:
      ValueError: the config has no Hugging Face equivalent (a family feature off its family's value, named).
    """
    family = FAMILY_FEATURES[config.architecture]
    for name, value in family.items():
        if getattr(config, name) != value:
            raise ValueError(f"export: architecture={config.architecture!r} with {name}={getattr(config, name)!r} "
                             f"has no Hugging Face equivalent ({config.architecture} has {name}={value!r})")
    gemma = config.architecture == "gemma3"
    for name in _GEMMA_ONLY if not gemma else ():
        if getattr(config, name) is not None:
            raise ValueError(f"export: {name}={getattr(config, name)!r} has no Hugging Face equivalent for "
                             f"architecture={config.architecture!r} (only gemma3 has it)")
    hf: dict[str, Any] = {
        "architectures": [next(k for k, v in ARCHITECTURES.items() if v == config.architecture)],
        "model_type": MODEL_TYPES[config.architecture], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None, "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32"}
    if config.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": config.rope_scaling, "factor": config.rope_scaling_factor}
    if config.rope_scaling == "llama3":
        hf["rope_scaling"].update(
            low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_position)
    if gemma:
        sliding = config.sliding_layers()
        scalar = config.query_pre_attn_scalar or config.head_dim
        hf.update(hidden_activation="gelu_pytorch_tanh",  # transformers types query_pre_attn_scalar as an int
                  query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  sliding_window=config.sliding_window, sliding_window_pattern=config.sliding_window_pattern,
                  layer_types=[_SLIDING if s else _FULL for s in sliding],
                  rope_local_base_freq=config.rope_local_theta or config.rope_theta, attention_bias=False,
                  final_logit_softcapping=None, attn_logit_softcapping=None)
    else:
        hf["hidden_act"] = "silu"
    if config.architecture == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif config.architecture in ("qwen2", "qwen3", "qwen3_moe"):
        hf.update(use_sliding_window=False, sliding_window=None)
    if config.architecture in ("qwen3", "qwen3_moe"):
        hf["attention_bias"] = False
    hf.update(_moe_to_hf(config))
    if tokenizer is not None:
        hf.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    return hf


def _moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json expert fields of an MoE config ({} for a dense one).

    Raises:
      ValueError: a Mixtral whose expert width differs from intermediate_size (Mixtral has one width).
    """
    if not config.moe:
        return {}
    out = {"num_experts_per_tok": config.experts_per_token, "output_router_logits": False}
    if config.architecture == "mixtral":
        if config.expert_intermediate_size != config.intermediate_size:
            raise ValueError(f"export: expert_intermediate_size={config.expert_intermediate_size} has no Hugging "
                             f"Face equivalent for mixtral with intermediate_size={config.intermediate_size} "
                             "(they are one field there)")
        if config.moe_layer_step != 1:
            raise ValueError(f"export: moe_layer_step={config.moe_layer_step} has no Hugging Face equivalent for "
                             "mixtral (every layer MoE)")
        return {**out, "num_local_experts": config.num_experts, "sliding_window": None}
    return {**out, "num_experts": config.num_experts, "moe_intermediate_size": config.expert_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": config.moe_layer_step,
            "mlp_only_layers": []}


def _naturals(values: Any) -> bool:
    """Whether a parsed JSON value is a list of non-negative integers (a shape or a byte range)."""
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)


class SafetensorsFile:
    """One .safetensors file, memory-mapped; `get(name)` returns a view (bytes are read when touched).

    Raises FileNotFoundError for a missing file and ValueError, naming the file (and the tensor and field), for a
    truncated header or data section, a header that is not a JSON object of {"dtype", "shape", "data_offsets"}
    entries, an unsupported dtype, or a byte range outside the data or not fitting the shape.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"safetensors file not found: {self.path}")
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{self.path}: truncated safetensors file ({size} bytes, no header length)")
            header_len = int.from_bytes(prefix, "little")
            if 8 + header_len > size:
                raise ValueError(f"{self.path}: truncated safetensors header (declares {header_len} bytes, "
                                 f"the file has {size - 8} after the length)")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{self.path}: corrupt safetensors header ({err})") from err
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: corrupt safetensors header (a JSON {type(header).__name__}, not an "
                             "object of tensor entries)")
        header.pop("__metadata__", None)
        data_len = size - 8 - header_len
        self._entries = {name: self._entry(name, entry, data_len) for name, entry in header.items()}
        self._data = (np.memmap(self.path, np.uint8, mode="r", offset=8 + header_len, shape=(data_len,))
                      if data_len else np.zeros(0, np.uint8))

    def _entry(self, name: str, entry: Any, data_len: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, start, end) of one header entry, validated against the data section's length."""
        fields = ("dtype", "shape", "data_offsets")
        if not isinstance(entry, dict):
            raise ValueError(f"{self.path}: tensor {name!r}: header entry {entry!r} is not an object with "
                             f"{', '.join(fields)}")
        missing = [k for k in fields if k not in entry]
        if missing:
            raise ValueError(f"{self.path}: tensor {name!r}: header entry lacks {', '.join(map(repr, missing))}")
        if not isinstance(entry["dtype"], str) or entry["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}; "
                             f"supported: {sorted(_ST_DTYPES)}")
        if not _naturals(entry["shape"]):
            raise ValueError(f"{self.path}: tensor {name!r}: shape {entry['shape']!r} is not a list of "
                             "non-negative integers")
        offsets = entry["data_offsets"]
        if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise ValueError(f"{self.path}: tensor {name!r}: data_offsets {offsets!r} is not [start, end] with "
                             "0 <= start <= end")
        dtype, shape, (start, end) = _ST_DTYPES[entry["dtype"]], tuple(entry["shape"]), offsets
        if end > data_len:
            raise ValueError(f"{self.path}: truncated: tensor {name!r} ends at data byte {end} but the file "
                             f"holds {data_len} data bytes")
        if end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} spans {end - start} bytes, but shape {shape} "
                             f"of {entry['dtype']} needs {math.prod(shape) * dtype.itemsize}")
        return dtype, shape, start, end

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self._entries[name]
        return self._data[start:end].view(dtype).reshape(shape)


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]) -> None:
    """Write float32 tensors to `path`, calling each producer only when its bytes are due (streaming)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        nbytes = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format recommends 8-byte aligned data
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape, produce in tensors:
            array = np.ascontiguousarray(produce(), dtype="<f4")
            if array.shape != tuple(shape):
                raise ValueError(f"write_safetensors: {name!r} produced shape {array.shape}, declared {shape}")
            f.write(memoryview(array).cast("B"))


def _open_checkpoint(directory: Path) -> dict[str, SafetensorsFile]:
    """Tensor name → the file holding it, for model.safetensors or a sharded model.safetensors.index.json."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: field 'weight_map' is {weight_map!r}, not an object mapping tensor "
                             "names to shard file names")
        bad = next((name for name, file in weight_map.items() if not isinstance(file, str)), None)
        if bad is not None:
            raise ValueError(f"{index_path}: weight_map[{bad!r}] is {weight_map[bad]!r}, not a shard file name")
        files = {f: SafetensorsFile(directory / f) for f in sorted(set(weight_map.values()))}
        for name, file in weight_map.items():
            if name not in files[file].names():
                raise ValueError(f"{index_path}: tensor {name!r} is mapped to {file}, which does not hold it")
        return {name: files[file] for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
    st = SafetensorsFile(single)
    return dict.fromkeys(st.names(), st)


def load_hf(directory: str | Path, *, shardings: Mapping[str, jax.sharding.Sharding] | Mesh | None = None,
            stats: LoadStats | None = None, weights: bool = True,
            **overrides: Any) -> tuple[Decoder, Tokenizer | None, ModelConfig]:
    """Load a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Gemma3ForCausalLM /
    Qwen3MoeForCausalLM / MixtralForCausalLM directory (config.json + safetensors), or the text decoder of a
    Gemma3ForConditionalGeneration one (google/gemma-3-4b, -12b, -27b; its vision tower is not read).

    The directory holds config.json, model.safetensors or model.safetensors.index.json (+ shards), and
    optionally tokenizer.json / tokenizer_config.json. `shardings` maps a parameter path
    ("blocks.attn.q_proj.kernel") to its Sharding, or is a Mesh (default device otherwise): each process reads
    only its devices' slices; `stats` (a LoadStats) counts the bytes read; `weights=False` reads only the config
    and tokenizer and returns the abstract model (ShapeDtypeStruct leaves: a resumed run restores its weights from
    its own checkpoint); `overrides` sets runtime config fields (`RUNTIME_FIELDS`). Returns (model, tokenizer or
    None when the directory has none, config).

    Raises:
      FileNotFoundError: missing directory, config.json or weights file.
      ValueError: bad config (see `config_from_hf`), truncated file, missing/unexpected tensor, shape mismatch.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}" if directory.is_dir()
                                else f"checkpoint directory not found: {directory}")
    hf_config = read_json_object(config_path)
    config = config_from_hf(hf_config, source=str(config_path), **overrides)
    tokenizer = Tokenizer.from_directory(directory) if (directory / "tokenizer.json").is_file() else None
    if not weights:
        return abstract_model(config), tokenizer, config
    files = _open_checkpoint(directory)
    _, prefix, skipped = MULTIMODAL.get(hf_config["architectures"][0], (None, "", ()))

    fused = _fused_expert_views(files, config)

    def read(name: str) -> np.ndarray:
        if prefix + name not in files and prefix + name in fused:
            source, index = fused[prefix + name]
            return files[source].get(source)[index]
        if prefix + name not in files:
            raise ValueError(f"{directory}: tensor {prefix + name!r} is missing from the checkpoint")
        return files[prefix + name].get(prefix + name)

    model, used = build_model(config, read, source=str(directory), shardings=shardings, stats=stats)
    ignorable = {prefix + "lm_head.weight"} if config.tie_embeddings else set()
    used = {prefix + u for u in used}
    used |= {fused[n][0] for n in used if n in fused}
    unexpected = sorted(n for n in set(files) - used - ignorable
                        if not n.endswith("rotary_emb.inv_freq") and not n.startswith(skipped))
    if unexpected:
        raise ValueError(f"{directory}: tensors not used by a {config.architecture} model with this config.json: "
                         f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    return model, tokenizer, config


_FUSED_EXPERTS = re.compile(r"^(?P<layer>.*\.)mlp\.(?:experts\.(?P<proj>gate_up_proj|down_proj)|gate\.weight)$")


def _fused_expert_views(files: Mapping[str, SafetensorsFile],
                        config: ModelConfig) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """{per-expert tensor name: (fused tensor name, its index)} for the fused form transformers 5 writes with
    `save_pretrained(save_original_format=False)`: mlp.experts.gate_up_proj [E, 2F, D] (gate rows, then up rows),
    mlp.experts.down_proj [E, D, F], and (Mixtral) the router as mlp.gate.weight; {} for a dense config."""
    if not config.moe:
        return {}
    family, (gate, up, down) = _MOE_NAMES[config.architecture]
    F = config.expert_intermediate_size
    views: dict[str, tuple[str, tuple[Any, ...]]] = {}
    for name in files:
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            continue
        layer, proj = match["layer"], match["proj"]
        if proj is None:
            views[f"{layer}{family}gate.weight"] = (name, ())
            continue
        parts = ((gate, slice(0, F)), (up, slice(F, 2 * F))) if proj == "gate_up_proj" else ((down, slice(None)),)
        for e in range(config.num_experts):
            views.update({f"{layer}{family}experts.{e}.{hf}.weight": (name, (e, rows)) for hf, rows in parts})
    return views


def _export_tensors(model: Decoder) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(HF name, HF shape, producer) per tensor, in leaf order. Producers run in that order and share a one-leaf
    host copy (one device→host transfer per leaf, at most one leaf on the host)."""
    config = model.config
    _, state = nnx.split(model)
    leaves = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    host: dict[str, np.ndarray] = {}

    def host_leaf(path: str) -> np.ndarray:
        if path not in host:
            host.clear()
            host[path] = np.asarray(leaves[path])
        return host[path]

    for path, name, transpose in hf_tensor_names(config):
        leaf = leaves[path]
        stacked = _stacked_keys(name)
        for at in np.ndindex(*leaf.shape[:len(stacked)]):
            keys = dict(zip(stacked, at))
            if "i" in keys:
                keys["i"] = hf_layer(config, path, keys["i"])
            tensor_name = name.format(**keys)

            def produce(path=path, at=at, transpose=transpose, tensor_name=tensor_name) -> np.ndarray:
                w = host_leaf(path)[at]
                w = w.T if transpose else w
                heads = rope_heads(tensor_name, config)
                return rope_rows_to_half(w, heads) if config.rope_interleaved and heads is not None else w

            shape = tuple(leaf.shape[len(stacked):])
            yield tensor_name, shape[::-1] if transpose else shape, produce


def export(model: Decoder, tokenizer: Tokenizer | None, directory: str | Path, *,
           max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Path:
    """Write `model` (+ tokenizer) as a Hugging Face directory, atomically.

    Writes config.json, float32 model.safetensors — or shards of at most `max_shard_bytes` (a bigger tensor
    gets a file of its own) plus model.safetensors.index.json — and the tokenizer files when `tokenizer` is
    given. All goes to a temporary sibling directory renamed into place at the end, so a crash never leaves a
    half-written checkpoint; an existing non-empty `directory` is replaced only with overwrite=True. Tensors
    stream from the device one leaf at a time; interleaved-RoPE models are written in the rotate-half order.
    Returns the directory path.

    Raises:
      FileExistsError: `directory` exists, is not empty, and overwrite is False.
      ValueError: the config has no Hugging Face equivalent, or max_shard_bytes <= 0.

    Example:
      >>> from logra_jax import models
      >>> model, tok, _ = models.load("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
      >>> models.export(model, tok, "/tmp/smollm2-hf")                     # doctest: +SKIP
    """
    directory = Path(directory)
    if max_shard_bytes <= 0:
        raise ValueError(f"export: max_shard_bytes must be > 0, got {max_shard_bytes}")
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"export: {directory} exists and is not empty (pass overwrite=True)")
    hf_config = config_to_hf(model.config, tokenizer)
    tensors = list(_export_tensors(model))
    shards, shard_bytes = [[]], 0
    for tensor in tensors:
        nbytes = math.prod(tensor[1]) * 4
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards, shard_bytes = [*shards, []], 0
        shards[-1].append(tensor)
        shard_bytes += nbytes

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        if len(shards) == 1:
            write_safetensors(tmp / "model.safetensors", shards[0])
        else:
            weight_map = {}
            for k, shard in enumerate(shards, 1):
                file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(tmp / file, shard)
                weight_map.update(dict.fromkeys((name for name, _, _ in shard), file))
            total = sum(math.prod(shape) * 4 for _, shape, _ in tensors)
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            directory.rename(old / directory.name)
            tmp.rename(directory)
            shutil.rmtree(old)
        else:
            tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
