"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral) against transformers' Qwen3MoeForCausalLM / MixtralForCausalLM
(PyTorch CPU, fp32) on the same random weights: logits of padded batches, the auxiliary loss, KV-cache decoding
equal to the full forward, sharded (fsdp 8; fsdp 4 × tensor 2 on 8 fake devices) equal to unsharded, export → load
bit-exact and read back by transformers; the MoE layer against a per-token numpy loop (values and gradients);
presets' parameter counts against the transformers classes on the meta device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from logra_jax import models
from logra_jax.models import moe
from logra_jax.models.decoder import per_layer_state
from logra_jax.models.hf import SafetensorsFile, config_from_hf, config_to_hf
from logra_jax.parallel import sharding as shd

# torch is imported where it is used, and this module runs on the one worker that imports it (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")

CASES = {
    # Qwen3-MoE's default: the top-k weights not renormalised; untied; 4 experts of width 32, top-2.
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    tie_word_embeddings=False)),
    "qwen3_moe-norm-top3": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                              norm_topk_prob=True, tie_word_embeddings=True)),
    # Periodic: layers 2 and 5 MoE, the others dense (decoder_sparse_step 3).
    "qwen3_moe-step3": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          num_hidden_layers=6, decoder_sparse_step=3, tie_word_embeddings=False)),
    # Mixtral: always renormalised, expert width = intermediate_size, no q/k norm.
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
}
MESHES = {"fsdp8": shd.MeshConfig(fsdp=8), "fsdp4_tensor2": shd.MeshConfig(fsdp=4, tensor=2)}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, checkpoint, hf_logits, forward, padded_batch, max_rel_err):
    peer, directory = checkpoint(case)
    model, _, config = models.load(directory)
    assert config.architecture == CASES[case][0] and config.moe
    assert config.num_experts == peer.config.num_local_experts
    assert config.experts_per_token == peer.config.num_experts_per_tok
    tokens, mask = padded_batch
    assert max_rel_err(forward(model, tokens), hf_logits(peer, tokens)) <= 1e-4
    assert max_rel_err(forward(model, tokens, mask), hf_logits(peer, tokens, mask), where=mask) <= 1e-4


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_load_balancing_loss_matches_transformers(case, checkpoint, padded_batch):
    import torch

    peer, directory = checkpoint(case)
    model, _, config = models.load(directory)
    tokens, mask = padded_batch
    with torch.no_grad():
        out = peer(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                   position_ids=torch.tensor(np.maximum(np.cumsum(mask, axis=1) - 1, 0)), output_router_logits=True)
    logits = model.router_logits(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    assert logits.shape == (config.num_layers, *tokens.shape, config.num_experts)
    ours = moe.load_balancing_loss(logits, config.experts_per_token, jnp.asarray(mask))
    np.testing.assert_allclose(float(ours), float(out.aux_loss), rtol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def _cached_step(graphdef, state, tokens, cache, mask):
    return nnx.merge(graphdef, state).forward_cached(tokens, cache, attention_mask=mask)


def _decode(model, tokens, mask, prefill: int) -> np.ndarray:
    graphdef, state = nnx.split(model)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    logits, cache = _cached_step(graphdef, state, jnp.asarray(tokens[:, :prefill]), cache,
                                 jnp.asarray(mask[:, :prefill]))
    steps = [np.asarray(logits)]
    for t in range(prefill, tokens.shape[1]):
        logits, cache = _cached_step(graphdef, state, jnp.asarray(tokens[:, t:t + 1]), cache,
                                     jnp.asarray(mask[:, t:t + 1]))
        steps.append(np.asarray(logits))
    return np.concatenate(steps, axis=1)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-step3", "mixtral"])
def test_kv_cache_decode_equals_full_forward(case, checkpoint, forward, max_rel_err):
    """Prefill 8 tokens (row 1 left-padded, row 2 right-padded), then decode 8 one at a time; the per-layer
    decoder (decode_unroll) of the same weights decodes alike."""
    model, _, config = models.load(checkpoint(case)[1])
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 128, (3, 16)).astype(np.int32)
    mask = np.ones((3, 16), bool)
    mask[1, :3] = False
    mask[2, 6:8] = False
    full = forward(model, tokens, mask)
    assert max_rel_err(_decode(model, tokens, mask, 8), full, where=mask) <= 1e-5
    if config.moe_layer_step > 1:
        return
    graphdef, abstract = nnx.split(models.abstract_model(config.replace(decode_unroll=True)))
    unrolled = nnx.merge(graphdef, per_layer_state(nnx.state(model), abstract))
    assert max_rel_err(_decode(unrolled, tokens, mask, 8), full, where=mask) <= 1e-5


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-step3", "mixtral"])
def test_sharded_equals_unsharded(case, checkpoint, sharded_errors):
    errors = sharded_errors(checkpoint(case)[1], MESHES)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-step3", "mixtral"])
def test_export_round_trip_is_bit_exact_and_transformers_reads_it(case, checkpoint, tmp_path, hf_logits, forward,
                                                                  padded_batch, max_rel_err):
    peer, directory = checkpoint(case)
    model, _, config = models.load(directory)
    models.export(model, models.char_tokenizer(), tmp_path / "exported")
    again, _, config_again = models.load(tmp_path / "exported")
    assert config_again == config
    leaves_again = dict(nnx.to_flat_state(nnx.state(again)))
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_array_equal(np.asarray(variable.get_value()),
                                      np.asarray(leaves_again[path].get_value()), err_msg=str(path))
    exported = SafetensorsFile(tmp_path / "exported" / "model.safetensors").names()
    assert sorted(exported) == sorted(SafetensorsFile(directory / "model.safetensors").names())
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager")
    assert type(reread) is type(peer)
    tokens, mask = padded_batch
    assert max_rel_err(forward(model, tokens, mask), hf_logits(reread, tokens, mask), where=mask) <= 1e-4


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_fused_expert_checkpoints_load_alike(case, checkpoint, tmp_path):
    """save_pretrained(save_original_format=False) writes transformers 5's fused experts (mlp.experts.gate_up_proj
    [E, 2F, D], mlp.experts.down_proj [E, D, F], Mixtral's router as mlp.gate.weight): the same parameters load."""
    peer, directory = checkpoint(case)
    peer.save_pretrained(tmp_path, save_original_format=False)
    names = SafetensorsFile(tmp_path / "model.safetensors").names()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    fused, _, config = models.load(tmp_path)
    model, _, config_again = models.load(directory)
    assert config == config_again
    leaves = dict(nnx.to_flat_state(nnx.state(model)))
    for path, variable in nnx.to_flat_state(nnx.state(fused)):
        np.testing.assert_array_equal(np.asarray(variable.get_value()), np.asarray(leaves[path].get_value()),
                                      err_msg=str(path))


@pytest.mark.parametrize("normalize", [False, True])
def test_moe_layer_equals_a_per_token_loop_and_its_gradient_a_dense_oracle(normalize, random_model, moe_reference,
                                                                         random_moe_layer):
    """Values against a numpy loop over tokens and their chosen experts; the expert kernels' gradients against
    those of the dense form Σ_e mask_e · w_e · expert_e(x) (every expert on every token, weights zero where
    not chosen), the oracle ragged_dot must equal."""
    config = models.preset("tiny-qwen3-moe", norm_topk_prob=normalize, num_experts=5, experts_per_token=3)
    layer, rng = random_moe_layer(config)
    x = rng.standard_normal((2, 9, config.hidden_size)).astype(np.float32)
    kernels = [np.asarray(m.kernel[...], np.float64) for m in (layer.router, layer.gate_proj, layer.up_proj,
                                                                layer.down_proj)]
    y, logits = layer(jnp.asarray(x))
    expected = moe_reference(x.reshape(-1, config.hidden_size).astype(np.float64), *kernels,
                               config.experts_per_token, normalize)
    np.testing.assert_allclose(np.asarray(y).reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)
    assert logits.shape == (2, 9, config.num_experts)

    def dense(gate, up, down, flat):
        weights, ids = moe.route(flat @ layer.router.kernel[...], config.experts_per_token, normalize)
        per_expert = jnp.zeros((flat.shape[0], config.num_experts)).at[
            jnp.arange(flat.shape[0])[:, None], ids].set(weights)
        h = jax.nn.silu(jnp.einsum("nd,edf->enf", flat, gate)) * jnp.einsum("nd,edf->enf", flat, up)
        return jnp.einsum("enf,efd,ne->nd", h, down, per_expert)

    graphdef, state = nnx.split(layer)

    def ragged(gate, up, down, flat):
        pure = nnx.to_pure_dict(state)
        for name, kernel in zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down)):
            pure[name]["kernel"] = kernel
        return nnx.merge(graphdef, pure)(flat[None])[0][0]

    flat = jnp.asarray(x.reshape(-1, config.hidden_size))
    cotangent = jnp.asarray(rng.standard_normal(flat.shape), jnp.float32)
    args = (layer.gate_proj.kernel[...], layer.up_proj.kernel[...], layer.down_proj.kernel[...])
    oracle = jax.grad(lambda *a: jnp.sum(dense(*a, flat) * cotangent), argnums=(0, 1, 2))(*args)
    ours = jax.grad(lambda *a: jnp.sum(ragged(*a, flat) * cotangent), argnums=(0, 1, 2))(*args)
    for got, want in zip(ours, oracle):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_moe_layer_groups_tokens_by_expert_with_no_tokens_by_experts_intermediate():
    """The traced layer multiplies through ragged_dot and holds no array with both the N·k (or N) token axis
    and the expert axis besides the [N, E] router logits and probabilities."""
    config = models.preset("tiny-qwen3-moe", num_experts=8, experts_per_token=2)
    layer = moe.MoE(config, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(layer)
    x = jnp.zeros((3, 5, config.hidden_size))
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    eqns = jaxpr.jaxpr.eqns
    assert sum(e.primitive.name == "ragged_dot_general" for e in eqns) == 3
    N, E = 15, config.num_experts
    for eqn in eqns:
        for var in eqn.outvars:
            shape = tuple(var.aval.shape)
            if E in shape and (N in shape or N * 2 in shape):
                assert len(shape) == 2, (eqn.primitive.name, shape)


@pytest.mark.parametrize("step", [1, 3])
def test_tiny_preset_maps_to_transformers_with_the_same_parameter_count(step):
    """(qwen3-30b-a3b and qwen3-235b-a22b: test_models_families' preset test, which takes every qwen3- preset.)"""
    import torch

    config = models.preset("tiny-qwen3-moe", num_layers=6, moe_layer_step=step)
    hf = config_to_hf(config)
    assert config_from_hf(hf) == config
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        peer = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields))
    assert sum(p.numel() for p in peer.parameters()) == config.num_params()


