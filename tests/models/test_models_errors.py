"""Bad Hugging Face checkpoints get errors naming the file and the culprit; the safetensors reader agrees with
the `safetensors` package on every dtype it accepts."""

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import transformers
from safetensors.numpy import save_file as save_numpy

from logra_jax import models
from logra_jax.models.gguf import read_gguf
from logra_jax.models.hf import SafetensorsFile

# torch is imported where it is used, and this module runs on the one worker that imports it (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A valid tiny Llama checkpoint written by transformers (each test edits a copy)."""
    directory = tmp_path_factory.mktemp("pristine")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture
def checkpoint(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ckpt")


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_missing_paths(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        models.load(tmp_path / "nowhere")
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*ckpt"):
        models.load(checkpoint)


def test_missing_weights_file(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        models.load(checkpoint)


def test_truncated_safetensors_header_and_data(checkpoint):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: tensor '.+' ends at data byte"):
        models.load(checkpoint)
    weights.write_bytes(data[:40])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors header"):
        models.load(checkpoint)
    weights.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors file"):
        models.load(checkpoint)


def test_tensor_shape_mismatch_names_tensor_and_shapes(checkpoint):
    _edit_config(checkpoint, intermediate_size=64)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight' has shape "
                                         r"\((48, 32|32, 48)\), expected \((64, 32|32, 64)\)"):
        models.load(checkpoint)


def test_unknown_architecture_names_it_and_the_file(checkpoint):
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        models.load(checkpoint)


@pytest.mark.parametrize("changes,pattern", [
    ({"rms_norm_eps": 2.0}, r"config\.json: ModelConfig\.rms_norm_eps must be in \(0, 1\), got 2\.0"),
    ({"num_hidden_layers": 0}, r"config\.json: .*num_layers.*got 0 \(config\.json field 'num_hidden_layers'\)"),
    ({"num_key_value_heads": 3}, r"config\.json: .*num_kv_heads \(3\).*'num_key_value_heads'"),
    ({"hidden_size": None}, r"config\.json: missing field 'hidden_size'"),
    ({"hidden_act": "gelu"}, r"config\.json: hidden_act='gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"config\.json: rope type 'yarn'"),
    ({"attention_bias": True}, r"config\.json: attention_bias=true"),
])
def test_config_field_out_of_range_or_unsupported(checkpoint, changes, pattern):
    _edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=pattern):
        models.load(checkpoint)


def test_missing_and_unexpected_tensors(checkpoint):
    weights = checkpoint / "model.safetensors"
    st = SafetensorsFile(weights)
    tensors = {name: np.array(st.get(name)) for name in st.names()}
    del st
    save_numpy({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, weights)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        models.load(checkpoint)
    save_numpy({**tensors, "model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}, weights)
    with pytest.raises(ValueError, match=r"not used .*model\.layers\.0\.mlp\.extra\.weight"):
        models.load(checkpoint)


def test_index_pointing_at_the_wrong_shard(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "part-1.safetensors")
    weight_map = {"model.norm.weight": "part-1.safetensors", "model.embed_tokens.weight": "part-2.safetensors"}
    save_numpy({"unrelated": np.zeros(2, np.float32)}, checkpoint / "part-2.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' is mapped to part-2\.safetensors"):
        models.load(checkpoint)


def test_runtime_overrides_only(checkpoint):
    _, _, config = models.load(checkpoint, dtype="bfloat16", remat="full", max_seq_len=64)
    assert (config.dtype, config.remat, config.max_seq_len) == ("bfloat16", "full", 64)
    with pytest.raises(ValueError, match=r"cannot override \['hidden_size'\]"):
        models.load(checkpoint, hidden_size=8)


def test_safetensors_reader_agrees_with_the_safetensors_package(tmp_path):
    import torch
    from safetensors.torch import save_file as save_torch

    generator = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(3, 5, generator=generator).bfloat16(),
               "f16": torch.randn(7, generator=generator).half(), "f32": torch.randn(2, 2, 2, generator=generator),
               "empty": torch.zeros(0, 4)}
    save_torch(tensors, tmp_path / "x.safetensors")
    ours = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(ours.names()) == sorted(tensors)
    np.testing.assert_array_equal(ours.get("bf16").astype(np.float32), tensors["bf16"].float().numpy())
    assert ours.get("bf16").dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(ours.get("f16"), tensors["f16"].numpy())
    np.testing.assert_array_equal(ours.get("f32"), tensors["f32"].numpy())
    assert ours.get("empty").shape == (0, 4)
    save_torch({"i": torch.arange(4)}, tmp_path / "int.safetensors")
    with pytest.raises(ValueError, match=r"int\.safetensors: tensor 'i' has dtype I64"):
        SafetensorsFile(tmp_path / "int.safetensors")


def _write_safetensors(path, header, data=b""):
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize(("header", "pattern"), [
    ([1, 2], r"x\.safetensors: corrupt safetensors header \(a JSON list"),
    ({"w": {"shape": [1], "data_offsets": [0, 4]}}, r"x\.safetensors: tensor 'w': header entry lacks 'dtype'"),
    ({"w": {"dtype": "F32"}}, r"x\.safetensors: tensor 'w': header entry lacks 'shape', 'data_offsets'"),
    ({"w": 7}, r"x\.safetensors: tensor 'w': header entry 7 is not an object"),
    ({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, r"x\.safetensors: tensor 'w' has dtype \["),
    ({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, r"tensor 'w': shape '1' is not a list"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, r"tensor 'w': shape \[-1\] is not a list"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, r"tensor 'w': data_offsets \[-4, 0\] is not"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, r"tensor 'w': data_offsets \[0, 4, 8\]"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}, r"tensor 'w': data_offsets \['0', '4'\]"),
])
def test_garbled_safetensors_header_names_file_tensor_and_field(tmp_path, header, pattern):
    _write_safetensors(tmp_path / "x.safetensors", header, bytes(8))
    with pytest.raises(ValueError, match=pattern):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_garbled_weights_of_a_checkpoint_name_the_file(checkpoint):
    _write_safetensors(checkpoint / "model.safetensors", {"model.norm.weight": {"dtype": "F32", "shape": [32]}})
    with pytest.raises(ValueError, match=r"ckpt/model\.safetensors: tensor 'model\.norm\.weight': header entry "
                                         r"lacks 'data_offsets'"):
        models.load(checkpoint)


@pytest.mark.parametrize(("text", "pattern"), [
    ('{"architectures": ["LlamaForCausalLM"],\n "vocab_size": 64,,}',
     r"ckpt/config\.json: not valid JSON: Expecting property name enclosed in double quotes at line 2, column 19"),
    ("", r"ckpt/config\.json: not valid JSON: Expecting value at line 1, column 1"),
    ('["LlamaForCausalLM"]', r"ckpt/config\.json: expected a JSON object, got an array"),
])
def test_config_json_that_is_not_a_json_object_names_file_line_and_column(checkpoint, text, pattern):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(ValueError, match=pattern):
        models.load(checkpoint)


def test_config_json_that_is_not_utf8_names_the_file(checkpoint):
    (checkpoint / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
    with pytest.raises(ValueError, match=r"ckpt/config\.json: not UTF-8 text \(byte 16"):
        models.load(checkpoint)


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"architectures": None}, r"config\.json: missing field 'architectures' \(one of \[.*'LlamaForCausalLM'"),
    ({"architectures": "LlamaForCausalLM"}, r"config\.json: unsupported architecture 'LlamaForCausalLM'"),
    ({"architectures": [["LlamaForCausalLM"]]}, r"config\.json: unsupported architecture \[\['LlamaForCausalLM"),
    ({"rope_parameters": "linear"}, r"config\.json: field 'rope_parameters' is 'linear', not an object"),
])
def test_config_json_missing_or_mistyped_field_is_named(checkpoint, changes, pattern):
    _edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=pattern):
        models.load(checkpoint)


@pytest.mark.parametrize(("text", "pattern"), [
    ("{", r"model\.safetensors\.index\.json: not valid JSON: Expecting property name .* at line 1, column 2"),
    ('{"metadata": {}}', r"model\.safetensors\.index\.json: field 'weight_map' is None, not an object"),
    ('{"weight_map": {"model.norm.weight": 3}}', r"index\.json: weight_map\['model\.norm\.weight'\] is 3, not a shard"),
])
def test_garbled_shard_index_names_the_file_and_field(checkpoint, text, pattern):
    (checkpoint / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=pattern):
        models.load(checkpoint)


def test_garbled_tokenizer_files_are_named(checkpoint):
    models.char_tokenizer().save(checkpoint)
    (checkpoint / "tokenizer_config.json").write_text("{'eos_token': '<eos>'}")
    with pytest.raises(ValueError, match=r"ckpt/tokenizer_config\.json: not valid JSON: .* line 1, column 2"):
        models.load(checkpoint)
    (checkpoint / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match=r"ckpt/tokenizer\.json: not a readable tokenizer\.json"):
        models.load(checkpoint)


def _write_gguf(path, fields=b"", n_fields=0, dims=(4,)):
    """A GGUF v3 file by hand: `fields` (raw key/value bytes) and one F32 tensor 'w' of `dims`, zero-filled."""
    def string(s):
        return struct.pack("<Q", len(s)) + s.encode()

    info = string("w") + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, n_fields) + fields + info
    path.write_bytes(head + bytes(-len(head) % 32 + 64))


def test_garbled_gguf_tensor_info_and_alignment_are_named(tmp_path):
    _write_gguf(tmp_path / "nodims.gguf", dims=())
    with pytest.raises(ValueError, match=r"nodims\.gguf: tensor 'w' has dims \[\]; F32 needs at least one"):
        read_gguf(tmp_path / "nodims.gguf")
    alignment = struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<II", 4, 0)  # uint32 0
    _write_gguf(tmp_path / "align.gguf", alignment, n_fields=1)
    with pytest.raises(ValueError, match=r"align\.gguf: general\.alignment=0 is not a positive integer"):
        read_gguf(tmp_path / "align.gguf")
