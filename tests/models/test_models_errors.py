"""Bad Hugging Face checkpoints get errors naming the file and the culprit; the safetensors reader agrees with
the `safetensors` package on every dtype it accepts."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from logra_jax import models
from logra_jax.models.hf import SafetensorsFile


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
