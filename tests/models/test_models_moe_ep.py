"""Expert parallelism (logra_jax.models.expert_parallel) on 8 fake CPU devices against the unsharded model on the
same weights: Qwen3-MoE and Mixtral decoders' logits and every parameter's gradient (1e-5 fp32), LoGRA's
sketch-native sketches of every expert against the dense-gradient oracle G_e·A_eᵀ (tests/native/test_moe_sketch.py's
approach), one MoE layer whose expert gets no token (equal outputs and input gradients, a zero sketch), no
all-gather of an expert kernel in the compiled step (the FSDP layout's step has them), and the config errors."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.job.builders import build_model
from logra_jax.job.run_config import ModelSection, RunConfig
from logra_jax.models import moe
from logra_jax.models.config import FAMILY_FEATURES, preset
from logra_jax.models.decoder import init_model
from logra_jax.models.expert_parallel import ExpertDispatch, install_expert_parallel
from logra_jax.native.sketch_probes import SketchProbe, attach_sketch_probes, sketching
from logra_jax.optim import SketchSpec
from logra_jax.optim.projection import target_projection
from logra_jax.parallel import sharding as shd

RANK = 4
CONFIGS = {
    # Qwen3-MoE's default (top-k weights not renormalised), 8 experts: one per device of fsdp 8
    "qwen3_moe": preset("tiny-qwen3-moe", num_experts=8, norm_topk_prob=False),
    # Mixtral: Llama attention, always renormalised, expert width = intermediate_size
    "mixtral": preset("tiny-qwen3-moe", architecture="mixtral", **FAMILY_FEATURES["mixtral"], num_experts=8,
                      intermediate_size=48, expert_intermediate_size=48),
}
# (family, mesh, whether to check the sketches too): tensor 2 splits the experts' width, which the sketch of a
# down projection contracts over
CASES = [("qwen3_moe", shd.MeshConfig(fsdp=8), True), ("mixtral", shd.MeshConfig(fsdp=8), False),
         ("qwen3_moe", shd.MeshConfig(data=2, fsdp=2, tensor=2), True)]


def _flat(tree):
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(tree)}


def _expert_parallel(model, mesh):
    """A copy of `model` made expert-parallel, its state placed in the layout its metadata now declares."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(jnp.array, state))
    install_expert_parallel(copy, mesh)
    graphdef, state = nnx.split(copy)
    return graphdef, jax.device_put(state, shd.param_shardings(state, mesh))


def _batch(B=8, T=11, vocab=128):
    toks = jax.random.randint(jax.random.key(1), (B, T), 0, vocab)
    mask = jnp.ones_like(toks).at[1, :4].set(0)
    return dict(tokens=toks, attention_mask=mask, loss_mask=mask)


def _program(graphdef, mesh=None, sketches=False):
    """jitted (params, rest, batch) → (loss, logits, dense grads, LoGRA sketches or None) under `mesh`'s rules."""
    def rules():
        return shd.use_rules(mesh) if mesh is not None else contextlib.nullcontext()

    def loss(params, rest, batch):
        with rules():
            tokens = batch["tokens"]
            logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1])
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
            mask = batch["loss_mask"][:, 1:]
            return jnp.sum(nll * mask) / mask.sum(), logits

    def sketch(probes, params, others, batch, step):
        with sketching(step):
            return loss(params, nnx.merge_state(probes, others), batch)[0]

    def run(params, rest, batch, step=3):
        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, batch)
        if not sketches:
            return value, logits, grads, None
        probes, others = nnx.split_state(rest, SketchProbe, ...)
        return value, logits, grads, jax.grad(sketch)(probes, params, others, batch, step)

    return jax.jit(run, compiler_options=shd.FAST_CPU_COMPILE)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


_REFERENCES: dict[str, tuple] = {}


def _reference(family, random_model):
    """(model with LoGRA probes, its targets, the spec, and its unsharded loss, logits and dense grads), once per
    family."""
    if family not in _REFERENCES:
        model = random_model(CONFIGS[family])
        spec = SketchSpec(rank=RANK, refresh=False)
        targets = attach_sketch_probes(model, spec)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        _REFERENCES[family] = (model, targets, spec, _program(graphdef)(params, rest, _batch())[:3])
    return _REFERENCES[family]


