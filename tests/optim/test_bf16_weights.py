"""bfloat16 weight storage (`optimizer.weight_dtype="bfloat16"`): the stochastic rounding is unbiased and lands on
a neighbour of the exact float32 sum, the low-rank merge of a bfloat16 weight is reproducible bit for bit from
(update, step, path) and keeps updates far below bfloat16's spacing on average (round-to-nearest loses them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.job.run_config import RunConfig
from logra_jax.optim import apply_updates, logra
from logra_jax.optim.lowrank import LowRankUpdate, stochastic_round_bf16
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import find_targets


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values just below and above each float32 (equal when x is one), by truncating its bits."""
    bits = x.astype(np.float32).view(np.uint32)
    down = (bits & np.uint32(0xFFFF0000)).view(np.float32)
    up = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000) * ((bits & 0xFFFF) != 0)).view(np.float32)
    return np.minimum(down, up), np.maximum(down, up)  # magnitude truncation: swap for negative values


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    x = np.asarray(jax.random.normal(jax.random.key(1), (512,), jnp.float32)) * np.float32(3.0)
    lo, hi = _neighbours(x)
    draws = np.stack([np.asarray(stochastic_round_bf16(jnp.asarray(x), jax.random.key(k)).astype(jnp.float32))
                      for k in range(400)])
    assert np.all((draws == lo) | (draws == hi))
    # E[y] = x: the mean of 400 draws is within 5 standard errors of x, element by element
    spread = (hi - lo) * 0.5 / np.sqrt(400) + 1e-30
    assert np.all(np.abs(draws.mean(0) - x) <= 5 * spread)
    np.testing.assert_array_equal(draws[7], np.asarray(stochastic_round_bf16(jnp.asarray(x), jax.random.key(7))
                                                       .astype(jnp.float32)))  # same key, same bits
    special = jnp.asarray([jnp.inf, -jnp.inf, jnp.nan, 0.0], jnp.float32)
    out = stochastic_round_bf16(special, jax.random.key(0)).astype(jnp.float32)
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2]) and out[3] == 0


def _update(params, factor_scale: float, step: int, stochastic: bool = True, refresh: bool = True,
            **spec: object) -> dict:
    t = find_targets(params)["q_proj.kernel"]
    factor = factor_scale * jax.random.normal(jax.random.key(3), (t.d, 4), jnp.float32)
    spec = SketchSpec(rank=4, base_seed=5, stochastic_round=stochastic, refresh=refresh, **spec)
    return {"q_proj": {"kernel": LowRankUpdate(factor, step, target=t, spec=spec)}}


