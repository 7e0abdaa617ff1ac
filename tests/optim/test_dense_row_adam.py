"""Dense RowAdam (LoGRA's preconditioner and step rule with no sketch) against a numpy loop over 3 steps."""

import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.optim.dense_row_adam import scale_by_dense_row_adam


def _numpy_reference(grads, weights, ratio, b2=0.95, eps=1e-8, steps=3):
    """grads: list over steps of {name: [L, k, d] (in, out)}; returns the list of updates (same layout)."""
    tiny = np.finfo(np.float32).tiny
    v = {n: np.zeros((w.shape[0], w.shape[2])) for n, w in weights.items()}
    out = []
    for t in range(1, steps + 1):
        directions = {}
        for n, g in grads[t - 1].items():
            layers = []
            for i in range(g.shape[0]):
                s = g[i].T  # [d, k]: rows are output features
                v[n][i] = b2 * v[n][i] + (1 - b2) * np.mean(s**2, axis=1)
                rho = np.sqrt(v[n][i] / (1 - b2**t))
                den = rho + max(eps * rho.mean(), tiny)
                scale = 1 / den
                scale = scale / np.sqrt(np.mean(scale**2))
                d_tilde = scale[:, None] * s
                layers.append((d_tilde * np.linalg.norm(s) / np.linalg.norm(d_tilde)).T)
            directions[n] = np.stack(layers)
        w_sq = sum(np.sum(w**2) for w in weights.values())
        d_sq = sum(np.sum(d**2) for d in directions.values())
        out.append({n: ratio * np.sqrt(w_sq / d_sq) * d for n, d in directions.items()})
    return out


def test_dense_row_adam_equals_numpy_loop():
    rng = np.random.default_rng(0)
    weights = {"q_proj": rng.normal(size=(2, 6, 5)), "down_proj": rng.normal(size=(2, 4, 6))}
    params = {"blocks": {name: {"kernel": jnp.asarray(w, jnp.float32)} for name, w in weights.items()},
              "norm": {"scale": jnp.ones(6)}}
    # Rows of very different scales: the row moment must equalise them.
    grads = [{n: rng.normal(size=w.shape) * rng.uniform(0.01, 10, size=(1, 1, w.shape[2]))
              for n, w in weights.items()} for _ in range(3)]
    tx = scale_by_dense_row_adam(update_ratio=1e-2)
    state = tx.init(params)
    want = _numpy_reference(grads, weights, 1e-2)
    for step in range(3):
        g = {"blocks": {n: {"kernel": jnp.asarray(x, jnp.float32)} for n, x in grads[step].items()},
             "norm": {"scale": jnp.full(6, 7.0)}}
        updates, state = tx.update(g, state, params)
        for n in weights:
            np.testing.assert_allclose(np.asarray(updates["blocks"][n]["kernel"]), want[step][n], rtol=2e-5,
                                       atol=1e-9)
        np.testing.assert_array_equal(np.asarray(updates["norm"]["scale"]), 7.0)  # non-targets pass through
        total = np.sqrt(sum(np.sum(np.asarray(updates["blocks"][n]["kernel"]) ** 2) for n in weights))
        assert abs(total / np.sqrt(sum(np.sum(w**2) for w in weights.values())) - 1e-2) < 1e-7
    assert int(state.count) == 3


@pytest.mark.parametrize(("kwargs", "name"), [({"update_ratio": 0.0}, "update_ratio"),
                                              ({"variant": "nemo"}, "variant"), ({"b2": 1.0}, "b2")])
def test_dense_row_adam_rejects_bad_settings(kwargs, name):
    with pytest.raises(ValueError, match=name):
        scale_by_dense_row_adam(**kwargs)