@pytest.mark.parametrize(("family", "mesh_config", "sketches"), CASES, ids=str)
def test_expert_parallel_equals_unsharded(family, mesh_config, sketches, random_model):
    """Logits, loss and every parameter's gradient equal the unsharded model's (1e-5); with `sketches`, each
    expert's LoGRA sketch equals G_e·A_eᵀ of the unsharded dense gradient (1e-5 of the slice's largest entry)."""
    model, targets, spec, (loss, logits, grads) = _reference(family, random_model)
    batch = _batch()

    mesh = shd.make_mesh(mesh_config)
    ep_graph, state = _expert_parallel(model, mesh)
    ep_graph, ep_params, ep_rest = nnx.split(nnx.merge(ep_graph, state), nnx.Param, ...)
    assert ep_params["blocks"]["mlp"]["gate_proj"]["kernel"][...].sharding.spec[1] == "fsdp"
    step = jax.device_put(jnp.int32(3), shd.replicated(mesh))  # traced and sharded, as a train step's counter
    ep_loss, ep_logits, ep_grads, ep_sketches = _program(ep_graph, mesh, sketches)(ep_params, ep_rest, batch, step)
    assert _rel(ep_logits, logits) <= 1e-5 and _rel(ep_loss, loss) <= 1e-5
    dense, ep_dense = _flat(grads), _flat(ep_grads)
    assert dense.keys() == ep_dense.keys()
    for path, g in dense.items():
        assert _rel(ep_dense[path], g) <= 1e-5, (path, _rel(ep_dense[path], g))
    if not sketches:
        return
    got = _flat(ep_sketches)
    experts = 0
    for path, t in targets.items():
        a = np.asarray(target_projection(t, spec.base_seed, 0, RANK), np.float64)  # refresh=False: step 0
        want = np.einsum("...kd,...rk->...dr", dense[path].astype(np.float64), a)
        s = got[path.replace(".kernel", ".sketch_probe")]
        for index in np.ndindex(*t.batch_shape):  # per layer, and per expert
            assert np.abs(s[index] - want[index]).max() <= 1e-5 * max(np.abs(want[index]).max(), 1e-12), (path, index)
        experts += "_proj" in path and "mlp" in path
    assert experts == 3


def test_layer_with_an_expert_no_token_reaches(moe_layer_without_expert):
    """fsdp 8, one expert per device, expert 5 chosen by no token (its device computes nothing of its own): y and
    x's gradient equal the local layer's, its sketch is exactly zero, the others' equal the local sketches."""
    config, unused = CONFIGS["qwen3_moe"], 5
    layer, x, cot = moe_layer_without_expert(config, unused, tokens=(8, 5), center_router=True)
    x, cot = jnp.asarray(x), jnp.asarray(cot)
    ids = moe.route(x.reshape(-1, config.hidden_size) @ layer.router.kernel[...], config.experts_per_token, False)[1]
    counts = np.bincount(np.asarray(ids).ravel(), minlength=config.num_experts)
    assert counts[unused] == 0 and (np.delete(counts, unused) > 0).all()
    attach_sketch_probes(layer, SketchSpec(rank=RANK))
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=8))

    def program(graphdef, mesh=None):
        def f(probes, others, x):
            with (shd.use_rules(mesh) if mesh else contextlib.nullcontext()), sketching(jnp.int32(0)):
                y = nnx.merge(graphdef, nnx.merge_state(probes, others))(x)[0]
            return jnp.sum(y * cot), y
        return jax.jit(jax.grad(f, argnums=(0, 2), has_aux=True), compiler_options=shd.FAST_CPU_COMPILE)

    graphdef, state = nnx.split(layer)
    probes, others = nnx.split_state(state, SketchProbe, ...)
    (sketches, dx), y = program(graphdef)(probes, others, x)
    ep_graph, ep_state = _expert_parallel(layer, mesh)
    assert isinstance(nnx.merge(ep_graph, ep_state).dispatch_hook, ExpertDispatch)
    ep_probes, ep_others = nnx.split_state(ep_state, SketchProbe, ...)
    (ep_sketches, ep_dx), ep_y = program(ep_graph, mesh)(ep_probes, ep_others, x)
    assert _rel(ep_y, y) <= 1e-5 and _rel(ep_dx, dx) <= 1e-5
    for name in ("gate_proj", "up_proj", "down_proj"):
        s, ep_s = _flat(sketches)[f"{name}.sketch_probe"], _flat(ep_sketches)[f"{name}.sketch_probe"]
        assert not ep_s[unused].any() and not s[unused].any(), name
        assert _rel(ep_s, s) <= 1e-5, name


