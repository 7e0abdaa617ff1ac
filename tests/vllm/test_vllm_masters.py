"""The PyTorch receiver of low-rank sync (logra_jax.rollout.vllm.extension, what runs inside vLLM) against the trainer's
JAX merge: many updates (bf16-rounded factors, decay, a dense leaf, refresh period), the version chain and the
corruption/gap repair, and the Hugging Face tensors it hands vLLM against models.hf's export. No vLLM needed."""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.models.hf import _export_tensors
from logra_jax.optim import LowRankUpdate, apply_updates, find_targets
from logra_jax.optim.spec import SketchSpec
from logra_jax.rollout.sync import _sealed, delta_payload, flat_params, snapshot_payload
from logra_jax.rollout.vllm.engine import hf_table

# torch and the receiver (which imports it) are imported by the tests, not at collection, and the module runs on
# the one worker that imports torch (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")


@pytest.fixture(scope="module")
def ext(torch):  # the `torch` fixture: tests/vllm/conftest.py
    return importlib.import_module("logra_jax.rollout.vllm.extension")

RANK = 4
NORM = "blocks.norm.scale"


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {"blocks": {"attn": {"q_proj": {"kernel": jax.random.normal(k[0], (2, 16, 24))}},
                       "mlp": {"up_proj": {"kernel": jax.random.normal(k[1], (2, 16, 40))}},
                       "norm": {"scale": 1.0 + jax.random.normal(k[2], (2, 16))}},
            "embed": jax.random.normal(k[3], (32, 16))}


TARGETS = find_targets(_params())


@functools.partial(jax.jit, static_argnames=("spec", "decay"))
def _step(params, key, step, *, spec, decay):
    keys = jax.random.split(key, len(TARGETS) + 1)

    def leaf(path, p):
        if path in TARGETS:
            t = TARGETS[path]
            i = list(TARGETS).index(path)
            u = 1e-2 * jax.random.normal(keys[i], (*t.batch_shape, t.d, spec.rank_for(path)))
            return LowRankUpdate(u, step, target=t, spec=spec, decay=jnp.float32(-1e-2) if decay else None)
        if path == NORM:
            return 1e-3 * jax.random.normal(keys[-1], p.shape)
        return jnp.zeros_like(p)

    updates = jax.tree_util.tree_map_with_path(lambda k, p: leaf(".".join(x.key for x in k), p), params)
    return apply_updates(params, updates), updates


@pytest.mark.parametrize("round_bf16,decay,distribution,refresh_every,rank_rules",
                         [(False, False, "rademacher", 1, ""), (True, True, "gaussian", 3, ""),
                          (True, False, "rademacher", 1, "up_proj=2")])  # per-target ranks: up_proj 2, q_proj 4
def test_torch_masters_follow_the_trainer(round_bf16, decay, distribution, refresh_every, rank_rules, ext):
    spec = SketchSpec(rank=RANK, base_seed=7, round_bf16=round_bf16, distribution=distribution,
                      refresh_every=refresh_every, rank_rules=rank_rules)
    params = _params()
    masters = ext.TorchMasters({p: a.shape for p, a in flat_params(params).items()})
    reply, changed = masters.receive(snapshot_payload(params, 0).to_bytes())
    assert reply["status"] == "loaded" and set(changed) == set(flat_params(params))
    for version in range(1, 9):
        params, updates = _step(params, jax.random.key(version), version, spec=spec, decay=decay)
        payload = delta_payload(updates, params, version, trained=[NORM])
        assert {p: f.factor.shape[-1] for p, f in payload.factors.items()} == {p: spec.rank_for(p) for p in TARGETS}
        reply, changed = masters.receive(payload.to_bytes())
        assert (reply["status"], reply["version"]) == ("applied", version), reply
        assert set(changed) == {*TARGETS, NORM}
    for path, want in jax.device_get(flat_params(params)).items():
        got = masters.params[path].numpy()
        # torch's U·A may round differently from XLA's: a few float32 ulp of the weights after 8 updates
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-6 * np.abs(want).max(), err_msg=path)
    assert not np.array_equal(masters.params["embed"].numpy(), np.zeros((32, 16)))


