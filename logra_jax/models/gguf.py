"""GGUF import (llama.cpp's format): dequantised weights, config and the embedded BPE tokenizer.

Reading: `read_gguf` parses the metadata and tensor table itself and memory-maps the data (gguf-py's GGUFReader
builds a numpy view per metadata element: seconds for a 49k-token vocabulary, where this takes a fraction of a
second). Each tensor is dequantised on its own (`gguf.quants.dequantize`, float32) when its first slice is due and
dropped when the next tensor starts, so loading holds one float32 tensor (and one device's shard being placed)
beyond the model itself (see `logra_jax.models.hf.build_model`). GGUF stores
a Linear weight as [out, in] like Hugging Face, so tensors are mapped to Hugging Face names and share the Hugging
Face filling path.

RoPE convention: llama.cpp's converter reorders the q/k rows of `llama` models for interleaved rotary pairs
(`rope_rows_to_interleaved`); `qwen2` and `qwen3` files keep the rotate-half order. By default the rows are brought
back to rotate-half (Hugging Face layout: export then writes correct Hugging Face weights); `rope_interleaved=True`
keeps or produces the interleaved layout and sets `ModelConfig.rope_interleaved` — the same function either way.

Tokenizer: `tokenizer.ggml.{tokens,merges,token_type,...}` rebuild a byte-level BPE with `tokenizers` alone; the
pre-tokenizer regex is not stored in the file but named by `tokenizer.ggml.pre`, mirrored from llama.cpp here.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import jax
import numpy as np
import tokenizers
from jax.sharding import Mesh

from logra_jax.models.config import FAMILY_FEATURES, ModelConfig
from logra_jax.models.decoder import Decoder, abstract_model
from logra_jax.models.hf import RUNTIME_FIELDS, LoadStats, build_model, rope_heads, rope_rows_to_half
from logra_jax.models.tokenizer import Tokenizer

# General architecture → (ModelConfig.architecture, whether llama.cpp stored q/k rows interleaved).
# (Gemma 3 is not read: llama.cpp keeps its layer pattern, local RoPE base and attention scale out of the file,
# and its SentencePiece vocabulary is not a byte-level BPE.)
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}

# Hugging Face per-layer suffix → GGUF per-layer suffix.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")}}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}

# llama.cpp pre-tokenizer names → the regexes it runs (src/llama-vocab.cpp), as `tokenizers` pre-tokenizers.
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"})
_GPT2_LIKE = frozenset({"gpt2", "gpt-2", "mpt", "olmo", "jais"})
_QWEN2_LIKE = frozenset({"qwen2", "stablelm2"})
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def hf_to_gguf_name(name: str) -> str:
    """The GGUF tensor name of a Hugging Face tensor name (model.layers.3.mlp.up_proj.weight → blk.3.ffn_up.weight)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"no GGUF name for tensor {name!r}")
    return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _f32(value: Any) -> float:
    """GGUF stores floats as float32: take the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


# GGUF metadata value types (gguf-py GGUFValueType): scalar type id → little-endian struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFTensor(NamedTuple):
    """A tensor of a GGUF file: storage type and its bytes as a memory-mapped uint8 view [*rows, row_bytes]."""

    name: str
    qtype: gguf.GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    """Reads GGUF's little-endian values from `data` at `pos`, moving past each."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise ValueError(f"string of {n} bytes at offset {self.pos} runs past the end")
        value = bytes(self.data[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return value

    def value(self, kind: int) -> Any:
        """A metadata value of type id `kind`: a scalar, a string or an array (numeric arrays read at once)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item].replace("?", "u1"))
                items = np.frombuffer(self.data, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return (items.astype(bool) if item == 7 else items).tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def _read_header(cursor: _Cursor) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
    """The metadata fields and the tensor table (name, dims, type id, offset) from the start of a GGUF file."""
    if bytes(cursor.data[:4]) != b"GGUF":
        raise ValueError(f"magic {bytes(cursor.data[:4])!r} is not b'GGUF'")
    version = cursor.take("<4xI")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_fields = cursor.take("<Q"), cursor.take("<Q")
    fields = {}
    for _ in range(n_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    return fields, infos


def _tensor(path: Path, data: np.ndarray, begin: int, name: str, dims: list[int], type_id: int) -> GGUFTensor:
    """The tensor `name` whose bytes start at `begin` of `data`, as a [*rows, row_bytes] view."""
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has unknown type id {type_id}") from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if not dims or dims[0] % block:
        raise ValueError(f"{path}: tensor {name!r} has dims {dims}; {qtype.name} needs at least one dimension "
                         f"with the first a multiple of {block}")
    row_bytes = dims[0] // block * type_size
    rows = tuple(reversed(dims[1:]))
    nbytes = row_bytes * int(np.prod(rows, dtype=np.int64))
    if begin + nbytes > len(data):
        raise ValueError(f"{path}: truncated: tensor {name!r} needs bytes {begin}..{begin + nbytes}, the file "
                         f"has {len(data)}")
    return GGUFTensor(name, qtype, data[begin:begin + nbytes].reshape(*rows, row_bytes))


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Metadata fields and tensors of a GGUF (version 2 or 3, little-endian) file; tensor bytes stay on disk.

    Raises:
      ValueError: not GGUF, unsupported version, corrupt or truncated header, unknown tensor type id, or a
        tensor whose bytes run past the end of the file — naming the file (and the tensor).
    """
    path = Path(path)
    if path.stat().st_size < 24:  # magic, version and the two counts
        raise ValueError(f"{path}: not a readable GGUF file ({path.stat().st_size} bytes)")
    cursor = _Cursor(np.memmap(path, np.uint8, mode="r"))
    try:
        fields, infos = _read_header(cursor)
    except (struct.error, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err})") from err
    alignment = fields.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0:
        raise ValueError(f"{path}: general.alignment={alignment!r} is not a positive integer")
    start = -(-cursor.pos // alignment) * alignment  # the data section begins at the next aligned offset
    return fields, {name: _tensor(path, cursor.data, start + offset, name, dims, type_id)
                    for name, dims, type_id, offset in infos}


def config_from_gguf(fields: Mapping[str, Any], tensor_names: set[str], *, source: str,
                     rope_interleaved: bool = False, **overrides: Any) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `.embedding_length`, ...) and the tensor list.

    Raises:
      ValueError: unknown architecture, unsupported rope scaling, missing or out-of-range field (file named).
    """
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: unsupported GGUF architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    bad_overrides = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if bad_overrides:
        raise ValueError(f"cannot override {bad_overrides} when loading {source}: only {RUNTIME_FIELDS}")

    def field(key: str, default: Any = ...) -> Any:
        value = fields.get(f"{arch}.{key}")
        if value is None:
            if default is ...:
                raise ValueError(f"{source}: missing GGUF field {arch}.{key!r}")
            return default
        return value

    scaling_type = field("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"{source}: rope scaling type {scaling_type!r} is not supported (none, linear)")
    heads, hidden = field("attention.head_count"), field("embedding_length")
    head_dim = field("attention.key_length", hidden // heads if heads else None)
    rope_dims = field("rope.dimension_count", None)
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"{source}: {arch}.rope.dimension_count={rope_dims} differs from head_dim={head_dim}; "
                         "only full rotary embeddings are supported")
    scaling = ({"rope_scaling": "linear", "rope_scaling_factor": _f32(field("rope.scaling.factor"))}
               if scaling_type == "linear" else {})
    tokens = fields.get("tokenizer.ggml.tokens")
    features = {**FAMILY_FEATURES[ARCHITECTURES[arch][0]], "qkv_bias": "blk.0.attn_q.bias" in tensor_names}
    try:
        config = ModelConfig(
            architecture=ARCHITECTURES[arch][0],
            vocab_size=field("vocab_size", len(tokens) if tokens is not None else None),
            hidden_size=hidden, intermediate_size=field("feed_forward_length"),
            num_layers=field("block_count"), num_heads=heads, num_kv_heads=field("attention.head_count_kv", heads),
            head_dim=head_dim,
            rope_theta=_f32(field("rope.freq_base", 10_000.0)), rope_interleaved=rope_interleaved,
            rms_norm_eps=_f32(field("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in tensor_names, max_seq_len=field("context_length", 2048),
            **features, **scaling)
        return config.replace(**overrides) if overrides else config
    except (ValueError, TypeError) as err:
        raise ValueError(f"{source}: {err}") from err


def tokenizer_from_gguf(fields: Mapping[str, Any], *, source: str = "GGUF") -> Tokenizer | None:
    """The byte-level BPE tokenizer described by GGUF `tokenizer.*` fields; None when the file has none.

    Control tokens (token_type 3) become special added tokens, user-defined ones (4) plain added tokens; the
    pre-tokenizer follows `tokenizer.ggml.pre` as llama.cpp does; bos/eos/pad ids, add_bos_token and
    tokenizer.chat_template carry over.

    Raises:
      ValueError: a tokenizer model other than "gpt2" (byte-level BPE) or an unknown pre-tokenizer name.
    """
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{source}: tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE)")
    pre = fields.get("tokenizer.ggml.pre", "gpt2")
    # ByteLevel(use_regex=True) splits with the GPT-2 regex; text outside its matches stays a piece of its own,
    # exactly as llama.cpp's regex splitter keeps unmatched spans.
    gpt2 = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        steps = [tokenizers.pre_tokenizers.Digits(individual_digits=True), gpt2]
    elif pre in _GPT2_LIKE:
        steps = [gpt2]
    elif pre in _QWEN2_LIKE:
        steps = [tokenizers.pre_tokenizers.Split(tokenizers.Regex(_QWEN2_REGEX), behavior="isolated"),
                 tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:
        raise ValueError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                         f"{sorted(_DIGIT_SPLIT | _GPT2_LIKE | _QWEN2_LIKE)}")
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre in _QWEN2_LIKE:
        backend.normalizer = tokenizers.normalizers.NFC()
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(steps)
    backend.decoder = tokenizers.decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type", [])
    backend.add_tokens([tokenizers.AddedToken(tokens[i], normalized=False)
                        for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED])
    backend.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _TOKEN_CONTROL])

    def token(key: str) -> str | None:
        index = fields.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    if token("eos") is None:
        raise ValueError(f"{source}: tokenizer.ggml.eos_token_id is missing")
    return Tokenizer(backend, eos=token("eos"), bos=token("bos"), pad=token("padding"),
                     chat_template=fields.get("tokenizer.chat_template"),
                     add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))


def load_gguf(path: str | Path, *, rope_interleaved: bool = False,
              shardings: Mapping[str, jax.sharding.Sharding] | Mesh | None = None, stats: LoadStats | None = None,
              weights: bool = True, **overrides: Any) -> tuple[Decoder, Tokenizer | None, ModelConfig]:
    """Load a GGUF file (architecture llama, qwen2 or qwen3), dequantised to float32, with its tokenizer.

    Args:
      path: the .gguf file.
      rope_interleaved: keep q/k rows in the interleaved RoPE order (ModelConfig.rope_interleaved=True) instead
        of converting them to Hugging Face's rotate-half order; both give the same logits.
      shardings: parameter path → Sharding for that leaf (default device otherwise). GGUF's quantisation
        blocks run along each row, so a tensor is dequantised whole (one tensor on the host at a time) and each
        process then places only its devices' slices: unlike safetensors, every process reads every tensor.
      stats: a LoadStats counting the bytes taken (of the dequantised float32 tensors).
      weights: False reads only the config and tokenizer and returns the abstract model (no tensor is read).
      **overrides: runtime config fields (dtype, remat, attention_impl, attention_chunk, max_seq_len).

    Returns:
      (model, tokenizer or None when the file has no tokenizer, config).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, unsupported architecture / tokenizer / quantisation type (tensor named),
        missing or unexpected tensor, shape mismatch, config field out of range.

    Example:
      >>> model, tok, config = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    fields, tensors = read_gguf(path)
    config = config_from_gguf(fields, set(tensors), source=str(path), rope_interleaved=rope_interleaved,
                              **overrides)
    if not weights:
        return abstract_model(config), tokenizer_from_gguf(fields, source=str(path)), config
    stored_interleaved = ARCHITECTURES[fields["general.architecture"]][1]
    last: dict[str, np.ndarray] = {}  # the one tensor dequantised at a time (its slices are read in a row)

    def read(name: str) -> np.ndarray:
        if name in last:
            return last[name]
        last.clear()
        last[name] = _dequantised(name)
        return last[name]

    def _dequantised(name: str) -> np.ndarray:
        gguf_name = hf_to_gguf_name(name)
        if gguf_name not in tensors:
            raise ValueError(f"{path}: tensor {gguf_name!r} is missing")
        tensor = tensors[gguf_name]
        try:  # every float and block-quantised type gguf-py implements; integer types and the rest raise
            w = gguf.quants.dequantize(tensor.data, tensor.qtype).astype(np.float32, copy=False)
        except NotImplementedError as err:
            raise ValueError(f"{path}: tensor {gguf_name!r} has type {tensor.qtype.name}, which gguf-py cannot "
                             f"dequantise ({err})") from err
        heads = rope_heads(name, config)
        # build_model reorders to interleaved itself when config.rope_interleaved; hand it rotate-half rows.
        return rope_rows_to_half(w, heads) if stored_interleaved and heads is not None else w

    model, used = build_model(config, read, source=str(path), shardings=shardings, stats=stats)
    unexpected = sorted(set(tensors) - {hf_to_gguf_name(n) for n in used})
    if unexpected:
        raise ValueError(f"{path}: tensors not used by a {config.architecture} model: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    return model, tokenizer_from_gguf(fields, source=str(path)), config

