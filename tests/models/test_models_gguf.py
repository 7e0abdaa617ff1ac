"""GGUF import: tiny GGUF files written the way llama.cpp's converter writes them (gguf-py's name map, q/k rows
permuted for llama, block-quantised tensors) load to logits equal transformers' on the same (dequantised)
weights, in both RoPE conventions; bad files get errors naming the culprit."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from logra_jax import models
from logra_jax.models.decoder import init_model
from logra_jax.models.gguf import read_gguf

# torch is imported where it is used, and this module runs on the one worker that imports it (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")

Q = gguf.GGMLQuantizationType


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows → interleaved rows, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, peer, arch: str, *, qtypes=None, skip=(), extra_tensors=None, fields=None):
    """Write `peer` as llama.cpp would; `peer`'s weights become the dequantised stored values (the reference)."""
    import torch

    qtypes = qtypes or {}
    c = peer.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    for key, value in (fields or {}).items():
        sub_type = gguf.GGUFValueType.get_type(value[0]) if isinstance(value, list) else None
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value), sub_type=sub_type)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    with torch.no_grad():
        for name, param in peer.named_parameters():
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name in skip:
                continue
            w = param.numpy().astype(np.float32)
            heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(name.split(".")[-2])
            stored = converter_permute(w, heads) if arch == "llama" and heads else w
            qtype = qtypes.get(gguf_name.split(".")[-2], Q.F32) if w.ndim == 2 else Q.F32
            if qtype == Q.F32:
                writer.add_tensor(gguf_name, stored)
            elif qtype == Q.F16:
                writer.add_tensor(gguf_name, stored.astype(np.float16))
                param.copy_(torch.tensor(w.astype(np.float16).astype(np.float32)))
            else:
                writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
                # Block quantisation works within rows, so it commutes with the row permutation.
                param.copy_(torch.tensor(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)))
    for gguf_name, (array, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MIXED = {"token_embd": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.F16, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0,
         "ffn_gate": Q.Q4_0, "ffn_up": Q.Q5_1, "ffn_down": Q.Q8_0, "output": Q.Q8_0}


@pytest.mark.parametrize("arch,overrides,qtypes", [
    ("llama", dict(tie_word_embeddings=False), MIXED),
    ("qwen2", dict(tie_word_embeddings=True), {}),
    ("qwen3", dict(tie_word_embeddings=False, head_dim=32), {"attn_q": Q.Q8_0, "ffn_up": Q.Q4_1}),
], ids=["llama-untied-quantised", "qwen2-tied-bias-f32", "qwen3-untied-qk-norm-quantised"])
def test_gguf_logits_match_transformers_in_both_rope_conventions(
        arch, overrides, qtypes, tmp_path, hf_model, hf_logits, forward, padded_batch, max_rel_err):
    peer = hf_model(arch, **overrides)
    path = write_gguf(tmp_path / "tiny.gguf", peer, arch, qtypes=qtypes)
    tokens, mask = padded_batch
    reference = hf_logits(peer, tokens, mask)

    half, tokenizer, config = models.load(path)
    assert tokenizer is None
    assert not config.rope_interleaved and config.tie_embeddings == overrides["tie_word_embeddings"]
    assert max_rel_err(forward(half, tokens, mask), reference, where=mask) <= 1e-4

    interleaved, _, config_i = models.load(path, rope_interleaved=True)
    assert config_i.rope_interleaved
    assert max_rel_err(forward(interleaved, tokens, mask), reference, where=mask) <= 1e-4

    # Export writes rotate-half Hugging Face weights whichever convention the model holds.
    models.export(interleaved, None, tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert max_rel_err(hf_logits(exported, tokens, mask), reference, where=mask) <= 1e-4


def test_read_gguf_agrees_with_gguf_py_reader(tmp_path, hf_model):
    fields = {"tokenizer.ggml.tokens": ["<s>", "a b", "ü"], "tokenizer.ggml.token_type": [3, 1, 1],
              "general.flag": True, "general.scores": [0.5, -1.25]}
    path = write_gguf(tmp_path / "t.gguf", hf_model("llama"), "llama", qtypes=MIXED, fields=fields)
    ours, tensors = read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")} == ours
    assert ours["tokenizer.ggml.tokens"] == fields["tokenizer.ggml.tokens"]
    assert {t.name for t in reader.tensors} == set(tensors)
    for t in reader.tensors:
        assert tensors[t.name].qtype == t.tensor_type
        np.testing.assert_array_equal(gguf.quants.dequantize(tensors[t.name].data, tensors[t.name].qtype),
                                      gguf.quants.dequantize(t.data, t.tensor_type))


def test_interleaved_rope_with_permuted_qk_equals_rotate_half(padded_batch, forward):
    config = models.preset("tiny", num_heads=4, num_kv_heads=2)
    model = init_model(config, seed=1)
    permuted = init_model(config.replace(rope_interleaved=True), seed=1)
    rng = np.random.default_rng(1)
    for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
        # Large q/k weights so that attention (and with it RoPE) shapes the logits.
        kernel = 0.3 * rng.standard_normal(getattr(model.blocks.attn, proj).kernel.shape).astype(np.float32)
        getattr(model.blocks.attn, proj).kernel[...] = jnp.asarray(kernel)
        # kernel [L, in, out]: the converter permutes rows of Wᵀ, i.e. the out axis.
        rows = np.stack([converter_permute(k.T, heads).T for k in kernel])
        getattr(permuted.blocks.attn, proj).kernel[...] = jnp.asarray(rows)
    tokens, mask = padded_batch
    ours = forward(model, tokens, mask)
    assert np.abs(forward(permuted, tokens, mask) - ours)[mask].max() <= 1e-5
    # The permutation matters: rotate-half applied to the permuted rows is a different model.
    wrong = nnx.merge(nnx.graphdef(model), nnx.state(permuted))
    assert np.abs(forward(wrong, tokens, mask) - ours)[mask].max() > 10 * 1e-5


def _tiny_gguf(tmp_path, hf_model, **kwargs):
    return write_gguf(tmp_path / "bad.gguf", hf_model("llama"), "llama", **kwargs)


def test_unsupported_quantisation_type_names_tensor_and_type(tmp_path, hf_model):
    raw = np.zeros((32, 2 * 40), np.uint8)  # Q8_1: 32-element blocks of 40 bytes (an intermediate llama.cpp type)
    path = _tiny_gguf(tmp_path, hf_model, skip={"blk.1.attn_k.weight"},
                      extra_tensors={"blk.1.attn_k.weight": (raw, Q.Q8_1)})
    with pytest.raises(ValueError, match=r"blk\.1\.attn_k\.weight.*Q8_1"):
        models.load(path)


def test_unknown_gguf_architecture(tmp_path, hf_model):
    peer = hf_model("llama")
    path = write_gguf(tmp_path / "gpt2.gguf", peer, "llama")
    data = path.read_bytes().replace(b"llama", b"gpt2\0", 1)  # general.architecture value, same length
    (tmp_path / "other.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=r"other\.gguf.*architecture 'gpt2\\x00'"):
        models.load(tmp_path / "other.gguf")


def test_gguf_missing_and_unexpected_tensors(tmp_path, hf_model):
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*missing"):
        models.load(_tiny_gguf(tmp_path, hf_model, skip={"blk.0.ffn_up.weight"}))
    path = write_gguf(tmp_path / "extra.gguf", hf_model("llama"), "llama",
                      extra_tensors={"rope_freqs.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(ValueError, match=r"extra\.gguf.*rope_freqs\.weight"):
        models.load(path)


@pytest.mark.parametrize("fields,pattern", [
    ({"llama.attention.layer_norm_rms_epsilon": 2.0}, r"bad\.gguf: .*rms_norm_eps.*2\.0"),
    ({"llama.rope.dimension_count": 8}, r"bad\.gguf: llama\.rope\.dimension_count=8 differs from head_dim=16"),
    ({"llama.rope.scaling.type": "yarn"}, r"bad\.gguf: rope scaling type 'yarn'"),
])
def test_gguf_config_field_out_of_range_names_file_and_field(tmp_path, hf_model, fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        models.load(_tiny_gguf(tmp_path, hf_model, fields=fields))


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"weights\.bin.*not a GGUF"):
        models.load(tmp_path / "weights.bin")
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little")
    for cut in (header[:8], header + b"\x10\x00"):  # too short for a header; ends inside the first key
        (tmp_path / "cut.gguf").write_bytes(cut)
        with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF"):
            models.load(tmp_path / "cut.gguf")
