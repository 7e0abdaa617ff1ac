"""Qwen3 and Gemma 3 (text) against transformers' Qwen3ForCausalLM / Gemma3ForCausalLM (PyTorch CPU, fp32) on the
same random weights: logits of padded batches longer than the sliding window (dense and chunked attention),
KV-cache decoding equal to the full forward, sharded (fsdp 8; fsdp 4 × tensor 2 on 8 fake devices) equal to
unsharded, export → load bit-exact and read back by transformers; the config mapping's errors name the field."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from logra_jax import models
from logra_jax.models.hf import config_from_hf, config_to_hf
from logra_jax.optim.targets import find_targets
from logra_jax.parallel import sharding as shd

# torch is imported where it is used, and this module runs on the one worker that imports it (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")

_S, _F = "sliding_attention", "full_attention"
CASES = {
    # head_dim independent of hidden / heads: 4 heads × 32 = 128 on a hidden size of 64.
    "qwen3-untied-wide-heads": ("qwen3", dict(tie_word_embeddings=False, head_dim=32, rope_theta=1_000_000.0)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    # Window 5 on 20-token sequences; layers slide, full, slide, full; the global layers' RoPE linearly scaled.
    "gemma3": ("gemma3", dict(
        num_hidden_layers=4, layer_types=[_S, _F, _S, _F], sliding_window=5, query_pre_attn_scalar=24,
        rope_parameters={_F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         _S: {"rope_type": "default", "rope_theta": 10_000.0}})),
}
FAMILY_CASES = ["qwen3-untied-wide-heads", "gemma3"]
MESHES = {"fsdp8": shd.MeshConfig(fsdp=8), "fsdp4_tensor2": shd.MeshConfig(fsdp=4, tensor=2)}


@pytest.mark.parametrize("attention", ["dense", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, attention, checkpoint, hf_logits, forward, padded_batch, max_rel_err):
    peer, directory = checkpoint(case)
    model, _, config = models.load(directory, attention_impl=attention, attention_chunk=8)
    assert config.architecture == CASES[case][0]
    assert config.qk_norm and config.tie_embeddings == peer.config.tie_word_embeddings
    if config.architecture == "gemma3":
        assert config.sliding_layers() == (True, False, True, False)
        assert (config.sliding_window, config.rope_local_theta, config.rope_scaling) == (5, 10_000.0, "linear")
    tokens, mask = padded_batch
    assert tokens.shape[1] > (config.sliding_window or 0)
    assert max_rel_err(forward(model, tokens), hf_logits(peer, tokens)) <= 1e-4
    padded_err = max_rel_err(forward(model, tokens, mask), hf_logits(peer, tokens, mask), where=mask)
    assert padded_err <= 1e-4


@functools.partial(jax.jit, static_argnums=0)
def _cached_step(graphdef, state, tokens, cache, mask):
    return nnx.merge(graphdef, state).forward_cached(tokens, cache, attention_mask=mask)


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_kv_cache_decode_equals_full_forward(case, checkpoint, forward, max_rel_err):
    """Prefill 8 tokens (row 1 left-padded, row 2 right-padded), then decode 12 one at a time, past the window:
    every logit equals the full forward's over the same real tokens."""
    model, _, _ = models.load(checkpoint(case)[1])
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 128, (3, 20)).astype(np.int32)
    mask = np.ones((3, 20), bool)
    mask[1, :3] = False
    mask[2, 6:8] = False
    graphdef, state = nnx.split(model)
    cache = model.init_cache(3, 20)
    logits, cache = _cached_step(graphdef, state, jnp.asarray(tokens[:, :8]), cache, jnp.asarray(mask[:, :8]))
    steps = [np.asarray(logits)]
    for t in range(8, 20):
        logits, cache = _cached_step(graphdef, state, jnp.asarray(tokens[:, t:t + 1]), cache,
                                     jnp.asarray(mask[:, t:t + 1]))
        steps.append(np.asarray(logits))
    cached = np.concatenate(steps, axis=1)
    assert max_rel_err(cached, forward(model, tokens, mask), where=mask) <= 1e-5


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_sharded_equals_unsharded(case, checkpoint, sharded_errors):
    errors = sharded_errors(checkpoint(case)[1], MESHES)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_export_round_trip_is_bit_exact_and_transformers_reads_it(case, checkpoint, tmp_path, hf_logits, forward,
                                                                  padded_batch, max_rel_err):
    model, _, config = models.load(checkpoint(case)[1])
    models.export(model, models.char_tokenizer(), tmp_path / "exported")
    again, _, config_again = models.load(tmp_path / "exported")
    assert config_again == config
    leaves_again = dict(nnx.to_flat_state(nnx.state(again)))
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_array_equal(np.asarray(variable.get_value()),
                                      np.asarray(leaves_again[path].get_value()), err_msg=str(path))
    peer = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager")
    assert type(peer).__name__ == {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[config.architecture]
    tokens, mask = padded_batch
    assert max_rel_err(forward(model, tokens, mask), hf_logits(peer, tokens, mask), where=mask) <= 1e-4


@pytest.mark.parametrize("name", [n for n in models.PRESETS if n.startswith(("qwen2.5-", "qwen3-", "gemma3-"))])
def test_presets_map_to_transformers_with_the_same_parameter_count(name):
    """Each preset's config.json builds the transformers class (on the meta device: no memory) with exactly the
    parameters our decoder has, and reads back to the same preset."""
    import torch

    config = models.preset(name)
    hf = config_to_hf(config)
    assert config_from_hf(hf) == config
    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                             "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
                             "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[
                                 config.architecture]
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        peer = model_cls(config_cls(**fields))
    assert sum(p.numel() for p in peer.parameters()) == config.num_params()
    if config.architecture == "gemma3":
        assert peer.config.layer_types == [_S if s else _F for s in config.sliding_layers()]


