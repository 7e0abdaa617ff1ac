"""Trainer and rollout-engine weights bitwise equal after 5 low-rank policy syncs, on the machine's accelerator.

  python experiments/device/sync_check.py --out sync.json            # Qwen2.5-1.5B on the GPU (check.sh runs it)
  python experiments/device/sync_check.py --out sync.json --smoke    # tiny model (the tests, CPU), < 15 s

What the training loop (logra_jax.job.train) does, on one device: the RL train step of sketch-native LoGRA with the
predicted-KL probe (the run config's section from `experiments.contenders.contender_sections`, rank 256, 2
probe sequences; the step from `build_rl_step(..., return_updates=True)`, jitted with shardings and the state
donated) on random rollout batches returns the update tree it merged (LowRankUpdate leaves for the targets);
`PolicySync.push` turns it into the sync payload (bf16 factors, seed triples, weight fingerprint, checksum) and
the colocated engine (`InProcessTransport`: its own float32 masters on the same device, bootstrapped by a
snapshot) checks it and runs the merge. Model: `paper_numerics(--model)` (bf16 compute, fp32 weights, remat,
chunked attention), random init; sequences of --seq-len tokens (sync does not depend on the length; the default
1024 keeps the check short). --smoke: the "tiny" preset at the same numerics, 64 tokens, rank 8.

After `--updates` syncs every engine weight is compared bit for bit with the trainer's (as unsigned integers of
the same width: NaNs compare too); where they differ, the count and the largest |difference| are reported. The
check passes when the weights are bitwise equal, every delta was applied through the low-rank path (no
fingerprint mismatch, no resync by snapshot, which would also make the weights equal) and the weights did change.
Prints progress, then one verdict line; writes --out after every phase. Exit status: 0 when the check ran,
whatever the verdict (it is data); 1 if it crashed (the JSON then holds the error and what was measured); 128 + N
on signal N (SIGTERM from `timeout`), after writing what there is.

JSON (--out): {"script", "command", "smoke", "model", "seq_len", "prompt_len", "rank", "probe_responses",
  "updates_requested", "device", "platform", "jax", "flax", "optax", "engine_device", "phase", "parameters",
  "targets", "trained_dense_paths", "bootstrap": {"status", "bytes", "seconds"},
  "updates": [{"update", "status", "reason", "engine_version", "bytes", "step_s" (the first includes compiling),
               "sync_s", "low_rank_leaves", "factor_abs_max", "loss", "kl_refused"}],
  "statuses", "resyncs", "payload_bytes", "engine_version", "trainer_version", "parameters_compared" (arrays),
  "n_differing", "differing" (first 20), "missing", "max_abs_diff", "leaves_changed", "bitwise_equal",
  "lowrank_only", "passed", "verdict", "seconds", and on a crash "error", "traceback"}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.device.step_check import PROBES, model_config, random_batch  # noqa: E402 -- after sys.path

SECTION = "logra_sketch_native_kl"
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        return {"model": "tiny", "seq_len": 64, "prompt_len": 16, "rank": 8, "logprob_chunk": 16}
    return {"model": args.model, "seq_len": args.seq_len, "prompt_len": args.seq_len // 4, "rank": args.rank,
            "logprob_chunk": min(512, args.seq_len // 4)}


def bitwise_compare(want: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Compare two {path: array} maps bit for bit (each element as an unsigned integer of its width)."""
    import numpy as np

    differing, max_abs = [], 0.0
    missing = sorted(set(want) ^ set(got))
    for path in want:
        if path not in got:
            continue
        w, g = np.asarray(want[path]), np.asarray(got[path])
        if w.shape != g.shape or w.dtype != g.dtype:
            differing.append(path)
            max_abs = math.inf
            continue
        bits = np.dtype(f"u{w.dtype.itemsize}")
        if np.array_equal(w.view(bits), g.view(bits)):
            continue
        differing.append(path)
        with np.errstate(invalid="ignore"):
            diff = np.abs(w.astype(np.float64) - g.astype(np.float64))
        max_abs = max(max_abs, float(np.nanmax(diff)) if diff.size and not np.isnan(diff).all() else math.nan)
    return {"parameters_compared": len(want), "n_differing": len(differing), "differing": differing[:20],
            "missing": missing[:20], "max_abs_diff": max_abs}


