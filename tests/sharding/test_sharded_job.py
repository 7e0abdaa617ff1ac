"""The main job sharded from the first byte (8 fake CPU devices): weights created or read straight into their
shards, equal to the unsharded ones; a checkpoint read slice by slice, each process reading only its devices'
slices; and every phase of the job (start, SFT, the optimizer's init, the first RL step, a restore) leaving every
device with its share of the live arrays — no whole weight on one device."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from logra_jax import models
from logra_jax.models.hf import SafetensorsFile, build_model
from logra_jax.parallel.sharding import MeshConfig, make_mesh
from logra_jax.rollout.engine import decode_config, weight_bytes

REPO = Path(__file__).resolve().parents[2]


def _leaves(model) -> dict[str, jax.Array]:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_sharded_like_rules(model, mesh):
    expected = models.parameter_shardings(model.config, mesh)
    for path, value in _leaves(model).items():
        assert value.sharding.is_equivalent_to(expected[path], value.ndim), (path, value.sharding)


def test_random_init_is_created_in_shards_and_equals_unsharded_init():
    """Bitwise equal to the same jitted init on one device (threefry's bits do not depend on the sharding); the
    eager `init_model` rounds a few of the normal draws one ulp apart (op-by-op vs fused arithmetic)."""
    config = models.preset("tiny")
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
    sharded = models.init_sharded_model(config, mesh, seed=3)
    one = models.init_sharded_model(config, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]), seed=3)
    _assert_sharded_like_rules(sharded, mesh)
    for (path, a), b, c in zip(_leaves(sharded).items(), _leaves(one).values(),
                               _leaves(models.init_model(config, seed=3)).values(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-8, err_msg=path)
    per_device = {d: 0 for d in mesh.devices.flat}
    for value in _leaves(sharded).values():
        for shard in value.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    assert max(per_device.values()) == min(per_device.values())  # every weight of "tiny" splits evenly


@pytest.mark.parametrize("rope_interleaved", [False, True])
def test_checkpoint_is_read_slice_by_slice_into_the_rules_shardings(tmp_path, rope_interleaved):
    """Each parameter is assembled shard by shard from slices of the memory-mapped file (q/k rows through the RoPE
    permutation when the model keeps the interleaved order), equal to the whole-leaf load."""
    config = models.preset("tiny", architecture="qwen2", qkv_bias=True, tie_embeddings=False)
    models.export(models.init_model(config, seed=1), None, tmp_path / "hf")
    config = config.replace(rope_interleaved=rope_interleaved)
    checkpoint = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
    stats = models.LoadStats()
    sharded, _ = build_model(config, checkpoint.get, source="test", shardings=mesh, stats=stats)
    whole, _ = build_model(config, checkpoint.get, source="test")
    _assert_sharded_like_rules(sharded, mesh)
    for (path, a), b in zip(_leaves(sharded).items(), _leaves(whole).values(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    # One process holds every device: each slice is read once (replicated leaves too), the whole file once.
    assert stats.bytes_read == stats.bytes_total == sum(
        np.asarray(checkpoint.get(n)).nbytes for n in checkpoint.names())


def test_the_host_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Even a whole-leaf load on one device moves a stacked [L, ...] parameter one layer at a time: no host
    buffer handed to a device is larger than the checkpoint's largest tensor (in float32)."""
    config = models.preset("tiny", tie_embeddings=False)
    models.export(models.init_model(config, seed=1), None, tmp_path / "hf")
    checkpoint = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    largest = max(4 * int(np.prod(checkpoint.get(n).shape)) for n in checkpoint.names())
    put, sizes = jax.device_put, []

    def recording_put(x, *args, **kwargs):
        sizes.append(getattr(x, "nbytes", 0))
        return put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording_put)
    model, _ = build_model(config, checkpoint.get, source="test")
    stacked = _leaves(model)["blocks.mlp.up_proj.kernel"].nbytes
    assert config.num_layers > 1 and stacked > largest >= max(sizes) > 0


def test_abstract_load_reads_no_weights(tmp_path):
    models.export(models.init_model(models.preset("tiny"), seed=1), models.char_tokenizer(), tmp_path / "hf")
    stats = models.LoadStats()
    model, tokenizer, _ = models.load(tmp_path / "hf", weights=False, stats=stats)
    assert stats.bytes_read == 0 and tokenizer is not None
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in _leaves(model).values())


