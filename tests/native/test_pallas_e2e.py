"""implementation="pallas" end to end: sketch-native train steps of the tiny model through the Pallas kernels
(sketched_linear, row_moment, merge; interpret mode) equal the XLA path's, and each kernel is really on the path;
the Pallas RowAdam and merge on N-d einsum kernels against numpy; bad implementations are refused up front."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from logra_jax.job.train_step import TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import (
    LowRankUpdate,
    MatrixDims,
    SketchSpec,
    TargetRule,
    apply_updates,
    find_targets,
    logra,
    scale_by_row_adam,
    target_projection,
)

RANK = 4
STEPS = 2


def _batches():
    out = []
    for i in range(STEPS):
        toks = jax.random.randint(jax.random.key(10 + i), (4, 12), 0, 128)
        mask = jnp.ones_like(toks).at[1, :3].set(0)  # one left-padded row
        out.append(dict(tokens=toks, attention_mask=mask, loss_mask=mask))
    return out


def _train(implementation, round_bf16):
    """Two sketch-native logra steps; returns (initial params, final params, metrics of each step, jaxpr text)."""
    model = init_model(preset("tiny"), seed=3)
    spec = SketchSpec(rank=RANK, implementation=implementation, interpret=True)
    targets = attach_sketch_probes(model, spec)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = logra(rank=RANK, update_ratio=1e-2, round_bf16=round_bf16, implementation=implementation, interpret=True)
    step = jax.jit(make_train_step(graphdef, next_token_loss, tx, mode="sketch_native"))
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    batches = _batches()
    jaxpr = str(jax.make_jaxpr(step)(state, rest, batches[0]))
    metrics = []
    for batch in batches:
        state, m = step(state, rest, batch)
        metrics.append(jax.device_get(m))
    flat = lambda p: {".".join(map(str, k)): np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(p)}
    return flat(params), flat(state.params), metrics, jaxpr, set(targets)


def _rel(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("round_bf16", [False, True])
def test_pallas_train_steps_equal_xla(round_bf16):
    w0, xla, m_xla, jaxpr_xla, targets = _train("xla", round_bf16)
    _, pallas, m_pallas, jaxpr_pallas, _ = _train("pallas", round_bf16)
    # The Pallas path really runs the three kernels; the XLA path none of them.
    for name in ("logra_fused_forward", "logra_fused_backward", "logra_row_moment", "logra_row_scale",
                 "logra_merge"):
        assert name in jaxpr_pallas and name not in jaxpr_xla, name
    for a, b in zip(m_xla, m_pallas):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-6)
        np.testing.assert_allclose(b["sketch_norm"], a["sketch_norm"], rtol=1e-5)
    # Without bf16 rounding both paths are the same fp32 arithmetic in another order; ΔW ≈ 1e-3·W here, so one
    # fp32 ulp of a stored weight rounding the other way is ~1e-4 of that entry's ΔW. With rounding, a factor
    # entry within a few fp32 ulps of a bf16 rounding boundary can round the other way: one bf16 ulp (2⁻⁸
    # relative) of that entry's contribution. A wrong kernel would be off by O(1).
    tol_delta = 1e-4 if not round_bf16 else 2.0**-8
    for path, w in xla.items():
        if path not in targets:
            np.testing.assert_array_equal(pallas[path], w, err_msg=path)  # frozen non-targets
            continue
        delta_xla, delta_pallas = w - w0[path], pallas[path] - w0[path]
        assert np.linalg.norm(delta_xla) > 1e-4 * np.linalg.norm(w0[path]), path  # the steps moved it
        assert _rel(delta_pallas, delta_xla) <= tol_delta, (path, _rel(delta_pallas, delta_xla))
        assert _rel(pallas[path], w) <= 1e-6, path


# Tunix-style einsum kernel [N, L, H, D]: rows (N, H), batch L (not the leading axis), width D.
RULES = (TargetRule(r"w$", MatrixDims(rows=(0, 2), width=(3,))),)
SHAPE, R = (3, 2, 4, 5), 3


def _numpy_row_adam(s, v, t, variant, b2=0.95, eps=1e-8):
    """docs/method.md §4 per batch slice in float64; s (L, d, r), v (L, d)."""
    v = b2 * v + (1 - b2) * np.mean(s**2, axis=-1)
    rho = np.sqrt(v / (1 - b2**t))
    if variant == "nemo":
        return s / (rho + eps)[..., None], v
    den = rho + np.maximum(eps * rho.mean(axis=1, keepdims=True), np.finfo(np.float32).tiny)
    scale = (1 / den) / np.sqrt(np.mean((1 / den) ** 2, axis=1, keepdims=True))
    d_tilde = scale[..., None] * s
    ratio = np.linalg.norm(s, axis=(1, 2)) / np.linalg.norm(d_tilde, axis=(1, 2))
    return d_tilde * ratio[:, None, None], v


@pytest.mark.parametrize("variant", ["paper", "nemo"])
def test_pallas_row_adam_on_einsum_kernel_matches_numpy(variant):
    params = {"w": jnp.zeros(SHAPE)}
    target = find_targets(params, RULES)["w"]
    tx = scale_by_row_adam(variant, rules=RULES, implementation="pallas", interpret=True)
    state = tx.init(params)
    rng = np.random.default_rng(0)
    v_np = np.zeros((2, 12))
    for t in (1, 2):
        # (*batch, *rows, r) = (L, N, H, r), rows of very different magnitudes.
        s = (rng.normal(size=(2, 3, 4, R)) * rng.uniform(0.01, 10.0, size=(2, 3, 4, 1))).astype(np.float32)
        u = LowRankUpdate(jnp.asarray(s), t - 1, target=target, spec=SketchSpec(rank=R, base_seed=42))
        out, state = tx.update({"w": u}, state)
        want, v_np = _numpy_row_adam(s.reshape(2, 12, R).astype(np.float64), v_np, t, variant)
        np.testing.assert_allclose(np.asarray(out["w"].factor).reshape(2, 12, R), want, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(state.row_moment["w"]).reshape(2, 12), v_np, rtol=2e-6)


@pytest.mark.parametrize("decay", [None, -0.01])
def test_pallas_merge_on_einsum_kernel_matches_numpy(decay):
    rng = np.random.default_rng(1)
    weight = jnp.asarray(rng.normal(size=SHAPE), jnp.float32)
    target = find_targets({"w": weight}, RULES)["w"]
    factor = rng.normal(size=(2, 3, 4, R)).astype(np.float32)
    u = LowRankUpdate(jnp.asarray(factor), 5, target=target,
                      spec=SketchSpec(rank=R, base_seed=42, round_bf16=True, implementation="pallas", interpret=True),
                      decay=None if decay is None else jnp.float32(decay))
    got = apply_updates({"w": weight}, {"w": u})["w"]
    a = np.asarray(target_projection(target, 42, 5, R), np.float64)  # (L, r, D)
    bf16_u = factor.astype(ml_dtypes.bfloat16).astype(np.float64)
    want = np.asarray(weight, np.float64) * (1.0 + (decay or 0.0))
    for layer in range(2):
        want[:, layer] += np.einsum("nhz,zd->nhd", bf16_u[layer], a[layer])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    xla = apply_updates({"w": weight}, {"w": u.with_merge("xla")})["w"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(xla), rtol=1e-6, atol=1e-7)


def test_implementation_is_checked_where_it_enters():
    with pytest.raises(ValueError, match=r"SketchSpec\.implementation"):
        SketchSpec(rank=4, implementation="triton")
    with pytest.raises(ValueError, match="scale_by_sketch"):
        logra(rank=4, implementation="cuda")
    with pytest.raises(ValueError, match="scale_by_row_adam"):
        scale_by_row_adam(implementation="XLA")
    target = find_targets({"w": jnp.zeros(SHAPE)}, RULES)["w"]
    with pytest.raises(ValueError, match="LowRankUpdate for w"):
        LowRankUpdate(jnp.zeros((2, 3, 4, R)), 0, target=target, spec=SketchSpec(rank=R)).with_merge("mosaic")
    with pytest.raises(TypeError, match="interpret"):
        SketchSpec(rank=4, interpret=1)