def test_presets_have_their_model_cards_parameter_counts():
    # Qwen/Qwen3-30B-A3B: 30.5B parameters; Qwen/Qwen3-235B-A22B: 235B.
    assert round(models.preset("qwen3-30b-a3b").num_params() / 1e9, 1) == 30.5
    assert round(models.preset("qwen3-235b-a22b").num_params() / 1e9) == 235


BASE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize("edit, match", [
    ({"decoder_sparse_step": 3}, r"x\.json: decoder_sparse_step=3 is not supported .* num_hidden_layers=4"),
    ({"mlp_only_layers": [0]}, r"x\.json: mlp_only_layers=\[0\] is not supported"),
    ({"num_experts_per_tok": 5}, r"x\.json: ModelConfig\.experts_per_token \(5\) exceeds num_experts \(4\)"),
    ({"moe_intermediate_size": 0}, r"x\.json: ModelConfig\.expert_intermediate_size must be > 0 .*"
                                   r"moe_intermediate_size"),
    ({"architectures": ["MixtralForCausalLM"], "sliding_window": 4096},
     r"x\.json: sliding_window=4096 is not supported for mixtral"),
])
def test_config_errors_name_the_field(edit, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**BASE, **edit}, source="x.json")


def test_dense_configs_reject_expert_fields():
    with pytest.raises(ValueError, match=r"ModelConfig\.num_experts=4 needs an MoE architecture"):
        models.preset("tiny", num_experts=4)
    with pytest.raises(ValueError, match=r"ModelConfig\.num_experts must be > 0 for architecture='mixtral'"):
        models.preset("tiny", architecture="mixtral")
    with pytest.raises(ValueError, match=r"ModelConfig\.moe_layer_step must be a positive divisor of num_layers"):
        models.preset("tiny-qwen3-moe", moe_layer_step=3)
    with pytest.raises(ValueError, match=r"decode_unroll is not supported with ModelConfig\.moe_layer_step=2"):
        models.init_model(models.preset("tiny-qwen3-moe", moe_layer_step=2, decode_unroll=True))


