"""Hugging Face checkpoints: logits equal transformers' (PyTorch CPU, fp32) on the same random weights, and
load → export → load is bit-exact and readable by transformers."""

import json
import weakref

import jax
import numpy as np
import pytest
import transformers
from flax import nnx

from logra_jax import models
from logra_jax.models.hf import build_model

# torch is imported where it is used, and this module runs on the one worker that imports it (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")

CASES = {
    "llama-gqa-untied-llama3": ("llama", dict(
        tie_word_embeddings=False, rope_theta=500_000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})),
    "llama-mha-tied-linear": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-gqa-tied-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-gqa-untied-bias": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1_000_000.0)),
}



@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path, hf_model, hf_logits, forward, padded_batch, max_rel_err):
    arch, overrides = CASES[case]
    sharded = case == "qwen2-gqa-untied-bias"
    peer = hf_model(arch, **overrides)
    peer.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded

    model, tokenizer, config = models.load(tmp_path)
    assert tokenizer is None
    assert config.qkv_bias == (arch == "qwen2")
    assert config.tie_embeddings == overrides["tie_word_embeddings"]
    tokens, mask = padded_batch
    assert max_rel_err(forward(model, tokens), hf_logits(peer, tokens)) <= 1e-4
    padded_err = max_rel_err(forward(model, tokens, mask), hf_logits(peer, tokens, mask), where=mask)
    assert padded_err <= 1e-4


def test_bfloat16_checkpoint_loads_exactly(tmp_path, hf_model):
    import torch

    peer = hf_model("qwen2").to(torch.bfloat16)
    peer.save_pretrained(tmp_path)
    model, _, _ = models.load(tmp_path)
    reference = peer.model.layers[1].self_attn.k_proj
    np.testing.assert_array_equal(np.asarray(model.blocks.attn.k_proj.kernel[1]),
                                  reference.weight.detach().float().numpy().T)
    np.testing.assert_array_equal(np.asarray(model.blocks.attn.k_proj.bias[1]), reference.bias.detach().float().numpy())


@pytest.mark.parametrize("case", ["llama-gqa-untied-llama3", "qwen2-gqa-tied-bias"])
def test_export_round_trip_is_bit_exact_and_transformers_reads_it(case, tmp_path, hf_model, hf_logits, forward,
                                                                  padded_batch, max_rel_err):
    arch, overrides = CASES[case]
    hf_model(arch, **overrides).save_pretrained(tmp_path / "source")
    model, _, config = models.load(tmp_path / "source")
    # A small shard limit exercises the sharded index on the way out as well.
    models.export(model, models.char_tokenizer(), tmp_path / "exported", max_shard_bytes=64 * 1024)
    assert (tmp_path / "exported" / "model.safetensors.index.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left

    again, tokenizer, config_again = models.load(tmp_path / "exported")
    assert config_again == config
    assert tokenizer.encode("12+7=19") == models.char_tokenizer().encode("12+7=19")
    leaves = nnx.to_flat_state(nnx.state(model))
    leaves_again = dict(nnx.to_flat_state(nnx.state(again)))
    for path, variable in leaves:
        np.testing.assert_array_equal(np.asarray(variable.get_value()),
                                      np.asarray(leaves_again[path].get_value()), err_msg=str(path))

    peer = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager")
    assert type(peer).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    tokens, mask = padded_batch
    assert max_rel_err(forward(model, tokens, mask), hf_logits(peer, tokens, mask), where=mask) <= 1e-4


def test_export_single_file_matches_safetensors_reader(tmp_path):
    from safetensors.torch import load_file

    config = models.preset("tiny", tie_embeddings=False)
    model = models.init_model(config, seed=3)
    models.export(model, None, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")  # the reference reader
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.down_proj.weight"].numpy(),
                                  np.asarray(model.blocks.mlp.down_proj.kernel[1]).T)
    np.testing.assert_array_equal(tensors["lm_head.weight"].numpy(), np.asarray(model.lm_head.kernel[...]).T)
    assert len(tensors) == 3 + 9 * config.num_layers


def test_export_refuses_a_non_empty_directory_unless_overwrite(tmp_path):
    model = models.init_model(models.preset("tiny"), seed=0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        models.export(model, None, tmp_path / "out")
    models.export(model, None, tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_sharded_load_places_leaves_on_requested_shardings(tmp_path, hf_model):
    hf_model("llama").save_pretrained(tmp_path)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "fsdp"))
    model, _, _ = models.load(tmp_path, shardings={"blocks.mlp.up_proj.kernel": spec})
    reference, _, _ = models.load(tmp_path)
    assert model.blocks.mlp.up_proj.kernel[...].sharding == spec
    np.testing.assert_array_equal(np.asarray(model.blocks.mlp.up_proj.kernel[...]),
                                  np.asarray(reference.blocks.mlp.up_proj.kernel[...]))


def test_build_model_reads_one_tensor_at_a_time():
    """The loader never accumulates checkpoint tensors: each one read is released before the next is read."""
    config = models.preset("tiny", qkv_bias=True, tie_embeddings=False)
    rng = np.random.default_rng(0)
    alive: list[weakref.ref] = []
    most_alive = 0

    def read(name: str) -> np.ndarray:
        nonlocal most_alive
        most_alive = max(most_alive, sum(r() is not None for r in alive))
        w = rng.standard_normal(_hf_shape(name, config)).astype(np.float32)
        alive.append(weakref.ref(w))
        return w

    _, used = build_model(config, read, source="test")
    assert len(used) == 3 + 12 * config.num_layers
    assert most_alive == 0


def _hf_shape(name: str, c) -> tuple[int, ...]:
    outs = {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size, "o_proj": c.hidden_size,
            "gate_proj": c.intermediate_size, "up_proj": c.intermediate_size, "down_proj": c.hidden_size}
    ins = {"o_proj": c.q_size, "down_proj": c.intermediate_size}
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (c.vocab_size, c.hidden_size)
    module = name.split(".")[-2]
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return (c.hidden_size,)
    if name.endswith(".bias"):
        return (outs[module],)
    return (outs[module], ins.get(module, c.hidden_size))
