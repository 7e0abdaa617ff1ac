"""The decode step's bandwidth floor (`plan.decode_floor`) against hand counts of the tiny presets' tensors, and the
expected distinct experts (`plan.expected_experts`) against an exact enumeration of every routing."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import PRESETS
from logra_jax.models.decoder import abstract_model
from logra_jax.planner import plan

F32 = 4  # bytes: the presets store float32


def _floor(config, kv: int, slots: int, devices: int) -> dict:
    graphdef, state = nnx.split(abstract_model(config))
    return plan.decode_floor(graphdef, state, kv, slots, devices)


@pytest.mark.parametrize(("E", "k", "S"), [(4, 2, 1), (4, 2, 3), (5, 2, 2), (6, 3, 2), (4, 4, 2)])
def test_expected_experts_equals_the_mean_over_every_routing(E, k, S):
    """Every token picks each k-subset of the E experts with equal probability, independently: the mean number of
    distinct experts over all C(E, k)^S routings."""
    subsets = list(itertools.combinations(range(E), k))
    distinct = [len(set().union(*choice)) for choice in itertools.product(subsets, repeat=S)]
    assert plan.expected_experts(E, k, S) == pytest.approx(np.mean(distinct), rel=1e-12)


def test_expected_experts_rejects_bad_counts():
    with pytest.raises(ValueError, match="k=5"):
        plan.expected_experts(4, 5, 2)
    with pytest.raises(ValueError, match="tokens=-1"):
        plan.expected_experts(4, 2, -1)


def test_a_dense_model_reads_every_weight_and_the_cache():
    """`tiny` (tied, 2 layers): every tensor once, plus the KV cache, over the devices."""
    L, D, F, V, Hd, KVd = 2, 64, 128, 128, 64, 32
    weights = F32 * (L * (D * KVd * 2 + Hd * D + D * Hd + 2 * D + 3 * D * F) + V * D + D)
    floor = _floor(PRESETS["tiny"], kv=1000, slots=3, devices=2)
    assert floor == {"floor_bytes": (weights + 1000) / 2, "floor_all_experts_bytes": (weights + 1000) / 2}


@pytest.mark.parametrize(("slots", "tied"), [(1, True), (3, True), (3, False)])
def test_an_moe_step_reads_the_experts_its_slots_choose(slots, tied):
    """`tiny-qwen3-moe` (2 layers, 4 experts of width 32, top-2): the non-expert tensors (attention with q/k norms,
    norms, router, embedding, final norm) once and each layer's 3 expert kernels times the expected share of
    experts chosen, 1 − (1 − 2/4)^S; untied, the head's kernel whole and only S rows of the input embedding."""
    L, D, Fe, E, V, Hd, KVd, hd = 2, 64, 32, 4, 128, 128, 64, 32
    attention = L * (D * Hd + 2 * D * KVd + Hd * D + 2 * hd + 2 * D)
    router, experts = L * D * E, L * 3 * E * D * Fe
    embedding = V * D if tied else slots * D + D * V  # untied: the gathered rows and the head's kernel
    other = F32 * (attention + router + embedding + D)
    share = 1 - (1 - 2 / 4) ** slots
    config = dataclasses.replace(PRESETS["tiny-qwen3-moe"], tie_embeddings=tied)
    floor = _floor(config, kv=1000, slots=slots, devices=2)
    assert floor["experts_per_layer"] == E and floor["expected_experts_per_layer"] == pytest.approx(E * share)
    assert floor["floor_bytes"] == pytest.approx((other + F32 * experts * share + 1000) / 2, rel=1e-12)
    assert floor["floor_all_experts_bytes"] == pytest.approx((other + F32 * experts + 1000) / 2, rel=1e-12)


def test_only_the_moe_layers_experts_are_discounted():
    """moe_layer_step 2: layer 0 has a dense MLP (width 128, read whole), layer 1 the experts (one layer's)."""
    config = dataclasses.replace(PRESETS["tiny-qwen3-moe"], moe_layer_step=2)
    D, F, Fe, E = 64, 128, 32, 4
    slots = 1
    full = _floor(config, kv=0, slots=slots, devices=1)
    experts = F32 * 3 * E * D * Fe
    assert full["floor_all_experts_bytes"] - full["floor_bytes"] == pytest.approx(experts * (1 - 2 / 4))
    every = _floor(dataclasses.replace(config, moe_layer_step=1), kv=0, slots=slots, devices=1)
    # the same model with both layers MoE: one dense MLP fewer, one layer of experts and router more
    assert every["floor_all_experts_bytes"] - full["floor_all_experts_bytes"] == experts + F32 * (D * E - 3 * D * F)