_COLLECTIVE = re.compile(r"= \(?([^=]*?)\)? (?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _collective_shapes(jitted, *args):
    """The shapes of every collective's results in the compiled program."""
    text = jitted.lower(*args).compile().as_text()
    return [tuple(int(d) for d in shape.group(1).split(",") if d)
            for m in _COLLECTIVE.finditer(text) for shape in _SHAPE.finditer(m.group(1))]


def test_no_collective_moves_an_expert_kernel():
    """The compiled loss and gradient of the expert-parallel tiny Qwen3-MoE on fsdp 8: no collective moves an
    expert kernel or its gradient (no array ending in [D, F] or [F, D]; with a data axis their gradients would be
    summed over it, as any replicated weight's); its collectives move the tokens (the all-gather of the group's
    tokens [g·n, D] and the reduce-scatter back [n, D])."""
    config = dataclasses.replace(CONFIGS["qwen3_moe"], num_layers=1)
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=8))
    batch = _batch()
    D, F = config.hidden_size, config.expert_intermediate_size
    graphdef, state = _expert_parallel(init_model(config), mesh)
    params, rest = nnx.split_state(state, nnx.Param, ...)
    shapes = _collective_shapes(_program(graphdef, mesh), params, rest, batch)
    assert not [s for s in shapes if len(s) >= 2 and {s[-2], s[-1]} == {D, F}], shapes
    B, T = batch["tokens"].shape
    n = B * (T - 1) // (mesh.shape["data"] * mesh.shape["fsdp"])  # the loss's tokens per device
    assert (mesh.shape["fsdp"] * n, D) in shapes and (n, D) in shapes, shapes


def test_config_errors():
    """A dense model, or experts that fsdp does not split, are refused naming config.model.expert_parallel."""
    with pytest.raises(ValueError, match=r"model\.expert_parallel = True: needs a mixture-of-experts model"):
        RunConfig.from_dict({"model": {"preset": "tiny", "expert_parallel": True}})
    with pytest.raises(ValueError, match=r"model\.expert_parallel = True needs a mixture-of-experts model"):
        install_expert_parallel(init_model(preset("tiny")))
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=8))  # tiny-qwen3-moe has 4 experts
    with pytest.raises(ValueError, match=r"model\.expert_parallel = True: the 4 experts do not split over the 8 "):
        build_model(ModelSection(preset="tiny-qwen3-moe", expert_parallel=True), mesh, weights=False)


def test_policy_sync_merges_each_devices_own_experts():
    """An engine whose float32 masters hold the experts split over fsdp 8 (`RolloutWeights` in the trainer's
    expert-parallel shardings) takes a LoGRA delta: it applies (its fingerprint equals the trainer's merged
    weights'), its weights are bitwise a one-device merge's, and its compiled merge moves nothing between devices
    and multiplies U_e·A_e of its own expert only (1/8 of the merge's matmul flops per device)."""
    from logra_jax.core.tree_paths import flat_params, path_str
    from logra_jax.optim import logra
    from logra_jax.optim.lowrank import apply_updates, is_lowrank
    from logra_jax.planner.hlo_cost import hlo_cost
    from logra_jax.rollout.sync import delta_payload, snapshot_payload
    from logra_jax.rollout.worker import RolloutWeights

    config = CONFIGS["qwen3_moe"]
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=8))
    state = _expert_parallel(init_model(config, seed=2), mesh)[1]
    params = nnx.split_state(state, nnx.Param, ...)[0]
    experts = {p: a for p, a in flat_params(params).items() if p.startswith("blocks.mlp.") and "router" not in p}
    assert {a.sharding.spec[1] for a in experts.values()} == {"fsdp"}
    tx = logra(rank=RANK, update_ratio=3e-3, round_bf16=False)
    grads = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=jnp.float32).reshape(a.shape) * 0.37), params)
    updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)
    merged = jax.jit(apply_updates)(params, updates)

    shardings = {p: a.sharding for p, a in flat_params(params).items()}
    rollout = RolloutWeights(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params), shardings)
    assert rollout.receive(snapshot_payload(params, 0)).status == "loaded"
    assert rollout.receive(delta_payload(updates, merged, 1)).status == "applied"
    host = lambda tree: {p: np.asarray(a) for p, a in flat_params(tree).items()}
    local = host(jax.jit(apply_updates)(*jax.device_put((params, updates), jax.devices()[0])))
    for path, value in host(rollout.params).items():
        np.testing.assert_array_equal(value, local[path], err_msg=path)
        if path in experts:
            assert rollout.params is not None and flat_params(rollout.params)[path].sharding == shardings[path]

    # the expert kernels' merge alone, as the engine compiles it
    only = lambda tree: {p: v for p, v in flat_params(tree).items() if p in experts}
    ups = {path_str(k): u for k, u in jax.tree_util.tree_leaves_with_path(updates, is_leaf=is_lowrank)
           if path_str(k) in experts}
    program = jax.jit(apply_updates, out_shardings={p: shardings[p] for p in experts}).lower(only(params), ups)
    text = program.compile().as_text()
    cost = hlo_cost(text)
    assert cost.collective_bytes == 0, cost
    whole = sum(2 * np.prod(a.shape) * RANK for a in experts.values())  # U [.., d, r] · A [.., r, k] per expert
    assert cost.matmul_flops == whole / 8, (cost.matmul_flops, whole)
