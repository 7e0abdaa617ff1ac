"""Every LoGRA stage against an independent float64 numpy reference (explicit per-layer loops, dense D·A)."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from logra_jax.optim import (
    LowRankUpdate,
    MatrixDims,
    TargetRule,
    apply_updates,
    find_targets,
    logra,
    projection,
    scale_by_row_adam,
    scale_by_sketch,
    scale_by_update_ratio,
    scale_lowrank,
)
from logra_jax.optim.projection import layer_seed
from logra_jax.optim.spec import SketchSpec

# A stacked Flax kernel [L, in, out], a Tunix q einsum kernel [D, N, H] and a Tunix o kernel [N, H, D].
RULES = (
    TargetRule(r"stack\.w$", MatrixDims(rows=(-1,), width=(-2,))),
    TargetRule(r"q_einsum$", MatrixDims(rows=(1, 2), width=(0,))),
    TargetRule(r"o_einsum$", MatrixDims(rows=(2,), width=(0, 1))),
)
DIMS = {"stack.w": ((2,), (1,)), "q_einsum": ((1, 2), (0,)), "o_einsum": ((2,), (0, 1))}
SHAPES = {"stack.w": (3, 12, 10), "q_einsum": (12, 2, 5), "o_einsum": (2, 5, 12)}
RANK, BASE = 4, 7
TINY = float(np.finfo(np.float32).tiny)


def make_params(rng, paths=tuple(SHAPES)):
    return as_tree({p: rng.normal(size=SHAPES[p]) for p in paths}, rng.normal(size=12))


def get(tree, path):
    for key in path.split("."):
        tree = tree[key]
    return tree


def make_grads(rng, paths=tuple(SHAPES)):
    """Gradients with very different row scales, so RowAdam has something to redistribute."""
    out = {}
    for path in paths:
        shape = SHAPES[path]
        rows, _ = DIMS[path]
        scale = np.exp(rng.normal(size=[shape[a] for a in rows]))
        g = rng.normal(size=shape)
        g = g * np.expand_dims(scale, [a for a in range(len(shape)) if a not in rows])
        out[path] = g
    return out


def as_tree(flat, norm):
    tree = {"norm": jnp.asarray(norm, jnp.float32)}
    for path, x in flat.items():
        node = tree
        *head, last = path.split(".")
        for key in head:
            node = node.setdefault(key, {})
        node[last] = jnp.asarray(x, jnp.float32)
    return tree


def to_mats(x, rows, width):
    """Weight layout → [n_slices, d, k] by explicit transposition (batch axes first, each group in weight order)."""
    batch = [a for a in range(x.ndim) if a not in rows + width]
    d = math.prod(x.shape[a] for a in rows)
    k = math.prod(x.shape[a] for a in width)
    return np.transpose(x, batch + list(rows) + list(width)).reshape(-1, d, k)


def from_mats(m, shape, rows, width):
    batch = [a for a in range(len(shape)) if a not in rows + width]
    perm = batch + list(rows) + list(width)
    return np.transpose(m.reshape([shape[a] for a in perm]), np.argsort(perm))


def slice_paths(path, shape, rows, width):
    n = math.prod(shape[a] for a in range(len(shape)) if a not in rows + width)
    batched = len(shape) > len(rows) + len(width)
    return [f"{path}.{i}" for i in range(n)] if batched else [path]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _projection_from_words(words, rank, width, dist):
    return projection(jax.random.wrap_key_data(words, impl="threefry2x32"), rank, width, dist)


def ref_projections(path, step, dist):
    """A per slice from the host seed (hashlib-based layer_seed), split into key words here with numpy."""
    rows, width = DIMS[path]
    shape = SHAPES[path]
    k = math.prod(shape[a] for a in width)
    out = []
    for p in slice_paths(path, shape, list(rows), list(width)):
        seed = layer_seed(BASE, step, p)
        words = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
        out.append(np.asarray(_projection_from_words(words, RANK, k, dist), np.float64))
    return out


def ref_row_adam(s, v, t, variant, b2, eps):
    """One literal docs/method.md §4 step for one layer: s [d, r], v [d] → (D, v)."""
    if variant == "sgd":
        return s, v
    v = b2 * v + (1 - b2) * np.mean(s ** 2, axis=1)
    rho = np.sqrt(v / (1 - b2 ** t))
    if variant == "nemo":
        return s / (rho + eps)[:, None], v
    den = rho + max(eps * rho.mean(), TINY)
    scale = 1.0 / den
    scale = scale / np.sqrt(np.mean(scale ** 2))
    d_tilde = scale[:, None] * s
    norm = np.linalg.norm(d_tilde)
    return (d_tilde * np.linalg.norm(s) / norm if norm > 0 else 0 * s), v


def bf16(x):
    return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)


class Reference:
    """The whole LoGRA step in float64 numpy, one layer at a time."""

    def __init__(self, params, variant, dist, refresh, b2=0.95, eps=1e-8, ratio=1e-2, lr=None, wd=0.0,
                 round_bf16=False):
        self.w = {p: np.asarray(get(params, p), np.float64) for p in SHAPES if p.split(".")[0] in params}
        self.norm = np.asarray(params["norm"], np.float64)
        self.v = {p: None for p in self.w}
        self.variant, self.dist, self.refresh = variant, dist, refresh
        self.b2, self.eps, self.ratio, self.lr, self.wd, self.round = b2, eps, ratio, lr, wd, round_bf16
        self.step = 0

    def sketches(self, grads):
        out = {}
        for p, g in grads.items():
            rows, width = DIMS[p]
            a = ref_projections(p, self.step if self.refresh else 0, self.dist)
            out[p] = [gm @ al.T for gm, al in zip(to_mats(g, list(rows), list(width)), a)]
        return out

    def directions(self, sketches):
        out = {}
        for p, ss in sketches.items():
            if self.v[p] is None:
                self.v[p] = [np.zeros(s.shape[0]) for s in ss]
            res = [ref_row_adam(s, v, self.step + 1, self.variant, self.b2, self.eps) for s, v in zip(ss, self.v[p])]
            out[p] = [r[0] for r in res]
            self.v[p] = [r[1] for r in res]
        return out

    def factor(self, directions):
        step = self.step if self.refresh else 0
        w_sq = sum(np.sum(w ** 2) for w in self.w.values())
        da_sq = sum(np.sum((d @ a) ** 2) for p, ds in directions.items()
                    for d, a in zip(ds, ref_projections(p, step, self.dist)))
        return self.ratio * np.sqrt(w_sq / da_sq)

    def apply(self, directions, coef):
        """W ← (1 − c) W − coef·D A per layer (c = lr·wd for nemo)."""
        step = self.step if self.refresh else 0
        for p, ds in directions.items():
            rows, width = DIMS[p]
            mats = to_mats(self.w[p], list(rows), list(width))
            a = ref_projections(p, step, self.dist)
            new = []
            for m, d, al in zip(mats, ds, a):
                u = -coef * d
                u = bf16(u) if self.round else u
                decay = -self.lr * self.wd if self.lr is not None else 0.0
                new.append((1 + decay) * m + u @ al)
            self.w[p] = from_mats(np.stack(new), SHAPES[p], list(rows), list(width))
        self.step += 1


# Every variant with both distributions and both refresh settings (each pair of factors covered).
@pytest.mark.parametrize("variant, dist, refresh", [
    ("paper", "rademacher", True), ("paper", "gaussian", False), ("nemo", "rademacher", False),
    ("nemo", "gaussian", True), ("sgd", "rademacher", True), ("sgd", "gaussian", False)])
def test_each_stage_matches_numpy_over_three_steps(variant, dist, refresh):
    rng = np.random.default_rng(0)
    paths = ("stack.w", "q_einsum")  # a stacked Flax kernel and a kernel with two row axes
    params = make_params(rng, paths)
    ref = Reference(params, variant, dist, refresh)
    sketch = scale_by_sketch(RANK, BASE, dist, refresh, RULES)
    row_adam = scale_by_row_adam(variant, 0.95, 1e-8, RULES)
    ratio = scale_by_update_ratio(1e-2)
    neg = scale_lowrank(-1.0)
    states = tuple(tx.init(params) for tx in (sketch, row_adam, ratio, neg))

    def stages(states, grads):  # eager: the library jits its per-target kernels itself
        s_upd, st0 = sketch.update(grads, states[0])
        d_upd, st1 = row_adam.update(s_upd, states[1])
        r_upd, st2 = ratio.update(d_upd, states[2], params)
        n_upd, st3 = neg.update(r_upd, states[3])
        return (s_upd, d_upd, r_upd, n_upd), (st0, st1, st2, st3)

    for _ in range(3):
        g = make_grads(rng, paths)
        grads = as_tree(g, rng.normal(size=12))
        (s_upd, d_upd, r_upd, n_upd), states = stages(states, grads)
        s_ref = ref.sketches(g)
        for p in paths:
            u = get(s_upd, p)
            assert isinstance(u, LowRankUpdate) and int(u.step) == ref.step
            got = np.asarray(u.factor).reshape(len(s_ref[p]), -1, RANK)
            np.testing.assert_allclose(got, np.stack(s_ref[p]), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(s_upd["norm"], grads["norm"])  # non-targets pass through

        d_ref = ref.directions(s_ref)
        for p in paths:
            got = np.asarray(get(d_upd, p).factor).reshape(len(d_ref[p]), -1, RANK)
            np.testing.assert_allclose(got, np.stack(d_ref[p]), rtol=2e-5, atol=1e-6 * np.abs(got).max())
            if variant != "sgd":
                v = np.asarray(get(states[1].row_moment, p)).reshape(len(d_ref[p]), -1)
                np.testing.assert_allclose(v, np.stack(ref.v[p]), rtol=2e-5)

        coef = ref.factor(d_ref)
        for p in paths:
            got = np.asarray(get(n_upd, p).factor).reshape(len(d_ref[p]), -1, RANK)
            np.testing.assert_allclose(got, -coef * np.stack(d_ref[p]), rtol=5e-5, atol=1e-6 * np.abs(got).max())
            np.testing.assert_allclose(get(r_upd, p).factor, -get(n_upd, p).factor)
        np.testing.assert_array_equal(n_upd["norm"], -grads["norm"])
        ref.step += 1
    assert int(states[0].count) == 3 and int(states[1].count) == 3


@pytest.mark.parametrize("variant, round_bf16", [("paper", True), ("nemo", False)])
def test_logra_alias_matches_numpy_over_three_steps(variant, round_bf16):
    rng = np.random.default_rng(1)
    params = make_params(rng)
    nemo = variant == "nemo"
    kwargs = dict(lr=0.05, weight_decay=0.1) if nemo else dict(update_ratio=1e-2)
    tx = logra(RANK, base_seed=BASE, distribution="gaussian", variant=variant, rules=RULES, round_bf16=round_bf16,
               **kwargs)
    ref = Reference(params, variant, "gaussian", True, ratio=1e-2, lr=0.05 if nemo else None, wd=0.1,
                    round_bf16=round_bf16)
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return apply_updates(params, updates), state

    for _ in range(3):
        g = make_grads(rng)
        old = {p: ref.w[p].copy() for p in SHAPES}
        params, state = step(params, state, as_tree(g, rng.normal(size=12)))
        d_ref = ref.directions(ref.sketches(g))
        ref.apply(d_ref, 0.05 if nemo else ref.factor(d_ref))
        for p in SHAPES:
            delta, delta_ref = np.asarray(get(params, p), np.float64) - old[p], ref.w[p] - old[p]
            # bf16 rounding may fall on the other side of a tie in float32 vs float64: one bf16 ulp (2^-8).
            tol = (2 ** -7 if round_bf16 else 1e-4) * np.abs(delta_ref).max()
            np.testing.assert_allclose(delta, delta_ref, atol=tol)
        np.testing.assert_array_equal(params["norm"], np.asarray(ref.norm, np.float32))  # frozen


@pytest.mark.parametrize("round_bf16, decay", [(False, None), (True, -0.01)])
def test_merge_and_to_dense_match_numpy_with_bf16_rounding_and_decay(round_bf16, decay):
    rng = np.random.default_rng(2)
    params = make_params(rng)
    targets = find_targets(params, RULES)
    factors = {p: jnp.asarray(rng.normal(size=(*t.batch_shape, *t.rows_shape, RANK)), jnp.float32)
               for p, t in targets.items()}

    def merge_and_dense(params, factors):
        out = {}
        for p, t in targets.items():
            u = LowRankUpdate(factors[p], 5, target=t, spec=SketchSpec(rank=RANK, base_seed=BASE,
                              distribution="rademacher", refresh=True, round_bf16=round_bf16),
                              decay=None if decay is None else jnp.float32(decay))
            out[p] = (u.merge(get(params, p)), u.to_dense(get(params, p)))
        return out

    out = merge_and_dense(params, factors)
    c = 0.0 if decay is None else decay
    for p in SHAPES:
        rows, width = DIMS[p]
        w = np.asarray(get(params, p), np.float64)
        f = np.asarray(factors[p], np.float64).reshape(len(ref_projections(p, 5, "rademacher")), -1, RANK)
        f = bf16(f) if round_bf16 else f
        delta = np.stack([fi @ ai for fi, ai in zip(f, ref_projections(p, 5, "rademacher"))])
        delta = from_mats(delta, SHAPES[p], list(rows), list(width))
        merged, dense = out[p]
        np.testing.assert_allclose(merged, (1 + c) * w + delta, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dense, c * w + delta, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(get(params, p)) + np.asarray(dense), merged, rtol=1e-6, atol=1e-6)


def test_update_ratio_invariant_and_zero_sketch():
    """Σ‖ΔW‖² / Σ‖W‖² = ratio² over targets only (independent of the Gram-matrix trick); S = 0 gives D = 0."""
    rng = np.random.default_rng(3)
    params = make_params(rng)
    tx = optax.chain(scale_by_sketch(RANK, BASE, rules=RULES), scale_by_row_adam("paper", rules=RULES),
                     scale_by_update_ratio(0.03))

    def run(grads):
        updates, _ = tx.update(grads, tx.init(params), params)
        return {p: get(updates, p).to_dense() for p in SHAPES}

    dense = run(as_tree(make_grads(rng), np.ones(12)))
    delta_sq = sum(float(jnp.sum(dense[p] ** 2)) for p in SHAPES)
    weight_sq = sum(float(jnp.sum(get(params, p) ** 2)) for p in SHAPES)
    assert math.isclose(math.sqrt(delta_sq / weight_sq), 0.03, rel_tol=1e-4)
    zero = run(jax.tree.map(jnp.zeros_like, params))
    for p in SHAPES:
        assert bool(jnp.all(zero[p] == 0)), p


@pytest.mark.parametrize("variant, round_bf16, rounds", [
    ("paper", None, True), ("sgd", None, True), ("nemo", None, False),  # each variant's own wire format
    ("paper", False, False), ("nemo", True, True),  # an explicit value overrides it
])
def test_round_bf16_defaults_to_the_variants_convention(variant, round_bf16, rounds):
    rng = np.random.default_rng(4)
    params = make_params(rng)
    kwargs = dict(lr=0.05) if variant == "nemo" else dict(update_ratio=1e-2)
    if round_bf16 is not None:
        kwargs["round_bf16"] = round_bf16
    tx = logra(RANK, base_seed=BASE, distribution="gaussian", variant=variant, rules=RULES, **kwargs)
    updates, _ = tx.update(as_tree(make_grads(rng), rng.normal(size=12)), tx.init(params), params)
    new = apply_updates(params, updates)
    for p in SHAPES:
        rows, width = DIMS[p]
        a = ref_projections(p, 0, "gaussian")
        factor = np.asarray(get(updates, p).factor, np.float64).reshape(len(a), -1, RANK)

        def merged(f, p=p, a=a, rows=rows, width=width):
            return np.asarray(get(params, p), np.float64) + from_mats(
                np.stack([fi @ ai for fi, ai in zip(f, a)]), SHAPES[p], list(rows), list(width))

        expected, other = (merged(bf16(factor)), merged(factor)) if rounds else (merged(factor), merged(bf16(factor)))
        got = np.asarray(get(new, p), np.float64)
        err, gap = np.abs(got - expected).max(), np.abs(other - expected).max()
        assert err < gap / 20, (p, err, gap)  # the two wire formats are told apart by far more than float32 error


def test_round_bf16_is_validated():
    with pytest.raises(TypeError, match="round_bf16 must be a bool or None"):
        logra(RANK, rules=RULES, round_bf16="yes")


def test_layer_scope_moves_every_layer_by_the_ratio():
    """scope="layer": ‖ΔW_l‖ / ‖W_l‖ = ratio for every layer of every target (the stacked target's 3 slices and
    the two unbatched 3-D einsum kernels), computed from the dense ΔW = D·A, not the Gram-matrix trick."""
    rng = np.random.default_rng(4)
    params = make_params(rng)
    tx = optax.chain(scale_by_sketch(RANK, BASE, rules=RULES), scale_by_row_adam("paper", rules=RULES),
                     scale_by_update_ratio(0.03, scope="layer"))
    grads = make_grads(rng)
    grads = as_tree({p: g * s for (p, g), s in zip(grads.items(), (1.0, 100.0, 1e-3))}, np.ones(12))
    updates, _ = tx.update(grads, tx.init(params), params)
    slices = {"stack.w": [(i,) for i in range(3)], "q_einsum": [()], "o_einsum": [()]}
    for p, index in slices.items():
        dense = np.asarray(get(updates, p).to_dense())
        for i in index:
            ratio = np.linalg.norm(dense[i]) / np.linalg.norm(np.asarray(get(params, p))[i])
            assert math.isclose(ratio, 0.03, rel_tol=1e-4), (p, i, ratio)
    with pytest.raises(ValueError, match="scope"):
        scale_by_update_ratio(0.03, scope="row")
