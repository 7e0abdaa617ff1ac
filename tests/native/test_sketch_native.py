"""Sketch-native backward: the sketch of every target equals the dense-gradient oracle G·Aᵀ, no dense G formed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.job.train_step import accumulate_grads, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import SketchProbe, attach_sketch_probes, sketching
from logra_jax.optim import SketchSpec
from logra_jax.optim.lowrank import LowRankUpdate
from logra_jax.optim.projection import target_projection


def _batch(seed=0, B=6, T=12, vocab=128):
    toks = jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)
    mask = jnp.ones_like(toks).at[0, :3].set(0)  # one left-padded row
    return dict(tokens=toks, attention_mask=mask, loss_mask=mask)


def _dense_oracle(graphdef, params, rest, batch, targets, spec):
    """S_l = G_l A_lᵀ from the dense gradient of the plain model's loss on the whole batch (no microbatching:
    a weighting error in the step's accumulation cannot cancel), contracted in numpy float64."""
    grads = jax.jit(jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    flat = {".".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(grads)}
    out = {}
    for path, t in targets.items():
        g = np.asarray(flat[path], np.float64)  # [L, k, d]
        a = np.asarray(target_projection(t, spec.base_seed, 0, spec.rank, spec.distribution), np.float64)  # [L, r, k]
        out[path] = np.einsum("lkd,lrk->ldr", g, a)
    return out


# tiny-qwen3 / tiny-gemma3: the sketches flow back through q/k norms, (1 + w) and post norms, GeGLU and the
# sliding window (12 tokens, window 8).
@pytest.mark.parametrize(("model_preset", "remat", "distribution"), [
    ("tiny", "none", "rademacher"), ("tiny", "full", "gaussian"), ("tiny-qwen3", "none", "rademacher"),
    ("tiny-gemma3", "full", "rademacher")])
def test_sketch_equals_dense_gradient_oracle(model_preset, remat, distribution):
    model = init_model(preset(model_preset, remat=remat))
    spec = SketchSpec(rank=8, distribution=distribution)
    targets = attach_sketch_probes(model, spec)
    assert len(targets) == 7
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probes, others = nnx.split_state(rest, SketchProbe, ...)
    batch = _batch()

    def vg(mb):
        def loss_of(pr):
            with sketching(jnp.int32(0)):
                return next_token_loss(nnx.merge(graphdef, params, nnx.merge_state(pr, others)), mb)
        return jax.value_and_grad(loss_of, has_aux=True)(probes)

    _, sketches, _ = jax.jit(lambda b: accumulate_grads(vg, b, 3))(batch)
    got = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(sketches)}
    want = _dense_oracle(graphdef, params, rest, batch, targets, spec)
    for path, s in want.items():
        g = got[path.replace(".kernel", ".sketch_probe")]
        assert g.dtype == np.float32
        rel = np.linalg.norm(g - s) / np.linalg.norm(s)
        assert rel <= 1e-5, (path, rel)


def test_input_gradients_and_outputs_equal_plain_model():
    model = init_model(preset("tiny"))
    plain_graph, plain_params = nnx.split(model)
    batch = _batch(1)
    loss_plain = lambda p: next_token_loss(nnx.merge(plain_graph, p), batch)[0]
    g_plain = jax.grad(loss_plain)(plain_params)

    attach_sketch_probes(model, SketchSpec(rank=4))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_native(p):
        with sketching(jnp.int32(3)):
            return next_token_loss(nnx.merge(graphdef, p, rest), batch)[0]

    assert np.isclose(loss_native(params), loss_plain(plain_params), rtol=1e-6)
    g_native = jax.grad(loss_native)(params)
    # Non-target parameters receive their gradients through the layers' input cotangents H Kᵀ.
    for path in ("embed.embedding", "blocks.attn_norm.scale", "final_norm.scale", "blocks.mlp_norm.scale"):
        keys = path.split(".")
        a, b = g_native, g_plain
        for k in keys:
            a, b = a[k], b[k]
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=2e-5, atol=1e-7)
    # Targets get no dense gradient at all in sketch mode.
    assert float(jnp.abs(g_native["blocks"]["attn"]["q_proj"]["kernel"][...]).max()) == 0.0


