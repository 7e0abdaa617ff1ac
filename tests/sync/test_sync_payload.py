"""Sync payloads in one process: framing, checksum and merge against numpy references; version rules; the weight
fingerprint on the wire (the fingerprint itself: tests/ckpt/test_ckpt_fingerprint.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.core.fingerprint import tree_fingerprint
from logra_jax.optim.lowrank import LowRankUpdate, apply_updates
from logra_jax.optim.projection import target_projection
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import find_targets
from logra_jax.rollout.sync import (
    PayloadError,
    PolicySync,
    SyncError,
    SyncPayload,
    delta_payload,
    flat_params,
    pack,
    snapshot_payload,
    unpack,
)
from logra_jax.rollout.worker import RolloutWeights

RANK = 4
NORM = "blocks.norm.scale"


def _params(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {"blocks": {"attn": {"q_proj": {"kernel": jax.random.normal(k[0], (2, 16, 24))}},
                       "mlp": {"up_proj": {"kernel": jax.random.normal(k[1], (2, 16, 40))}},
                       "norm": {"scale": 1.0 + jax.random.normal(k[2], (2, 16))}},
            "embed": jax.random.normal(k[3], (32, 16))}


TARGETS = find_targets(_params())


@functools.partial(jax.jit, static_argnames=("round_bf16", "decay", "dense"))
def _trainer_step(params, factors, step, norm_update, *, round_bf16, decay, dense):
    """The trainer's update: low-rank targets (optionally decayed), a densely trained norm, the rest frozen."""
    def leaf(path, p):
        if path in TARGETS:
            c = jnp.float32(-1e-2) if decay else None
            return LowRankUpdate(factors[path] * 0.5, step, target=TARGETS[path],
                                 spec=SketchSpec(rank=RANK, base_seed=42, round_bf16=round_bf16), decay=c)
        if path == NORM and dense:
            return norm_update
        return jnp.zeros_like(p)

    updates = jax.tree_util.tree_map_with_path(lambda k, p: leaf(".".join(x.key for x in k), p), params)
    return apply_updates(params, updates), updates


def _factors(seed):
    keys = jax.random.split(jax.random.key(100 + seed), len(TARGETS))
    return {p: 1e-2 * jax.random.normal(k, (*t.batch_shape, t.d, RANK)) for (p, t), k in zip(TARGETS.items(), keys)}


def _bits(x):
    return np.asarray(x).view(np.uint32)


def _reference_merge(w, u, c, target, step, round_bf16):
    """float64 numpy: K_l ← (1 + c) K_l + (round(U_l) A_l)ᵀ per layer l (K = Wᵀ in Flax layout)."""
    a = np.asarray(target_projection(target, 42, step, RANK), np.float64)  # [L, r, k]
    u = np.asarray(u, np.float32)
    u = (u.astype(jnp.bfloat16) if round_bf16 else u).astype(np.float64)
    return (1.0 + c) * np.asarray(w, np.float64) + np.einsum("ldr,lrk->lkd", u, a)


def test_pack_round_trip_every_dtype():
    arrays = {"f": np.arange(6, dtype=np.float32).reshape(2, 3), "h": np.array([1.5, -2.0], jnp.bfloat16),
              "i": np.array([-3, 7], np.int32), "u": np.array([2**32 - 1], np.uint32),
              "b": np.array([[True, False]]), "s": np.array(3.25, np.float32), "e": np.zeros((0, 4), np.float32)}
    meta, got = unpack(pack({"x": [1, "a"]}, arrays))
    assert meta == {"x": [1, "a"]}
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        np.testing.assert_array_equal(got[name].reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8))
    with pytest.raises(TypeError, match="unsupported dtype"):
        pack({}, {"c": np.zeros(2, np.complex64)})


def test_every_flipped_byte_and_truncation_is_rejected():
    params = _params()
    new, updates = _trainer_step(params, _factors(0), jnp.int32(3), jnp.ones((2, 16)), round_bf16=True,
                                 decay=True, dense=True)
    payload = delta_payload(updates, new, 4, trained=[NORM])
    data = payload.to_bytes()
    assert len(data) == payload.nbytes
    SyncPayload.from_bytes(data).verify()
    assert SyncPayload.from_bytes(data).fingerprint == payload.fingerprint == tree_fingerprint(new)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 1 << (i % 8)
        with pytest.raises(PayloadError):
            SyncPayload.from_bytes(bytes(bad)).verify()
    for cut in (0, 7, 15, 200, len(data) - 1):
        with pytest.raises(PayloadError):
            SyncPayload.from_bytes(data[:cut]).verify()


@pytest.mark.parametrize("round_bf16,decay,dense", [(True, False, False), (False, False, False),
                                                    (True, True, True)])
