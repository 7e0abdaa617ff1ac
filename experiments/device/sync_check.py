"""Trainer and rollout-engine weights bitwise equal after 5 low-rank policy syncs, on the machine's accelerator.

  python experiments/device/sync_check.py --out sync.json            # SmolLM2-135M shapes (check.sh runs it)
  python experiments/device/sync_check.py --out sync.json --smoke    # tiny model (the tests, CPU)

What the training loop does, on one device: the RL train step of sketch-native LoGRA with the predicted-KL probe
(`build_rl_step(..., return_updates=True)`, random init, random rollout batches) returns its low-rank update tree;
`PolicySync.push` builds the payload (bf16 factors, seeds, fingerprint, checksum) and the colocated engine
(`InProcessTransport`, its own float32 copy of the weights) checks and merges it. After `--updates` steps every
engine weight is compared bit for bit with the trainer's. Prints one verdict line; exits 0 whatever the verdict
(it is data), non-zero only if the check itself crashed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import numpy as np

from experiments.device.step_check import _random_batch, prepare
from logra_jax.memory_analysis import contender_sections, paper_numerics
from logra_jax.models.config import preset
from logra_jax.rl.sampler import SamplingConfig
from logra_jax.transport.rollout_worker import InProcessTransport
from logra_jax.transport.sync import PolicySync, flat_params


def run(smoke: bool, updates: int) -> dict:
    s = ({"model": "tiny", "seq_len": 64, "prompt_len": 16, "rank": 8, "logprob_chunk": 16} if smoke else
         {"model": "smollm2-135m", "seq_len": 1024, "prompt_len": 256, "rank": 64, "logprob_chunk": 256})
    config = preset("tiny") if smoke else paper_numerics(s["model"], s["seq_len"])
    section = dataclasses.replace(contender_sections(s["rank"])["logra_sketch_native_kl"], probe_responses=2)
    start = time.perf_counter()
    compiled, state, rest, batch, _ = prepare(config, section, s, return_updates=True)
    engine = InProcessTransport(config, SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0))
    sync = PolicySync(engine.sync, state.params, version=int(state.step))
    statuses, nbytes = [], []
    for i in range(updates):
        fresh = _random_batch(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch),
                              config.vocab_size, s["prompt_len"], seed=i + 1)
        batch = jax.device_put(fresh, jax.tree.map(lambda a: a.sharding, batch))
        state, metrics, update_tree = compiled(state, rest, batch)
        report = sync.push(update_tree, state.params)
        statuses.append(report.reply.status)
        nbytes.append(report.nbytes)
    version, fetched = engine.fetch()
    engine.close()
    want = jax.device_get(flat_params(state.params))
    differing, max_abs = [], 0.0
    for path, w in want.items():
        got, w = np.asarray(fetched[path]), np.asarray(w)
        if got.shape != w.shape or got.tobytes() != w.tobytes():
            differing.append(path)
            if got.shape == w.shape:
                max_abs = max(max_abs, float(np.max(np.abs(got.astype(np.float64) - w.astype(np.float64)))))
    equal = not differing and version == sync.version
    device = jax.local_devices()[0]
    return {"model": s["model"], "rank": s["rank"], "updates": updates, "device": device.device_kind,
            "platform": device.platform, "jax": jax.__version__, "engine_version": version,
            "trainer_version": sync.version, "statuses": statuses, "resyncs": sync.resyncs,
            "payload_bytes": nbytes, "parameters_compared": len(want), "differing": differing[:20],
            "n_differing": len(differing), "max_abs_diff": max_abs, "bitwise_equal": bool(equal),
            "final_loss": float(metrics["loss"]) if "loss" in metrics else None,
            "seconds": time.perf_counter() - start,
            "verdict": (f"bitwise equal: all {len(want)} parameters after {updates} low-rank syncs "
                        f"({'/'.join(sorted(set(statuses)))}, {sync.resyncs} resyncs) on {device.device_kind}"
                        if equal else
                        f"NOT equal: {len(differing)} of {len(want)} parameters differ (max |diff| {max_abs:.3e}), "
                        f"engine version {version} vs trainer {sync.version}")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sync.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--updates", type=int, default=5)
    args = parser.parse_args()
    report = run(args.smoke, args.updates)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"[sync_check] {report['verdict']} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