def test_hooks_are_inert_outside_sketching_and_probe_layout():
    model = init_model(preset("tiny"))
    toks = _batch(2)["tokens"]
    before = model(toks)
    spec = SketchSpec(rank=5)
    targets = attach_sketch_probes(model, spec)
    np.testing.assert_array_equal(np.asarray(model(toks)), np.asarray(before))
    q = model.blocks.attn.q_proj
    assert q.sketch_probe.shape == (2, 64, 5)  # [L, d = out features, r]
    assert q.sketch_probe.get_metadata()["axes"] == ("layers", "q_heads", None)
    assert targets["blocks.attn.q_proj.kernel"].path == "blocks.attn.q_proj.kernel"
    assert sorted(targets) == sorted(f"blocks.{m}.{n}.kernel" for m, names in
                                     (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                      ("mlp", ("gate_proj", "up_proj", "down_proj"))) for n in names)


def test_tangent_mode_equals_dense_update_jvp():
    """JVP along probes with tangent U equals the JVP along params with the dense ΔW = U·A (to_dense)."""
    model = init_model(preset("tiny"))
    spec = SketchSpec(rank=6)
    targets = attach_sketch_probes(model, spec)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probes, others = nnx.split_state(rest, SketchProbe, ...)
    toks = _batch(3)["tokens"]
    step = jnp.int32(7)
    rng = np.random.default_rng(0)
    factors = {p: jnp.asarray(rng.normal(size=(*t.batch_shape, *t.rows_shape, spec.rank)), jnp.float32)
               for p, t in targets.items()}
    flat = nnx.to_flat_state(probes)
    tangent_probes = nnx.from_flat_state(
        [(k, v.replace(factors[".".join(map(str, k[:-1])) + ".kernel"])) for k, v in flat])

    def features_of_probes(pr):
        with sketching(step, kind="tangent"):
            return nnx.merge(graphdef, params, nnx.merge_state(pr, others))(toks)

    _, dz_factored = jax.jvp(features_of_probes, (probes,), (tangent_probes,))

    dense_tangent = jax.tree.map(jnp.zeros_like, params)
    flat_p = nnx.to_flat_state(dense_tangent)
    dense_tangent = nnx.from_flat_state([
        (k, v.replace(LowRankUpdate(factors[".".join(map(str, k))], step, target=targets[".".join(map(str, k))],
                                    spec=spec).to_dense())
         if ".".join(map(str, k)) in targets else v) for k, v in flat_p])
    plain = lambda p: nnx.merge(graphdef, p, rest)(toks)
    _, dz_dense = jax.jvp(plain, (params,), (dense_tangent,))
    np.testing.assert_allclose(np.asarray(dz_factored), np.asarray(dz_dense), rtol=1e-4, atol=1e-5)


def test_save_sketch_remat_keeps_projections_not_inputs():
    """remat="save_sketch" saves each target's X Aᵀ [L, B, T, r] across the layer scan and recomputes the rest;
    the sketches equal those without remat."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    results = {}
    for remat in ("none", "save_sketch"):
        model = init_model(preset("tiny", remat=remat))
        attach_sketch_probes(model, SketchSpec(rank=3))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        probes, others = nnx.split_state(rest, SketchProbe, ...)
        batch = _batch(4, B=2, T=6)

        def loss(pr, graphdef=graphdef, params=params, others=others, batch=batch):
            with sketching(jnp.int32(1)):
                return next_token_loss(nnx.merge(graphdef, params, nnx.merge_state(pr, others)), batch)[0]

        results[remat] = jax.grad(loss)(probes)
        if remat == "save_sketch":
            report = io.StringIO()
            with contextlib.redirect_stdout(report):
                print_saved_residuals(loss, probes)
            assert report.getvalue().count("f32[2,2,5,3]") == 7  # [L, B, T, r] per target, saved by the scan
    for a, b in zip(jax.tree.leaves(results["none"]), jax.tree.leaves(results["save_sketch"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