def test_rollout_weights_stay_bitwise_equal_and_match_numpy_merge(round_bf16, decay, dense):
    params = _params()
    rollout = RolloutWeights(jax.eval_shape(lambda: params))
    sync = PolicySync(rollout.receive, params, trained=[NORM] if dense else ())
    for step in range(4):
        factors = _factors(step)
        old = params
        params, updates = _trainer_step(params, factors, jnp.int32(step), 1e-3 * jnp.full((2, 16), step + 1.0),
                                        round_bf16=round_bf16, decay=decay, dense=dense)
        report = sync.push(updates, params)
        assert report.reply.status == "applied" and report.resync_reason == "" and report.version == step + 1
        mine = flat_params(rollout.params)
        for path, w in flat_params(params).items():
            np.testing.assert_array_equal(_bits(mine[path]), _bits(w), err_msg=path)
        for path, t in TARGETS.items():
            want = _reference_merge(flat_params(old)[path], 0.5 * np.asarray(factors[path]),
                                    -1e-2 if decay else 0.0, t, step, round_bf16)
            np.testing.assert_allclose(mine[path], want, rtol=1e-5, atol=1e-6)
        norm_change = np.asarray(mine[NORM]) - np.asarray(flat_params(old)[NORM])
        np.testing.assert_allclose(norm_change, 1e-3 * (step + 1) if dense else 0.0, atol=1e-6)
    assert rollout.counts == {"applied": 4, "loaded": 1, "stale": 0, "resync": 0} and sync.resyncs == 0


def test_delta_carries_the_merge_rounding_and_its_size():
    params = _params()
    factors = _factors(1)
    for round_bf16, dtype in ((True, jnp.bfloat16), (False, np.float32)):
        new, updates = _trainer_step(params, factors, jnp.int32(5), jnp.zeros((2, 16)), round_bf16=round_bf16,
                                     decay=False, dense=False)
        payload = delta_payload(updates, new, 1)
        assert payload.dense == {} and payload.weights == {} and payload.parent == 0
        for path, f in payload.factors.items():
            want = (0.5 * np.asarray(factors[path])).astype(dtype)  # numpy's own rounding (ml_dtypes), not XLA's
            assert f.factor.dtype == want.dtype and f.step == 5 and f.spec.rank == RANK
            np.testing.assert_array_equal(f.factor.view(np.uint8), want.view(np.uint8))
        factor_bytes = sum(2 * RANK * t.d * t.num_slices for t in TARGETS.values()) * (1 if round_bf16 else 2)
        assert factor_bytes < payload.nbytes < factor_bytes + 2048  # the JSON header stays small


def test_version_chain_rules():
    params = _params()
    rollout = RolloutWeights(jax.eval_shape(lambda: params))
    p1, u1 = _trainer_step(params, _factors(0), jnp.int32(0), jnp.zeros((2, 16)), round_bf16=True, decay=False,
                           dense=False)
    p2, u2 = _trainer_step(p1, _factors(1), jnp.int32(1), jnp.zeros((2, 16)), round_bf16=True, decay=False,
                           dense=False)
    d1, d2 = delta_payload(u1, p1, 1), delta_payload(u2, p2, 2)
    assert rollout.receive(d1).status == "resync"  # nothing to apply it to yet
    assert rollout.receive(snapshot_payload(params, 0))[:3] == ("loaded", 0, "")
    reply = rollout.receive(d2)
    assert reply.status == "resync" and "gap" in reply.reason and reply.version == 0
    assert rollout.receive(d1.to_bytes())[:3] == ("applied", 1, "")
    assert rollout.receive(d1).status == "stale"
    assert rollout.receive(d2).status == "applied"
    # Trainer weights that the deltas do not explain (drift): the fingerprint catches it, a snapshot repairs it.
    drifted = jax.tree.map(lambda x: x, p2)
    drifted["embed"] = p2["embed"].at[3, 4].add(1e-3)
    sync = PolicySync(rollout.receive, p2, version=2)
    _, u3 = _trainer_step(p2, _factors(2), jnp.int32(2), jnp.zeros((2, 16)), round_bf16=True, decay=False,
                          dense=False)
    p3 = jax.jit(apply_updates)(drifted, u3)
    report = sync.push(u3, p3)
    assert "fingerprint mismatch" in report.resync_reason and "embed" in report.resync_reason
    assert report.reply[:3] == ("loaded", 3, "") and sync.resyncs == 1
    np.testing.assert_array_equal(_bits(flat_params(rollout.params)["embed"]), _bits(p3["embed"]))
    # A snapshot the engine cannot hold (another model) is rejected, and the trainer gives up loudly.
    with pytest.raises(SyncError, match="refused"):
        PolicySync(rollout.receive, {"other": jnp.zeros(3)})


def test_payload_arguments_are_checked():
    params = _params()
    _, updates = _trainer_step(params, _factors(0), jnp.int32(0), jnp.zeros((2, 16)), round_bf16=True,
                               decay=False, dense=False)
    with pytest.raises(ValueError, match="version"):
        delta_payload(updates, params, 0)
    with pytest.raises(ValueError, match=r"trained path 'blocks\.attn\.q_proj\.kernel'"):
        delta_payload(updates, params, 1, trained=["blocks.attn.q_proj.kernel"])
    with pytest.raises(ValueError, match="trained path 'nope'"):
        delta_payload(updates, params, 1, trained=["nope"])
    with pytest.raises(ValueError, match="version"):
        snapshot_payload(params, -1)
