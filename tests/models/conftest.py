"""Fixtures shared by the model tests: random-weight transformers checkpoints (the parity peer) and tolerances."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from logra_jax.models import init_model

if TYPE_CHECKING:
    import torch

# torch, and transformers' model classes (whose first use imports torch), are imported where they are used, not
# at collection (which every xdist worker does): the modules that use them are one xdist group ("torch"), so only
# that group's worker pays for them (1.6 + 2.3 s per process with warm bytecode, 12 s in a fresh clone).

# Small shapes with grouped-query attention (4 query heads share 2 key/value heads).
TINY_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM")}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # transformers zero-initialises biases and sets norms to one: draw every tensor so each one matters.
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)


def _make_hf_model(arch: str, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[arch])
    config = config_cls(**{**TINY_HF, **overrides}, attn_implementation="eager")
    model = model_cls(config).eval()
    _randomize(model, seed)
    return model


@pytest.fixture(scope="session")
def hf_model():
    """Factory: a random-weight transformers Llama/Qwen2/Qwen3/Gemma 3/Qwen3-MoE/Mixtral model in fp32 with eager
    attention."""
    return _make_hf_model


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory, hf_model):
    """Factory (cached per module): a case of the test module's `CASES` ({case: (architecture, overrides)}) →
    (its transformers peer, the directory it was saved to)."""
    cases = request.module.CASES

    @functools.cache
    def make(case: str):
        arch, overrides = cases[case]
        peer = hf_model(arch, **overrides)
        directory = tmp_path_factory.mktemp(case)
        peer.save_pretrained(directory)
        return peer, directory

    return make


@pytest.fixture(scope="session")
def hf_logits():
    """Logits of a transformers model, fp32 numpy; with a mask, positions count real tokens (as ours do)."""

    def run(model: transformers.PreTrainedModel, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        import torch

        kwargs = {}
        if mask is not None:
            kwargs = {"attention_mask": torch.tensor(mask, dtype=torch.long),
                      "position_ids": torch.tensor(np.maximum(np.cumsum(mask, axis=1) - 1, 0))}
        with torch.no_grad():
            return model(torch.tensor(tokens, dtype=torch.long), **kwargs).logits.float().numpy()

    return run


@pytest.fixture(scope="session")
def padded_batch():
    """tokens [3, 20] and a mask: row 0 unpadded, row 1 left-padded by 5, row 2 right-padded by 6."""
    tokens = np.random.default_rng(0).integers(0, TINY_HF["vocab_size"], (3, 20)).astype(np.int32)
    mask = np.ones((3, 20), bool)
    mask[1, :5] = False
    mask[2, 14:] = False
    return tokens, mask


@pytest.fixture(scope="session")
def max_rel_err():
    """max |ours − ref| / max |ref| over the selected entries (per-entry ratios explode near zero)."""

    def err(ours, ref, where=None) -> float:
        ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
        if where is not None:
            ours, ref = ours[where], ref[where]
        return float(np.abs(ours - ref).max() / np.abs(ref).max())

    return err


@functools.partial(jax.jit, static_argnums=3)
def _forward(state, tokens, mask, graphdef):
    return nnx.merge(graphdef, state)(tokens, attention_mask=mask)


@pytest.fixture(scope="session")
def forward():
    """Our logits as numpy, jitted once per model config (eager NNX would retrace the layer scan every call)."""

    def run(model: nnx.Module, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        graphdef, state = nnx.split(model)
        mask = np.ones(tokens.shape, bool) if mask is None else mask
        return np.asarray(_forward(state, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool), graphdef))

    return run


@pytest.fixture
def random_model():
    """Factory: init_model(config) with every parameter redrawn at a scale that makes logits O(1)
    (the 0.02 init leaves them so small that any tolerance passes)."""
    def make(config, seed: int = 0) -> nnx.Module:
        model = init_model(config, seed=seed)
        rng = np.random.default_rng(seed)
        for path, variable in nnx.to_flat_state(nnx.state(model)):
            shape = variable.get_value().shape
            if path[-1] == "scale":
                value = 1 + 0.1 * rng.standard_normal(shape)
            else:
                fan_in = shape[-2] if path[-1] == "kernel" else config.hidden_size
                value = rng.standard_normal(shape) * (0.1 if path[-1] == "bias" else 1 / np.sqrt(fan_in))
            variable.set_value(jnp.asarray(value, jnp.float32))
        return model

    return make


@pytest.fixture(scope="session")
def sharded_errors(forward, padded_batch, max_rel_err):
    """Factory: a saved checkpoint's logits on the padded batch, loaded sharded on each mesh of
    {name: MeshConfig} (8 fake CPU devices), against loaded whole: {name: max_rel_err}."""
    from logra_jax import models
    from logra_jax.parallel import sharding as shd

    def errors(directory, meshes: dict) -> dict[str, float]:
        model, _, _ = models.load(directory)
        tokens, mask = padded_batch
        reference = forward(model, tokens, mask)
        out = {}
        for name, mesh_config in meshes.items():
            mesh = shd.make_mesh(mesh_config)
            graphdef, state = nnx.split(models.load(directory, shardings=mesh)[0])

            def run(state, tokens, mask, graphdef=graphdef, mesh=mesh):
                with shd.use_rules(mesh):
                    return nnx.merge(graphdef, state)(tokens, attention_mask=mask)

            logits = jax.jit(run, compiler_options=shd.FAST_CPU_COMPILE)(state, jnp.asarray(tokens), jnp.asarray(mask))
            out[name] = max_rel_err(np.asarray(logits), reference, where=mask)
        return out

    return errors


def _route(token: np.ndarray, router: np.ndarray, k: int, normalize: bool,
           chosen: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A token's experts and their weights in numpy: softmax over the router logits, the top k (stable order) or
    the experts `chosen` (routing replay), renormalised over them when `normalize` (Qwen3-MoE's norm_topk_prob,
    Mixtral always)."""
    logits = token @ router
    p = np.exp(logits - logits.max())
    p /= p.sum()
    if chosen is None:
        chosen = np.argsort(-p, kind="stable")[:k]
    return chosen, p[chosen] / (p[chosen].sum() if normalize else 1.0)


def _moe_loop(x, router, gate, up, down, k, normalize, ids=None):
    """The MoE layer token by token in numpy float64: y = Σ_{e ∈ S} w_e · W_eᵀ(silu(G_eᵀ x) ⊙ U_eᵀ x), S the top k
    of the router (`_route`) or, given ids [N, k], token n's ids[n]."""
    out = np.zeros_like(x)
    for n, token in enumerate(x):
        chosen, w = _route(token, router, k, normalize, None if ids is None else ids[n])
        for weight, e in zip(w, chosen):
            g = token @ gate[e]
            out[n] += weight * ((g / (1 + np.exp(-g)) * (token @ up[e])) @ down[e])
    return out


@pytest.fixture(scope="session")
def route_reference():
    """The numpy routing of one token (`_route`): (its k experts, their weights)."""
    return _route


@pytest.fixture(scope="session")
def moe_reference():
    """The numpy MoE layer, token by token (`_moe_loop`), routed by the router's top k or by given ids."""
    return _moe_loop