def test_chain_rules_and_corruption(ext):
    spec = SketchSpec(rank=RANK, base_seed=7)
    params0 = _params()
    masters = ext.TorchMasters({p: a.shape for p, a in flat_params(params0).items()})
    params1, up1 = _step(params0, jax.random.key(1), 1, spec=spec, decay=False)
    params2, up2 = _step(params1, jax.random.key(2), 2, spec=spec, decay=False)
    d1 = delta_payload(up1, params1, 1, trained=[NORM]).to_bytes()
    d2 = delta_payload(up2, params2, 2, trained=[NORM]).to_bytes()
    assert masters.receive(d1)[0]["status"] == "resync"  # before any snapshot
    masters.receive(snapshot_payload(params0, 0).to_bytes())
    assert masters.receive(d2)[0]["reason"].startswith("version gap")
    corrupt = bytearray(d1)
    corrupt[-3] ^= 0x10
    reply, changed = masters.receive(bytes(corrupt))
    assert reply["status"] == "resync" and "checksum" in reply["reason"] and changed == []
    assert masters.version == 0
    assert masters.receive(d1)[0]["status"] == "applied"
    assert masters.receive(d1)[0]["status"] == "stale"
    assert masters.receive(snapshot_payload({**params0, "embed": params0["embed"][:4]}, 3).to_bytes()
                           )[0]["status"] == "resync"
    assert masters.counts == {"applied": 1, "loaded": 1, "stale": 1, "resync": 4}
    idx = {"embed": np.array([0, 5, 511])}
    np.testing.assert_array_equal(masters.probe(idx)["embed"], np.asarray(params1["embed"]).reshape(-1)[idx["embed"]])


def test_hf_tensors_equal_export(ext, torch):
    """The table the trainer sends + hf_tensors give the very tensors models.hf.export writes (interleaved RoPE)."""
    config = dataclasses.replace(preset("tiny"), rope_interleaved=True)
    model = init_model(config, seed=1)
    table = hf_table(config)
    from flax import nnx
    leaves = {p: torch.from_numpy(np.array(a)) for p, a in flat_params(nnx.state(model, nnx.Param)).items()}
    got = {name: t for p, w in leaves.items() for name, t in ext.hf_tensors(table, p, w)}
    want = {name: produce() for name, _, produce in _export_tensors(model)}
    assert set(got) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name].numpy(), w, err_msg=name)


def test_a_factor_whose_rank_is_not_its_metas_asks_for_a_resync(ext):
    spec = SketchSpec(rank=RANK, base_seed=7, rank_rules="up_proj=2")
    params0 = _params()
    masters = ext.TorchMasters({p: a.shape for p, a in flat_params(params0).items()})
    masters.receive(snapshot_payload(params0, 0).to_bytes())
    params1, up1 = _step(params0, jax.random.key(1), 1, spec=spec, decay=False)
    payload = delta_payload(up1, params1, 1)
    up = "blocks.mlp.up_proj.kernel"
    wrong = {**payload.factors, up: dataclasses.replace(payload.factors[up], spec=SketchSpec(rank=3, base_seed=7))}
    reply, changed = masters.receive(_sealed(**{f.name: getattr(payload, f.name) for f in dataclasses.fields(payload)
                                                if f.name not in ("checksum", "factors")}, factors=wrong).to_bytes())
    assert reply["status"] == "resync" and changed == [] and masters.version == 0
    assert f"target '{up}': factor of shape (2, 40, 2), its meta (rank 3) announces (2, 40, 3)" in reply["reason"]
    assert masters.receive(payload.to_bytes())[0]["status"] == "applied"