@functools.partial(jax.jit, static_argnums=2)
def _loss_and_grad(state, tokens, graphdef):
    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1).mean()

    return jax.value_and_grad(loss)(state)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_gives_the_same_loss_and_gradient(remat, random_model, padded_batch):
    tokens = jnp.asarray(padded_batch[0])
    plain = random_model(models.preset("tiny-qwen3-moe"))
    rematted = nnx.merge(nnx.graphdef(random_model(models.preset("tiny-qwen3-moe", remat=remat))), nnx.state(plain))
    loss, grad = _loss_and_grad(nnx.state(plain), tokens, nnx.graphdef(plain))
    loss_r, grad_r = _loss_and_grad(nnx.state(rematted), tokens, nnx.graphdef(rematted))
    np.testing.assert_allclose(float(loss_r), float(loss), rtol=1e-6)
    for g, g_r in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_r), strict=True):
        np.testing.assert_allclose(np.asarray(g_r), np.asarray(g), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(nnx.state(grad)["blocks"]["mlp"]["gate_proj"]["kernel"][...]).max()) > 0


def test_bfloat16_weights_and_compute_stay_close_to_float32(random_model, forward, padded_batch):
    """Most positions within bfloat16's error of float32; a few differ more, where bfloat16 rounding flips a
    router's top-k choice (the engine-vs-trainer disagreement routing replay is for)."""
    f32 = random_model(models.preset("tiny-qwen3-moe"))
    bf16_config = models.preset("tiny-qwen3-moe", dtype="bfloat16", param_dtype="bfloat16")
    bf16 = models.init_model(bf16_config)
    nnx.update(bf16, jax.tree.map(lambda x, like: x.astype(like.dtype), nnx.state(f32), nnx.state(bf16)))
    assert nnx.state(bf16)["blocks"]["mlp"]["up_proj"]["kernel"][...].dtype == jnp.bfloat16
    tokens, mask = padded_batch
    ours, ref = forward(bf16, tokens, mask)[mask], forward(f32, tokens, mask)[mask]
    per_position = np.abs(ours - ref).max(axis=-1) / np.abs(ref).max()
    assert np.median(per_position) < 3e-2 and np.mean(per_position < 3e-2) >= 0.75, np.sort(per_position)


def test_sharded_init_equals_init_model():
    config = models.preset("tiny-qwen3-moe")
    mesh = shd.make_mesh(MESHES["fsdp4_tensor2"])
    sharded = models.init_sharded_model(config, mesh, seed=1)
    plain = dict(nnx.to_flat_state(nnx.state(models.init_model(config, seed=1))))
    for path, variable in nnx.to_flat_state(nnx.state(sharded)):
        np.testing.assert_allclose(np.asarray(variable.get_value()), np.asarray(plain[path].get_value()),
                                   rtol=1e-6, atol=1e-7, err_msg=str(path))
    kernel = nnx.state(sharded)["blocks"]["mlp"]["gate_proj"]["kernel"][...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp", "tensor")