def run(s: dict[str, Any], updates: int, report: dict[str, Any], save: Any, say: Any) -> None:
    """The check; fills `report` as it goes (`save()` after every phase)."""
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from experiments.contenders import contender_sections
    from logra_jax.core.fingerprint import tree_fingerprint
    from logra_jax.job.optimizer_plan import build_optimizer
    from logra_jax.job.train_step import step_shardings
    from logra_jax.models.decoder import init_model
    from logra_jax.optim.lowrank import is_lowrank
    from logra_jax.parallel import sharding as shd
    from logra_jax.planner.memory_analysis import build_rl_step
    from logra_jax.rollout.sampling import SamplingConfig
    from logra_jax.rollout.sync import PolicySync, flat_params
    from logra_jax.rollout.worker import InProcessTransport

    device = jax.local_devices()[0]
    report.update(device=device.device_kind, platform=device.platform, jax=jax.__version__,
                  flax=flax.__version__, optax=optax.__version__, phase="build")
    save()
    config = model_config(s)
    section = dataclasses.replace(contender_sections(s["rank"])[SECTION], probe_responses=PROBES)

    # what the loop ships besides the factors: the densely trained non-targets (none when they are frozen)
    built: dict[str, Any] = {}

    def abstract_params() -> Any:
        model = init_model(config)
        built["plan"] = build_optimizer(section, model)
        return nnx.split(model, nnx.Param, ...)[1]

    params_shape = jax.eval_shape(abstract_params)
    trained = built["plan"].dense_paths(params_shape)
    report.update(trained_dense_paths=trained, targets=len(built["plan"].targets or {}),
                  parameters=int(sum(math.prod(x.shape) for x in jax.tree.leaves(params_shape))))

    # the loop's step and jit: shardings on a one-device mesh, the state donated, the update tree returned
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1), [device])
    init, step, abstract_batch = build_rl_step(config, section, 1, seq_len=s["seq_len"], prompt_len=s["prompt_len"],
                                               logprob_chunk=s["logprob_chunk"], return_updates=True)
    t0 = time.perf_counter()
    (state, rest), (state_sh, rest_sh) = shd.init_sharded(init, lambda a: step_shardings(*a, mesh))
    jax.block_until_ready(state)
    batch_sh = shd.batch_shardings(abstract_batch, mesh)
    step_fn = shd.jit_train_step(step, mesh, in_shardings=(state_sh, rest_sh, batch_sh),
                                 out_shardings=(state_sh, shd.replicated(mesh), None))
    report.update(phase="bootstrap", init_s=time.perf_counter() - t0)
    say(f"initialised {s['model']} in {report['init_s']:.1f} s; bootstrap snapshot to the engine")
    save()

    t0 = time.perf_counter()
    engine = InProcessTransport(config, SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0))
    try:
        sync = PolicySync(engine.sync, state.params, version=int(state.step), trained=trained)
        boot = sync.bootstrap
        report["bootstrap"] = {"status": boot.reply.status, "reason": boot.reply.reason, "bytes": boot.nbytes,
                               "seconds": time.perf_counter() - t0}
        leaves = jax.tree.leaves(engine.weights.params)
        report["engine_device"] = str(next(iter(leaves[0].devices()))) if leaves else None
        report["phase"] = "updates"
        save()
        before = tree_fingerprint(state.params)
        for i in range(updates):
            t0 = time.perf_counter()
            batch = jax.device_put(random_batch(abstract_batch, config.vocab_size, s["prompt_len"], seed=i + 1),
                                   batch_sh)
            state, metrics, update_tree = step_fn(state, rest, batch)
            jax.block_until_ready((state, metrics))
            step_s = time.perf_counter() - t0
            factors = [u.factor for u in jax.tree.leaves(update_tree, is_leaf=is_lowrank) if is_lowrank(u)]
            biggest = jax.device_get([jnp.max(jnp.abs(f)) for f in factors])
            pushed = sync.push(update_tree, state.params)
            metrics = {k: float(np.asarray(v).reshape(())) for k, v in jax.device_get(metrics).items()
                       if np.size(v) == 1}
            report["updates"].append({
                "update": i + 1, "status": pushed.reply.status, "reason": pushed.resync_reason or pushed.reply.reason,
                "engine_version": pushed.reply.version, "bytes": pushed.nbytes, "step_s": step_s,
                "sync_s": pushed.seconds, "low_rank_leaves": len(factors),
                "factor_abs_max": max((float(b) for b in biggest), default=0.0), "loss": metrics.get("loss"),
                "kl_refused": metrics.get("kl_refused")})
            say(f"update {i + 1}/{updates}: {pushed.reply.status} (engine version {pushed.reply.version}), "
                f"{pushed.nbytes / 2 ** 20:.1f} MiB, step {step_s:.1f} s, sync {pushed.seconds:.2f} s"
                + (f"; {report['updates'][-1]['reason']}" if report["updates"][-1]["reason"] else ""))
            save()
        report.update(statuses=[u["status"] for u in report["updates"]], resyncs=sync.resyncs,
                      payload_bytes=[u["bytes"] for u in report["updates"]], trainer_version=sync.version,
                      phase="compare")
        after = tree_fingerprint(state.params)
        report["leaves_changed"] = sum(before[p] != after.get(p) for p in before)
        save()
        t0 = time.perf_counter()
        version, fetched = engine.fetch()
        want = jax.device_get(flat_params(state.params))
    finally:
        engine.close()
    report["engine_version"] = version
    report.update(bitwise_compare(want, fetched))
    report["compare_s"] = time.perf_counter() - t0
    report["bitwise_equal"] = bool(report["n_differing"] == 0 and not report["missing"] and version == sync.version)
    report["lowrank_only"] = bool(sync.resyncs == 0 and len(report["updates"]) == updates
                                  and all(u["status"] == "applied" for u in report["updates"]))
    report["passed"] = bool(report["bitwise_equal"] and report["lowrank_only"] and report["leaves_changed"] > 0)
    where = f"on {report['device']} ({report['platform']}, jax {report['jax']})"
    if report["passed"]:
        report["verdict"] = (f"PASS: bitwise equal, all {report['parameters_compared']} parameter arrays after "
                             f"{updates} low-rank syncs (all applied, 0 resyncs; {report['leaves_changed']} leaves "
                             f"changed) {where}")
    else:
        why = []
        if not report["bitwise_equal"]:
            why.append(f"NOT bitwise equal: {report['n_differing']} of {report['parameters_compared']} parameter "
                       f"arrays differ (max |diff| {report['max_abs_diff']:.3e}), {len(report['missing'])} missing, "
                       f"engine version {version} vs trainer {sync.version}")
        if not report["lowrank_only"]:
            why.append(f"not all through the low-rank path: statuses {report['statuses']}, {sync.resyncs} resyncs "
                       f"by snapshot")
        if not report["leaves_changed"]:
            why.append("the updates changed no weight (vacuous)")
        report["verdict"] = "FAIL: " + "; ".join(why) + f" {where}"
    report["phase"] = "done"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sync.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 64 tokens, rank 8 (CPU, the tests)")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--model", default="qwen2.5-1.5b", help="model preset (default qwen2.5-1.5b)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence, a quarter of them prompt")
    parser.add_argument("--rank", type=int, default=256)
    args = parser.parse_args()
    s = settings(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    report: dict[str, Any] = {"script": "sync_check", "command": " ".join(sys.argv), "smoke": args.smoke, **s,
                              "probe_responses": PROBES, "updates_requested": args.updates, "updates": [],
                              "bitwise_equal": None, "passed": None}

    def save() -> None:
        report["seconds"] = time.perf_counter() - began
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        os.replace(tmp, out)

    def say(text: str) -> None:
        print(f"[sync_check {time.perf_counter() - began:5.0f}s] {text}", flush=True)

    def on_signal(signum: int, _frame: Any) -> None:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in _SIGNALS:
        signal.signal(sig, on_signal)
    code = 0
    try:
        run(s, args.updates, report, save, say)
    except BaseException as err:  # write what there is, then fail
        code = 128 + int(str(err).split()[-1]) if str(err).startswith("signal ") else 1
        report["error"] = f"{report.get('phase', '?')}: {type(err).__name__}: {str(err)[:2000]}"
        report["traceback"] = traceback.format_exc()[-4000:]
        report["verdict"] = f"CRASHED in phase {report.get('phase', '?')}: {type(err).__name__}: {str(err)[:300]}"
        traceback.print_exc()
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    save()
    print(f"[sync_check] {report['verdict']} ({report['seconds']:.0f} s)", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