def test_qwen2_5_72b_has_its_model_cards_parameter_counts():
    # Qwen/Qwen2.5-72B's model card: 72.7B parameters (its shapes against transformers: the test above)
    assert round(models.preset("qwen2.5-72b").num_params() / 1e9, 1) == 72.7


BASE = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("edit, match", [
    ({"final_logit_softcapping": 30.0}, r"x\.json: final_logit_softcapping=30\.0 is not supported"),
    ({"hidden_activation": "gelu"}, r"x\.json: hidden_activation='gelu' is not supported"),
    ({"layer_types": [_S, _F, _F, _S]}, r"x\.json: layer_types .* does not repeat"),
    ({"layer_types": [_S, _F]}, r"x\.json: layer_types must list 4 entries"),
    ({"rope_parameters": {_S: {"rope_type": "linear", "factor": 2.0}, _F: {}}},
     r"x\.json: rope_parameters\.sliding_attention\.rope_type='linear' is not supported"),
    ({"sliding_window": 0}, r"x\.json: ModelConfig\.sliding_window must be a positive integer, got 0"),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
     r"x\.json: attention_bias=true .* not supported for qwen3"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True},
     r"x\.json: use_sliding_window=true is not supported for qwen3"),
])
def test_config_errors_name_the_field(edit, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**BASE, **edit}, source="x.json")


def test_gemma3_config_reads_transformers_4_fields():
    """transformers 4.x wrote Gemma 3's RoPE as rope_theta + rope_local_base_freq + rope_scaling and its layer
    pattern as sliding_window_pattern."""
    config = config_from_hf({**BASE, "rope_theta": 500_000.0, "rope_local_base_freq": 20_000.0,
                             "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window": 7,
                             "sliding_window_pattern": 2})
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling_factor) == (500_000.0, 20_000.0, 4.0)
    assert config.sliding_layers() == (True, False, True, False) and config.sliding_window == 7
    assert config.query_pre_attn_scalar == 256 and config.head_dim == 16 and config.tie_embeddings


def test_export_rejects_a_config_off_its_family():
    with pytest.raises(ValueError, match=r"architecture='qwen3' with post_norms=True has no Hugging Face"):
        config_to_hf(models.preset("qwen3-0.6b", post_norms=True))
    with pytest.raises(ValueError, match=r"sliding_window=8 has no Hugging Face equivalent for architecture='llama'"):
        config_to_hf(models.preset("tiny", sliding_window=8))


@pytest.mark.parametrize("name", [n for n in models.PRESETS if n.startswith(("qwen3-", "gemma3-", "tiny-"))])
def test_logra_targets_are_every_attention_and_mlp_projection(name):
    """The default target rules find the seven projections of each block, as [L, k, d] matrices with the HF
    widths (an MoE's expert projections as [L, E, k, d]: one matrix per layer and expert), and nothing else (no
    norm, router, embedding or head)."""
    c = models.preset(name)
    params = nnx.state(models.abstract_model(c), nnx.Param)
    targets = find_targets(params)
    f, experts = (c.expert_intermediate_size, (c.num_experts,)) if c.moe else (c.intermediate_size, ())
    # (rows d, width k) of W = kernelᵀ per projection.
    expected = {"attn.q_proj": (c.q_size, c.hidden_size), "attn.k_proj": (c.kv_size, c.hidden_size),
                "attn.v_proj": (c.kv_size, c.hidden_size), "attn.o_proj": (c.hidden_size, c.q_size),
                "mlp.gate_proj": (f, c.hidden_size), "mlp.up_proj": (f, c.hidden_size),
                "mlp.down_proj": (c.hidden_size, f)}
    assert sorted(targets) == sorted(f"blocks.{p}.kernel" for p in expected)
    for proj, (d, k) in expected.items():
        t = targets[f"blocks.{proj}.kernel"]
        batch = (c.num_layers, *experts) if proj.startswith("mlp.") else (c.num_layers,)
        assert (t.batch_shape, t.rows_shape, t.k) == (batch, (d,), k), proj


def test_gemma3_multimodal_checkpoint_loads_its_text_decoder(tmp_path, hf_logits, forward, padded_batch,
                                                             max_rel_err):
    """google/gemma-3-{4b,12b,27b} are Gemma3ForConditionalGeneration checkpoints: the decoder's config is a
    text_config listing only what differs from Gemma3TextConfig's defaults, its tensors sit under
    "language_model.", and the vision tower is skipped. Logits equal the multimodal model's on text."""
    import torch

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=5, sliding_window_pattern=2,
                query_pre_attn_scalar=24, rope_scaling={"rope_type": "linear", "factor": 2.0})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    peer = transformers.Gemma3ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in peer.parameters():  # Gemma's norms are (1 + w): small random w
            p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    peer.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["text_config"] = {k: v for k, v in hf["text_config"].items()
                         if k in ("model_type", *text) and k not in ("sliding_window_pattern", "rope_scaling")}
    hf["text_config"].update(sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(hf))

    model, _, ours = models.load(tmp_path)
    assert ours.architecture == "gemma3" and ours.tie_embeddings and ours.max_seq_len == 131_072
    assert ours.sliding_layers() == (True, False, True, False) and ours.rope_scaling_factor == 2.0
    tokens, mask = padded_batch
    assert max_rel_err(forward(model, tokens, mask), hf_logits(peer, tokens, mask), where=mask) <= 1e-4