_LOADER = textwrap.dedent("""
    import json, sys
    import jax
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    from logra_jax import models
    from logra_jax.parallel.sharding import MeshConfig, make_mesh
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    stats = models.LoadStats()
    model, _, _ = models.load(sys.argv[3], shardings=mesh, stats=stats)
    print("STATS", json.dumps({"read": stats.bytes_read, "total": stats.bytes_total}), flush=True)
""")


@pytest.mark.slow
def test_two_processes_read_only_their_own_slices(tmp_path):
    """2 processes × 4 devices, one (fsdp 4, tensor 2) mesh: each process reads the slices its devices hold, about
    half of the checkpoint (replicated norms are read by both), and together they read all of it."""
    config = models.preset("tiny", tie_embeddings=False)
    models.export(models.init_model(config, seed=1), None, tmp_path / "hf")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {os.environ['LOGRA_TEST_XLA_FLAGS']}",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", _LOADER, f"127.0.0.1:{port}", str(i), str(tmp_path / "hf")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a loader process hung")
        assert p.returncode == 0, out[-3000:]
        outs.append(json.loads(re.search(r"STATS (.*)", out)[1]))
    total = outs[0]["total"]
    replicated = 4 * config.hidden_size * (2 * config.num_layers + 1)  # the fp32 norms every device holds
    for stats in outs:
        assert stats["total"] == total
        assert stats["read"] == (total - replicated) // 2 + replicated, stats
    assert sum(s["read"] for s in outs) == total + replicated


_JOB = textwrap.dedent("""
    import json, sys
    from logra_jax.job.train import train_and_evaluate
    config, workdir = json.loads(sys.argv[1]), sys.argv[2]
    train_and_evaluate(config, workdir)
    config["train"]["steps"] += 1
    train_and_evaluate(config, workdir)  # resumed: the restore phase
""")


@pytest.mark.slow
def test_every_phase_of_the_job_leaves_each_device_its_share(tmp_path):
    """The main job on an 8-device FSDP mesh: after start-up, the SFT warm start, the optimizer's init, the first
    RL step and a restore, device 0 holds no more live bytes than 1.25 × the emptiest device, and no device more
    than 1.25 × its 1/8 of the live arrays' bytes whole (the job logs both) beside the colocated engine's copy."""
    sys.path.insert(0, str(REPO / "tests" / "train"))
    try:
        from conftest import make_tiny_config
    finally:
        sys.path.pop(0)
    config = make_tiny_config(train={"steps": 1, "mesh_fsdp": 8, "checkpoint_every": 1, "microbatches": 1},
                              sft={"steps": 2, "batch_size": 8}, rollout={"prompts_per_step": 8, "num_samples": 2})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    # cheap code generation, and the resumed run loads the programs the first one compiled (CI time)
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {os.environ['LOGRA_TEST_XLA_FLAGS']}",
               JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jit_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    done = subprocess.run([sys.executable, "-c", _JOB, json.dumps(config), str(tmp_path / "run")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    log = (tmp_path / "run" / "log.txt").read_text()
    found = re.findall(r"live arrays after (.+?): device 0 ([\d.]+) MiB, fullest device \d+ ([\d.]+) MiB, "
                       r"emptiest ([\d.]+) MiB \(8 local devices; ([\d.]+) MiB whole\)", log)
    phases = [f[0] for f in found]
    assert phases == ["start", "the warm start", "the optimizer's init", "the first RL step", "start",
                      "the restore", "the first RL step"], log
    # From the first RL step on, the colocated engine's copy (compute dtype, decode layout with t = the trainer
    # mesh's tensor size on CPU, here 1) is on every device by design; everything else is split 8 ways.
    engine = weight_bytes(decode_config(models.preset("tiny", **config["model"]["overrides"]))) / 2**20
    for phase, first, fullest, emptiest, whole in found:
        assert float(first) <= 1.25 * float(emptiest), (phase, first, emptiest)
        assert float(fullest) <= 1.25 * float(emptiest), (phase, fullest, emptiest)
        # each device holds about its 1/8 of the arrays whole (a replicated job holds all of them), within the
        # log's 0.01 MiB
        replicated = engine if phase == "the first RL step" else 0.0
        share = (float(whole) - replicated) / 8 + replicated
        assert float(fullest) <= 1.25 * share + 0.01, (phase, fullest, whole, replicated)