def test_bf16_merge_rounds_the_float32_sum_to_a_neighbour_reproducibly():
    w32 = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32) * 0.05
    params = {"q_proj": {"kernel": w32.astype(jnp.bfloat16)}}
    update = _update(params, 1e-3, step=4)
    merged = apply_updates(params, update)["q_proj"]["kernel"]
    assert merged.dtype == jnp.bfloat16
    exact = np.asarray(params["q_proj"]["kernel"].astype(jnp.float32) + update["q_proj"]["kernel"].to_dense())
    lo, hi = _neighbours(exact)
    got = np.asarray(merged.astype(jnp.float32))
    assert np.all((got == lo) | (got == hi))
    assert np.mean(got != np.asarray(jnp.asarray(exact).astype(jnp.bfloat16).astype(jnp.float32))) > 0.05
    # the rollout engine applying the same update to the same weights gets the same bits; another step does not,
    # even with the projection held (refresh=False: the same float32 sum), so the rounding key follows the step
    np.testing.assert_array_equal(np.asarray(apply_updates(params, update)["q_proj"]["kernel"]), np.asarray(merged))
    held = [_update(params, 1e-3, step=step, refresh=False) for step in (4, 5)]
    np.testing.assert_array_equal(*(np.asarray(u["q_proj"]["kernel"].to_dense()) for u in held))
    fours, fives = (np.asarray(apply_updates(params, u)["q_proj"]["kernel"]) for u in held)
    assert np.mean(fours != fives) > 0.05
    # without spec.stochastic_round a bfloat16 weight rounds to nearest, as optax.apply_updates does
    nearest = apply_updates(params, _update(params, 1e-3, step=4, stochastic=False))["q_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(nearest), np.asarray(jnp.asarray(exact).astype(jnp.bfloat16)))


def test_the_pallas_merge_runs_under_stochastic_rounding(monkeypatch):
    """implementation="pallas" with stochastic rounding merges with the Pallas kernel (the float32 sum), then
    rounds: a neighbour of the exact sum, equal to the XLA merge's bits wherever the two float32 sums agree."""
    import logra_jax.optim.lowrank as lowrank

    kernels = []
    real = lowrank.merge_kernel
    monkeypatch.setattr(lowrank, "merge_kernel", lambda *a, **k: kernels.append(a[0].dtype) or real(*a, **k))
    w32 = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32) * 0.05
    params = {"q_proj": {"kernel": w32.astype(jnp.bfloat16)}}
    xla = _update(params, 1e-3, step=6)
    pallas = _update(params, 1e-3, step=6, implementation="pallas", interpret=True)
    got = np.asarray(apply_updates(params, pallas)["q_proj"]["kernel"].astype(jnp.float32))
    assert kernels == [jnp.float32]  # the Pallas kernel ran, on the slice widened to float32
    exact = np.asarray(params["q_proj"]["kernel"].astype(jnp.float32) + xla["q_proj"]["kernel"].to_dense())
    lo, hi = _neighbours(exact)
    assert np.all((got == lo) | (got == hi))
    want = np.asarray(apply_updates(params, xla)["q_proj"]["kernel"].astype(jnp.float32))
    assert np.mean(got == want) > 0.99


def test_updates_below_bf16_spacing_survive_on_average():
    """200 steps each 1/50 of bfloat16's spacing: round-to-nearest never moves the weight, the stochastic merge
    moves it by the sum of the steps (mean over the matrix, within 10%)."""
    w = jnp.ones((64, 48), jnp.float32) * 0.75  # spacing 2^-8 there
    params = {"q_proj": {"kernel": w.astype(jnp.bfloat16)}}
    t = find_targets(params)["q_proj.kernel"]
    spec = SketchSpec(rank=4, base_seed=5, refresh=False, stochastic_round=True)  # one projection: steps add up
    factor = jnp.full((t.d, 4), 1.0, jnp.float32)
    delta = LowRankUpdate(factor, 0, target=t, spec=spec).to_dense()
    factor = factor * (2.0 ** -8 / 50) / jnp.mean(jnp.abs(delta))  # |ΔW| ≈ spacing / 50 on average
    merged, nearest = params, params
    total = jnp.zeros_like(w)
    for step in range(200):
        u = LowRankUpdate(factor, step, target=t, spec=spec)
        merged = apply_updates(merged, {"q_proj": {"kernel": u}})
        nearest = {"q_proj": {"kernel": (nearest["q_proj"]["kernel"].astype(jnp.float32) + u.to_dense())
                              .astype(jnp.bfloat16)}}
        total = total + u.to_dense()
    assert np.array_equal(np.asarray(nearest["q_proj"]["kernel"]), np.asarray(params["q_proj"]["kernel"]))
    moved = merged["q_proj"]["kernel"].astype(jnp.float32) - w
    assert float(jnp.mean(jnp.abs(total))) > 2.0 ** -8  # the steps add up to more than one spacing
    assert float(jnp.sum(moved * total) / jnp.sum(total * total)) == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize(("section", "message"), [
    ({"name": "adamw", "weight_dtype": "bfloat16"}, "optimizer.weight_dtype"),
    ({"name": "logra", "non_targets": "adamw", "weight_dtype": "bfloat16"}, "non_targets='frozen'"),
    ({"name": "logra", "weight_dtype": "float16"}, "optimizer.weight_dtype"),
])
def test_weight_dtype_is_validated_at_load(section, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"optimizer": section})


def test_the_dense_route_refuses_stochastic_rounding():
    with pytest.raises(ValueError, match="stochastic_round"):
        logra(spec=SketchSpec(rank=4, stochastic_round=True), dense_updates=True)
