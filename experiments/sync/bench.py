"""Bytes and time per policy sync: low-rank deltas (docs/method.md §6) against full-weight snapshots.

  python experiments/sync/bench.py                      # writes bench.json and bench.png next to this file
  python experiments/sync/bench.py --repeats 20 --out-dir /tmp/sync

Computed (exact framed sizes from the parameter shapes, no allocation) for smollm2-135m, qwen2.5-1.5b, qwen2.5-7b
and dense-27b at r = 64 and 256, default targets (q k v o gate up down), frozen non-targets:
  low-rank delta   bf16 factors U [L, d, r] of every target + JSON header (steps, seeds, fingerprint, checksum)
  bf16 targets     the target weights in bf16: what a full-weight sync of the trained matrices ships
  bf16 / fp32 all  every parameter (a bf16 weight push as in the published ports / our fp32 resync snapshot)
Measured on SmolLM2-135M (random init, all 30 layers, one CPU device per process): per update the trainer builds
the delta (factors to the host, weight fingerprint, BLAKE2b), sends it, the engine checks, merges, fingerprints and
answers; the same for a full fp32 snapshot. Colocated = engine in the trainer's process (no serialization);
worker = separate process over loopback TCP. After one warm-up of each, `--repeats` delta and snapshot syncs run
interleaved (both kinds see the same load on a shared machine); medians per phase are reported. Bitwise equality
of each engine's weights with the trainer's is checked at the end and recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logra_jax.core.tree_paths import path_str
from logra_jax.models.config import preset
from logra_jax.models.decoder import abstract_model, init_model
from logra_jax.optim.lowrank import LowRankUpdate, apply_updates
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import find_targets
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.sync import PolicySync, SyncPayload, TargetFactor, flat_params, snapshot_payload
from logra_jax.rollout.worker import InProcessTransport, WorkerProcessTransport

HERE = Path(__file__).resolve().parent
MODELS = ("smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b", "dense-27b")
RANKS = (64, 256)
GIB = 1 << 30


def _zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A read-only array view of the right shape and dtype that occupies no memory (for framed sizes only)."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def computed_sizes(model: str, rank: int) -> dict[str, Any]:
    """Framed bytes of a low-rank delta and of full-weight syncs for `model` at `rank` (shapes only)."""
    params = flat_params(nnx.split(abstract_model(preset(model)))[1])
    targets = find_targets(params)
    fingerprint = {p: 2**32 - 1 for p in params}  # the widest JSON number: an upper bound
    factors = {p: TargetFactor(factor=_zeros((*t.batch_shape, *t.rows_shape, rank), jnp.bfloat16), decay=None,
                               step=10**6, spec=SketchSpec(rank=rank, base_seed=42, round_bf16=True), shape=t.shape,
                               rows=t.dims.rows, width=t.dims.width)
               for p, t in targets.items()}
    delta = SyncPayload("delta", 10**6, 10**6 - 1, factors, {}, {}, fingerprint, "0" * 64)
    snapshot = SyncPayload("snapshot", 10**6, None, {}, {}, {p: _zeros(a.shape, a.dtype) for p, a in params.items()},
                           fingerprint, "0" * 64)
    count = lambda shapes: sum(int(np.prod(s)) for s in shapes)
    target_params = count(t.shape for t in targets.values())
    all_params = count(a.shape for a in params.values())
    out = {"model": model, "rank": rank, "lowrank_delta_bytes": delta.nbytes,
           "factor_bytes": sum(f.factor.nbytes for f in factors.values()), "bf16_target_bytes": 2 * target_params,
           "bf16_all_bytes": 2 * all_params, "fp32_snapshot_bytes": snapshot.nbytes}
    out["ratio_vs_bf16_targets"] = out["lowrank_delta_bytes"] / out["bf16_target_bytes"]
    out["ratio_vs_fp32_snapshot"] = out["lowrank_delta_bytes"] / out["fp32_snapshot_bytes"]
    return out


def _summary(reports: list[Any]) -> dict[str, float]:
    """Median seconds over `reports`, in all and per phase: build (trainer: payload from the update), check /
    apply / fingerprint (engine, from its reply) and transfer = total − build − engine phases (framing, loopback,
    parsing on the other side, reply)."""
    phases = {"total": [r.seconds for r in reports], "build": [r.build_seconds for r in reports]}
    for name in ("check", "apply", "fingerprint"):
        phases[name] = [r.reply.seconds[name] for r in reports]
    phases["transfer"] = [r.seconds - r.build_seconds - sum(r.reply.seconds.values()) for r in reports]
    return {k: statistics.median(v) for k, v in phases.items()}


def measure(rank: int, repeats: int) -> list[dict[str, Any]]:
    """Time low-rank and snapshot syncs of SmolLM2-135M to a colocated engine and to a worker process."""
    config = preset("smollm2-135m")
    sampling = SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0)
    params = nnx.split(init_model(config))[1]
    targets = find_targets(params)

    @jax.jit
    def trainer_step(params: Any, key: jax.Array, step: jax.Array) -> tuple[Any, Any]:
        """An update shaped like logra(...)'s: random factors (sync cost does not depend on their values)."""
        keys = dict(zip(targets, jax.random.split(key, len(targets))))

        def leaf(keypath: Any, p: jax.Array) -> Any:
            path = path_str(keypath)
            if path not in targets:
                return None
            t = targets[path]
            factor = 1e-4 * jax.random.normal(keys[path], (*t.batch_shape, *t.rows_shape, rank))
            return LowRankUpdate(factor, step, target=t, spec=SketchSpec(rank=rank, base_seed=42, round_bf16=True))

        updates = jax.tree_util.tree_map_with_path(leaf, params)
        return apply_updates(params, updates), updates

    rows = []
    for name, engine in (("colocated", InProcessTransport(config, sampling)),
                         ("worker", WorkerProcessTransport(config, sampling))):
        rows.append({"engine": name, "rank": rank,
                     **_measure_engine(engine, params, trainer_step, repeats)})
        print(json.dumps(rows[-1]), flush=True)
        engine.close()
    return rows


