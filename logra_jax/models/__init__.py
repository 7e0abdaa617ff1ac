"""Decoder models (Llama / Qwen2 / SmolLM2 / Qwen3 / Gemma 3 text), checkpoint import/export and tokenizers.

    >>> from logra_jax import models
    >>> model, tokenizer, config = models.load("path/to/hf_dir_or_file.gguf")     # doctest: +SKIP
    >>> models.export(model, tokenizer, "/tmp/exported")                          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from logra_jax.core.extras import requires_extra

with requires_extra("rl", "logra_jax.models"):
    from logra_jax.models.config import PRESETS, ModelConfig, preset
    from logra_jax.models.decoder import (
        Decoder,
        KVCache,
        abstract_model,
        init_model,
        init_sharded_model,
        parameter_shardings,
    )
    from logra_jax.models.gguf import load_gguf, tokenizer_from_gguf
    from logra_jax.models.hf import LoadStats, export, load_hf
    from logra_jax.models.tokenizer import Tokenizer, char_tokenizer

_GGUF_MAGIC = b"GGUF"


def load(path: str | Path, *, shardings: Mapping[str, jax.sharding.Sharding] | jax.sharding.Mesh | None = None,
         stats: LoadStats | None = None, weights: bool = True,
         **options: Any) -> tuple[Decoder, Tokenizer | None, ModelConfig]:
    """Load a checkpoint: a Hugging Face directory (Llama / Qwen2 / Qwen3 / Gemma 3 safetensors, or the text decoder
    of a Gemma 3 multimodal one) or a GGUF file (llama / qwen2 / qwen3).

    Args:
      path: a directory with config.json + model.safetensors (or a sharded index), or a .gguf file.
      shardings: parameter path ("blocks.mlp.up_proj.kernel") → Sharding of that leaf, or a Mesh (the logical-axis
        rules' shardings on it); default device otherwise. Each process reads only its own devices' slices of a
        safetensors checkpoint (a GGUF tensor is dequantised whole, one at a time: its blocks run along rows).
      stats: a LoadStats to count the bytes read.
      weights: False: only the config and tokenizer are read; the model is abstract (ShapeDtypeStruct leaves).
      **options: runtime config fields (dtype, remat, attention_impl, attention_chunk, max_seq_len) and, for GGUF,
        rope_interleaved (see `load_gguf`).

    Returns:
      (model, tokenizer — None when the checkpoint carries none — , config).

    Raises:
      FileNotFoundError: `path` does not exist, or a directory lacks config.json / weights.
      ValueError: a file that is neither a directory nor GGUF, or any checkpoint error (see `load_hf`,
        `load_gguf`): the message names the file and the culprit.

    Example:
      >>> model, tok, config = load("SmolLM2-135M-Instruct.Q4_1.gguf", dtype="bfloat16")  # doctest: +SKIP
    """
    path = Path(path)
    if path.is_dir():
        return load_hf(path, shardings=shardings, stats=stats, weights=weights, **options)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {magic!r}) nor a Hugging Face directory")
    return load_gguf(path, shardings=shardings, stats=stats, weights=weights, **options)


__all__ = ["PRESETS", "Decoder", "KVCache", "LoadStats", "ModelConfig", "Tokenizer", "abstract_model",
           "char_tokenizer", "export", "init_model", "init_sharded_model", "load", "load_gguf", "load_hf",
           "parameter_shardings", "preset", "tokenizer_from_gguf"]
