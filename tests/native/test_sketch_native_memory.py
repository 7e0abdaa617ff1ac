"""Compile-only memory on 8 fake devices (FSDP): the sketch-native LoGRA step saves at least 80% of the fp32
target-gradient bytes per device against the dense-gradient-mode LoGRA step (issue 4's memory criterion); and
dense-gradient mode draws one layer's projections at a time."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec, find_targets, logra, scale_by_sketch
from logra_jax.parallel import sharding as shd
from logra_jax.planner.memory_analysis import step_memory

DEVICES = 8
RANK = 8
# Wide, shallow and short: target weights dominate the step's bytes (one 32-token sequence per device, a
# 256-token vocabulary), so the criterion measures the gradient and not the activations.
CONFIG = preset("tiny", hidden_size=512, intermediate_size=2048, num_layers=2, num_heads=8, num_kv_heads=4,
                head_dim=64, vocab_size=256, max_seq_len=64)
SEQ = 32


def _batch():
    tokens = jax.ShapeDtypeStruct((DEVICES, SEQ), jnp.int32)
    return {"tokens": tokens, "attention_mask": tokens, "loss_mask": tokens}


def _memory(sketch_native: bool, mesh) -> tuple[dict[str, int], int]:
    """Per-device bytes of one logra step in the given mode, and the fp32 bytes of all target weights."""
    spec = SketchSpec(rank=RANK)
    tx = logra(rank=RANK)

    def make_model():
        model = init_model(CONFIG)
        if sketch_native:
            attach_sketch_probes(model, spec)
        return model

    def init():
        _, params, rest = nnx.split(make_model(), nnx.Param, ...)
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32)), rest

    graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)
    targets = find_targets(abstract_params)
    if sketch_native:
        step = make_train_step(graphdef, next_token_loss, tx, mode="sketch_native")
    else:  # dense-gradient mode: gradients of the targets only (non-targets are frozen either way)
        step = make_train_step(graphdef, next_token_loss, tx,
                               trainable=lambda path, _: ".".join(map(str, path)) in targets)
    mem = step_memory(step, init, _batch(), mesh, compiler_options=shd.FAST_CPU_COMPILE)
    return mem, sum(4 * math.prod(t.shape) for t in targets.values())


def test_sketch_native_saves_the_target_gradient():
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=DEVICES), jax.devices()[:DEVICES])
    dense, target_bytes = _memory(False, mesh)
    native, _ = _memory(True, mesh)
    # FSDP splits every target over the devices, and so does its fp32 gradient.
    grad_per_device = target_bytes / DEVICES
    saved = dense["total"] - native["total"]
    for name, mem in (("dense-gradient", dense), ("sketch-native", native)):
        print(f"{name:15s} per device: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items()))
    print(f"fp32 target gradient per device {grad_per_device / 2**20:.2f} MiB; saved {saved / 2**20:.2f} MiB "
          f"= {saved / grad_per_device:.0%} of it")
    # Both steps hold the same weights and row moments: the arguments differ only by the sketch probes.
    assert native["argument"] - dense["argument"] < 0.05 * grad_per_device
    assert saved >= 0.8 * grad_per_device


def test_dense_gradient_sketch_temporaries_do_not_grow_with_layers():
    """scale_by_sketch draws A_l inside a loop over layers: its temporaries are those of one layer's A, whatever L
    (drawing all layers' A at once would make them grow linearly with L)."""
    k, d, r = 4096, 32, 64

    def temp_bytes(layers: int) -> int:
        grads = {"up_proj": {"kernel": jax.ShapeDtypeStruct((layers, k, d), jnp.float32)}}
        tx = scale_by_sketch(rank=r)
        state = jax.eval_shape(tx.init, grads)
        sketch = jax.jit(lambda g, s: tx.update(g, s)[0]["up_proj"]["kernel"].factor)
        return sketch.lower(grads, state).compile().memory_analysis().temp_size_in_bytes

    few, many = temp_bytes(4), temp_bytes(16)
    print(f"scale_by_sketch temporaries: {few / 2**20:.1f} MiB at 4 layers, {many / 2**20:.1f} MiB at 16 layers "
          f"(one layer's A: {r * k * 4 / 2**20:.1f} MiB)")
    assert many <= 1.25 * few


@pytest.mark.slow
def test_rl_step_memory_includes_the_kl_probe():
    """The loop's own RL step, compile-only, with and without predicted-KL control: the controlled step reads the
    probe responses too, so its argument bytes hold at least the probe's tokens and masks; its temporaries hold
    the probe's JVP and realised-KL forward, one probe row per batch shard at a time (`kl_probe.probe_passes`):
    from 2 to 16 rows they grow by the kept primal hidden states of the extra rows ([rows, seq, D], reused by the
    realised KL), not by the per-row [seq, V] logits of both passes (before the passes: 1.24 MB for 14 extra rows
    against that floor of 0.92 MB; now 0.11 MB)."""
    from logra_jax.job.run_config import OptimizerSection
    from logra_jax.planner.memory_analysis import rl_step_memory

    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1), jax.devices()[:1])
    seq, config = 32, preset("tiny")
    kw = dict(seq_len=seq, prompt_len=8, rows_per_device=4)
    plain = rl_step_memory(config, OptimizerSection(kl_control=False), mesh, **kw)
    probed = {n: rl_step_memory(config, OptimizerSection(kl_control=True, probe_responses=n), mesh, **kw)
              for n in (2, 16)}
    for mem in (plain, *probed.values()):
        assert mem["total"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"] > 0
    assert probed[2]["argument"] >= plain["argument"] + 2 * seq * (4 + 1 + 1)
    per_row_logits = 4 * seq * config.vocab_size * 4  # JVP logits + tangents, realised-KL before + after (bytes)
    per_row_hidden = seq * config.hidden_size * jnp.dtype(config.dtype).itemsize
    growth = probed[16]["temp"] - probed[2]["temp"]
    assert (16 - 2) * per_row_hidden <= growth < (16 - 2) * per_row_logits / 4, (growth, per_row_hidden)
    assert probed[2]["temp"] > plain["temp"]
    # The realised KL reuses the JVP's primal hidden states, so the old weights die at the in-place merge: the
    # probe must not cost a second copy of the parameters (it did: +8.2 GiB at Qwen2.5-7B on 4 devices).
    model_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(init_model(config), nnx.Param)))
    assert probed[2]["temp"] - plain["temp"] < 0.5 * model_bytes, (probed[2], plain, model_bytes)