def _measure_engine(engine: Any, params: Any, trainer_step: Any, repeats: int) -> dict[str, Any]:
    state = {"params": params, "step": 0}
    sync = PolicySync(engine.sync, params)

    def delta_sync() -> Any:
        state["params"], updates = trainer_step(state["params"], jax.random.key(state["step"]),
                                                jnp.int32(state["step"]))
        jax.block_until_ready(state["params"])
        state["step"] += 1
        return sync.push(updates, state["params"])

    def snapshot_sync() -> Any:
        start = time.perf_counter()
        return sync.send(snapshot_payload(state["params"], sync.version), state["params"], start)

    delta_sync(), snapshot_sync()  # warm-up: compilation on both ends
    deltas, snapshots = [], []
    for _ in range(repeats):  # interleaved, so that both kinds see the same load on a shared machine
        deltas.append(delta_sync())
        snapshots.append(snapshot_sync())
    if {r.reply.status for r in deltas} != {"applied"} or {r.reply.status for r in snapshots} != {"loaded"}:
        raise RuntimeError(f"unexpected sync replies: {deltas[-1].reply}, {snapshots[-1].reply}")
    version, fetched = engine.fetch()
    want = jax.device_get(flat_params(state["params"]))
    bitwise = version == sync.version and all(
        np.array_equal(np.asarray(fetched[p]).view(np.uint32), np.asarray(w).view(np.uint32)) for p, w in want.items())
    out = {"delta_bytes": deltas[-1].nbytes, "delta_seconds": _summary(deltas),
           "snapshot_bytes": snapshots[-1].nbytes, "snapshot_seconds": _summary(snapshots)}
    out["time_ratio_delta_vs_snapshot"] = out["delta_seconds"]["total"] / out["snapshot_seconds"]["total"]
    return {**out, "resyncs": sync.resyncs, "bitwise_equal": bool(bitwise), "updates": sync.version}


def plot(computed: list[dict[str, Any]], measured: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.6))
    width, x = 0.16, np.arange(len(MODELS))
    series = [(f"low-rank r={r}", lambda m, r=r: _pick(computed, m, r)["lowrank_delta_bytes"]) for r in RANKS]
    series += [("bf16 target weights", lambda m: _pick(computed, m, RANKS[0])["bf16_target_bytes"]),
               ("bf16 all weights", lambda m: _pick(computed, m, RANKS[0])["bf16_all_bytes"]),
               ("fp32 snapshot", lambda m: _pick(computed, m, RANKS[0])["fp32_snapshot_bytes"])]
    for i, (label, fn) in enumerate(series):
        ax0.bar(x + (i - 2) * width, [fn(m) / GIB for m in MODELS], width, label=label)
    for i, m in enumerate(MODELS):
        ratio = _pick(computed, m, 256)["ratio_vs_bf16_targets"]
        ax0.annotate(f"{100 * ratio:.1f}%", (i - width, _pick(computed, m, 256)["lowrank_delta_bytes"] / GIB),
                     ha="center", va="bottom", fontsize=7)
    ax0.set_yscale("log")
    ax0.set_xticks(x, MODELS)
    ax0.set_ylabel("GiB per sync")
    ax0.set_title("Bytes per sync (computed; % = r=256 delta / bf16 target weights)")
    ax0.legend(fontsize=7)
    phases = ("build", "transfer", "check", "apply", "fingerprint")
    labels = [f"{r['engine']} r={r['rank']} {kind}" for r in measured for kind in ("delta", "fp32 snapshot")]
    times = [r[f"{kind}_seconds"] for r in measured for kind in ("delta", "snapshot")]
    left = np.zeros(len(times))
    for phase in phases:
        widths = np.array([t[phase] for t in times])
        ax1.barh(range(len(times)), widths, left=left, label=phase)
        left += widths
    ax1.set_yticks(range(len(times)), labels, fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds per sync (median per phase)")
    ax1.set_title("SmolLM2-135M, measured on this machine's CPU")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _pick(rows: list[dict[str, Any]], model: str, rank: int) -> dict[str, Any]:
    return next(r for r in rows if r["model"] == model and r["rank"] == rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--repeats", type=int, default=7, help="timed delta + snapshot pairs per engine and rank")
    args = parser.parse_args()
    computed = [computed_sizes(m, r) for m in MODELS for r in RANKS]
    for row in computed:
        print(json.dumps(row), flush=True)
    measured = [row for r in RANKS for row in measure(r, args.repeats)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"command": "python experiments/sync/bench.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out_dir"),
              "jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
              "machine": platform.machine(), "computed": computed, "measured_smollm2_135m": measured}
    (args.out_dir / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(computed, measured, args.out_dir / "bench.png")


if __name__ == "__main__":
    main()
