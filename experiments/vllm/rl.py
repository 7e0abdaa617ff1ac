r"""SmolLM2-135M RL with vLLM rollouts against our engine, and what the low-rank sync to vLLM costs and drifts.

One run per call, in this process (JAX on one CPU device; vLLM's CPU build in its own process from .venv-vllm):

  nice -n 10 python -m experiments.vllm.rl --engine vllm --seed 0    # 22 min alone, 55 beside another run
  nice -n 10 python -m experiments.vllm.rl --engine jax --seed 0     # 23 min beside another run (warm start cached)
  python -m experiments.vllm.rl --report                             # rl.{json,md,png} from the finished runs

Setup: experiments/smollm2/tune's best LoGRA (logra-layer, per-layer update ratio 5e-5, rank 64, sketch-native, no
KL control) on parity.py's task and run length (COMMON: SFT warm start of 40 AdamW steps per seed, cached and shared
with those studies; two-digit additions; 8 prompts × 4 samples of ≤ 10 tokens; 40 RL steps; held-out greedy accuracy
on 128 problems every 10 steps, decoded by the run's own engine). The two engines differ only in `rollout.engine`
(vLLM in float32, the trainer's dtype): same warm start and prompt batches per seed; the samples differ (each
engine draws its own).

With vLLM every publication is followed, outside the timed sync, by a fetch of the engine's float32 masters: the
exact largest |W_vllm − W_trainer| over every entry (and relative to max |W| of its leaf), next to the sampled drift
probe the engine checks itself (`VLLMEngine.publish`, a resync past 1e-4 · max|W|). Per publication runs/<engine>-
seed<k>/sync.jsonl holds bytes, the time split (trainer: building the delta; engine: checking, merging U·A into the
masters, reloading vLLM's weights; wire: the rest, framing and the socket) and the drift; version 0 is the bootstrap
snapshot, a full float32 weight sync measured the same way. The log-prob mismatch is the step's `rollout_mismatch`
(mean over tokens of max(log μ − log π_θ, 0), what the TIS cap sees) and `tis_weight`, from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNS = HERE / "runs"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ENGINES = ("jax", "vllm")
RATIO = 5e-5  # experiments/smollm2/tune/best.md: logra-layer's best per-layer update ratio
ROWS = 8 * 4  # responses per step (parity.py's COMMON: 8 prompts × 4 samples)


def overrides(engine: str, vllm_python: str = str(VLLM_PYTHON), vllm_dtype: str = "float32") -> dict[str, Any]:
    """tune.py's logra-layer at RATIO, with the rollout engine chosen."""
    from experiments.smollm2.tune import overrides as tuned

    out = tuned("logra-layer", RATIO)
    if engine == "vllm":
        out["rollout"] = {**out["rollout"], "engine": "vllm", "vllm_python": vllm_python, "vllm_dtype": vllm_dtype}
    return out


def run(engine: str, seed: int, runs: Path = RUNS, steps: int | None = None, **vllm: str) -> dict[str, Any]:
    """One run (40 steps unless `steps`) in runs/<engine>-seed<seed> (a finished one is not run again); vllm:
    overrides' vllm_python and vllm_dtype. Returns the run's summary."""
    from experiments.smollm2.parity import CONFIG
    from experiments.sweep import load_config, merged

    workdir = runs / f"{engine}-seed{seed}"
    config = merged(load_config(CONFIG), overrides(engine, **vllm))
    config["train"] = {**config["train"], "seed": seed, **({"steps": steps} if steps else {})}
    if engine == "vllm":
        _record_syncs(workdir / "sync.jsonl")
    from logra_jax.job.train import train_and_evaluate

    return train_and_evaluate(config, workdir)


def _record_syncs(path: Path) -> None:
    """Make the job's VLLMEngine append every publication (and the bootstrap snapshot) to `path`, with the exact
    drift of the engine's masters from the trainer's weights."""
    import jax
    import numpy as np

    import logra_jax.rollout.vllm.engine as vllm_engine
    from logra_jax.rollout.sync import flat_params

    def write(kind: str, report: Any, params: Any, engine: vllm_engine.VLLMEngine, probe_s: float) -> None:
        start = time.perf_counter()
        version, masters = engine.fetch()
        ours = jax.device_get(flat_params(params))
        drift = {p: float(np.abs(masters[p].astype(np.float64) - np.asarray(w, np.float64)).max())
                 for p, w in ours.items()}
        scale = {p: float(np.abs(np.asarray(w)).max()) for p, w in ours.items()}
        worst = max(drift, key=lambda p: drift[p] / max(scale[p], 1e-30))
        record = {"kind": kind, "version": report.version, "engine_version": version, "bytes": report.nbytes,
                  "seconds": report.seconds, "build_seconds": report.build_seconds,
                  "engine_seconds": report.reply.seconds, "status": report.reply.status,
                  "resync_reason": report.resync_reason, "resyncs": engine.resyncs, "probe_seconds": probe_s,
                  "drift_max": max(drift.values()), "drift_rel_max": drift[worst] / max(scale[worst], 1e-30),
                  "drift_worst_leaf": worst, "probe_drift_max": max(engine.last_drift.values(), default=None),
                  "fetch_seconds": time.perf_counter() - start,
                  "full_weight_bytes": {"float32": sum(4 * w.size for w in ours.values()),
                                        "bfloat16": sum(2 * w.size for w in ours.values())}}
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    class RecordedVLLMEngine(vllm_engine.VLLMEngine):
        def __init__(self, model_config: Any, sampling: Any, params: Any, **kwargs: Any):
            super().__init__(model_config, sampling, params, **kwargs)
            path.parent.mkdir(parents=True, exist_ok=True)
            write("bootstrap", self.sync.bootstrap, params, self, 0.0)  # at every start (a resumed run appends)

        def publish(self, updates: Any, params: Any) -> Any:
            start = time.perf_counter()
            report = super().publish(updates, params)
            # publish's drift probe runs after the push it reports on: its time is the rest of the call
            write("publish", report, params, self, time.perf_counter() - start - report.seconds)
            return report

    vllm_engine.VLLMEngine = RecordedVLLMEngine  # what logra_jax.rollout.engine.rollout_engine imports


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(runs_dir: Path = RUNS, out: Path = HERE) -> dict[str, Any]:
    """out/rl.json (every finished run's per-step series and summaries), rl.md (tables) and rl.png."""
    from experiments.sweep import largest_drop

    # a run whose folder is gone (runs/ is git-ignored and not kept) keeps the series an earlier report recorded
    recorded = json.loads((out / "rl.json").read_text())["runs"] if (out / "rl.json").exists() else {}
    runs: dict[str, dict[str, Any]] = {}
    for workdir in sorted(runs_dir.glob("*-seed*")):
        if not (workdir / "metrics.jsonl").exists():
            continue
        steps = [r for r in _lines(workdir / "metrics.jsonl") if "loss" in r]
        evals = [(r["step"], r["eval_accuracy"]) for r in _lines(workdir / "metrics.jsonl") if "eval_accuracy" in r]
        summary = workdir / "summary.json"
        run_ = {"summary": json.loads(summary.read_text()) if summary.exists() else None, "evals": evals,
                "largest_drop": largest_drop([a for _, a in evals]),
                "steps": [{k: r.get(k) for k in ("step", "reward_mean", "rollout_mismatch", "tis_weight", "sync_bytes",
                                                 "sync_time", "sync_resyncs", "rollout_time", "response_length",
                                                 "step_time")}
                          for r in steps]}
        if (workdir / "sync.jsonl").exists():
            run_["syncs"] = _lines(workdir / "sync.jsonl")
        runs[workdir.name] = run_
    runs = dict(sorted({**recorded, **runs}.items()))
    record = {"command": "python -m experiments.vllm.rl --engine {jax,vllm} --seed K; python -m experiments.vllm.rl "
                      "--report", "runs": runs, "paired_vllm_minus_jax": (diff := paired_runs(runs)),
              "overrides": {e: overrides(e, vllm_python=".venv-vllm/bin/python") for e in ENGINES}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl.json").write_text(json.dumps(record, indent=1) + "\n")
    text = _tables(runs, diff)
    (out / "rl.md").write_text(text + "\n")
    _plot(runs, out / "rl.png")
    print(text)
    return record


def paired_runs(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """vLLM − ours per seed where both runs finished: held-out accuracy after RL and the mean reward of the last 10
    steps, each with experiments.sweep.paired's Student-t interval and verdict."""
    from experiments.sweep import paired

    finished = lambda name: bool((runs.get(name) or {}).get("summary"))
    seeds = sorted(k for k in {int(name.rsplit("seed", 1)[1]) for name in runs}
                   if all(finished(f"{engine}-seed{k}") for engine in ENGINES))
    last_reward = lambda r: statistics.fmean(x["reward_mean"] for x in r["steps"][-10:])
    pairs = [(runs[f"vllm-seed{k}"], runs[f"jax-seed{k}"]) for k in seeds]
    return {"seeds": seeds, **{key: paired([f(v) - f(j) for v, j in pairs], names=("vLLM", "ours")) if pairs else None
                               for key, f in (("accuracy_after", lambda r: r["summary"]["accuracy_after"]),
                                              ("final_reward", last_reward))}}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


_SPLIT = (lambda x: x["bytes"], lambda x: x["seconds"], lambda x: x["build_seconds"],
          lambda x: x["seconds"] - x["build_seconds"] - sum(x["engine_seconds"].values()),
          lambda x: x["engine_seconds"].get("check", 0.0), lambda x: x["engine_seconds"].get("apply", 0.0),
          lambda x: x["engine_seconds"].get("reload", 0.0))


def _tables(runs: dict[str, dict[str, Any]], diff: dict[str, Any]) -> str:
    lines = ["| run | steps | held-out before | after | every 10 steps | largest drop | rollout_mismatch (median, max) "
             "| tis_weight (median) | resyncs | rollout phase (s, median) | response tokens/s in it | step time (s, "
             "median, without the drift fetch) |", "|---" * 12 + "|"]
    for name, r in runs.items():
        s, steps, evals = r["summary"], r["steps"], r["evals"]
        mismatch = [x["rollout_mismatch"] for x in steps]
        rate = [x["response_length"] * ROWS / x["rollout_time"] for x in steps]
        # the step's time without this study's own fetch of vLLM's masters (the exact drift)
        fetch = {x["version"]: x["fetch_seconds"] for x in r.get("syncs", ()) if x["kind"] == "publish"}
        step_time = [x["step_time"] - fetch.get(x["step"], 0.0) for x in steps]
        after = f"{s['accuracy_after']:.3f}" if s else "(running)"
        lines.append(f"| {name} | {len(steps)} | {evals[0][1]:.3f} | {after} | "
                     f"{' '.join(f'{a:.2f}' for _, a in evals)} | {r['largest_drop']:.3f} | "
                     f"{_median(mismatch):.1e}, {max(mismatch):.1e} | "
                     f"{_median([x['tis_weight'] for x in steps]):.4f} | {int(steps[-1]['sync_resyncs'])} | "
                     f"{_median([x['rollout_time'] for x in steps]):.1f} | {_median(rate):.0f} | "
                     f"{_median(step_time):.1f} |")
    if diff["seeds"]:
        acc, reward = diff["accuracy_after"], diff["final_reward"]
        lines += ["", f"Paired vLLM − ours over seeds {', '.join(map(str, diff['seeds']))}: held-out accuracy after RL "
                  + ", ".join(f"{d:+.3f}" for d in acc["per_seed"]) + f" (mean {acc['mean']:+.3f} ± {acc['std']:.3f}, "
                  f"{acc['level']:.0%} Student-t interval {acc['interval'][0]:+.3f} … {acc['interval'][1]:+.3f}: "
                  f"{acc['verdict']}); mean reward of the last 10 steps "
                  + ", ".join(f"{d:+.3f}" for d in reward["per_seed"]) + f" (mean {reward['mean']:+.3f}, interval "
                  f"{reward['interval'][0]:+.3f} … {reward['interval'][1]:+.3f}: {reward['verdict']})."]
    for name, r in runs.items():
        if "syncs" not in r:
            continue
        boots = [x for x in r["syncs"] if x["kind"] == "bootstrap"]
        deltas = [x for x in r["syncs"] if x["kind"] == "publish"]
        med = lambda f, d=deltas: _median([f(x) for x in d])
        lines += ["", f"Sync to vLLM in {name} (medians over {len(deltas)} publications; the bootstrap is a full "
                  "float32 snapshot, the same route):", "",
                  "| sync | bytes (MB) | total (s) | trainer build | wire | engine check | engine merge | "
                  "vLLM reload |", "|---" * 8 + "|"]
        for label, rows in (("low-rank delta", deltas), ("full float32 snapshot", boots)):
            parts = [_median([f(x) for x in rows]) for f in _SPLIT]
            lines.append(f"| {label} | " + " | ".join(f"{v / 1e6:.1f}" if i == 0 else f"{v:.2f}"
                                                       for i, v in enumerate(parts)) + " |")
        full = boots[0]["full_weight_bytes"]
        lines += ["", f"Full weights would be {full['float32'] / 1e6:.0f} MB in float32, {full['bfloat16'] / 1e6:.0f} "
                  f"MB in bfloat16: the delta is {med(lambda x: x['bytes']) / full['float32']:.2%} / "
                  f"{med(lambda x: x['bytes']) / full['bfloat16']:.2%} of them. Exact drift after each publication: "
                  f"largest |W_vllm − W_trainer| {max(x['drift_max'] for x in deltas):.2e} (relative to its leaf's "
                  f"max|W|: {max(x['drift_rel_max'] for x in deltas):.2e}; the probe saw at most "
                  f"{max(x['probe_drift_max'] or 0 for x in deltas):.2e}); resyncs {deltas[-1]['resyncs']}; drift "
                  f"probe {med(lambda x: x['probe_seconds']):.2f} s per publication."]
    return "\n".join(lines)


def _plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for name, r in runs.items():
        color, style = f"C{int(name.rsplit('seed', 1)[1])}", "-" if name.startswith("vllm") else "--"
        axes[0].plot(*zip(*r["evals"]), "o" + style, color=color, label=name)
        axes[1].semilogy([x["step"] for x in r["steps"]], [max(x["rollout_mismatch"], 1e-12) for x in r["steps"]],
                         style, color=color, label=name)
        if "syncs" in r:
            d = [x for x in r["syncs"] if x["kind"] == "publish"]
            axes[2].plot([x["version"] for x in d], [x["drift_rel_max"] for x in d], style, color=color,
                         label=f"{name}: exact, relative")
            axes[2].plot([x["version"] for x in d], [x["drift_max"] for x in d], ":", color=color,
                         label=f"{name}: exact, absolute")
            axes[2].set_yscale("symlog", linthresh=1e-9)  # zero (bit for bit) stays on the plot
            axes[2].set_ylim(bottom=0)
    # the sync's time split, median over each vLLM run's publications: one stacked bar per run, the full snapshot
    # (the bootstrap) as a marker beside it
    synced = [(name, r["syncs"]) for name, r in runs.items() if "syncs" in r]
    bottom = [0.0] * len(synced)
    for label, part in (("trainer build", _SPLIT[2]), ("wire", _SPLIT[3]),
                        ("engine check + merge", lambda x: _SPLIT[4](x) + _SPLIT[5](x)), ("vLLM reload", _SPLIT[6])):
        heights = [_median([part(x) for x in syncs if x["kind"] == "publish"]) for _, syncs in synced]
        axes[3].bar(range(len(synced)), heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes[3].plot(range(len(synced)), [_median([x["seconds"] for x in syncs if x["kind"] == "bootstrap"])
                                      for _, syncs in synced], "k_", markersize=30, mew=2,
                 label="full float32 snapshot (total)")
    axes[3].set_xticks(range(len(synced)), [name for name, _ in synced])
    axes[3].set_title("sync to vLLM, median s (bars: low-rank delta)")
    axes[0].set(xlabel="RL step", ylabel="held-out greedy accuracy",
                title="held-out accuracy (vLLM solid, ours dashed)")
    axes[1].set(xlabel="RL step", ylabel="rollout_mismatch", title="log-prob mismatch the TIS cap sees (0 at 1e-12)")
    axes[2].set(xlabel="publication", ylabel="max |W_vllm − W_trainer|", title="drift of vLLM's masters (exact)")
    axes[3].set(xlabel="vLLM run", ylabel="seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # the sync panel is empty without a vLLM run
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", action="store_true", help="write rl.{json,md,png} from the finished runs")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the study's 40)")
    parser.add_argument("--runs-dir", type=Path, default=RUNS)
    parser.add_argument("--out-dir", type=Path, default=HERE, help="where --report writes")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="an interpreter that imports vllm")
    parser.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    if args.report:
        report(args.runs_dir, args.out_dir)
    elif args.engine:
        summary = run(args.engine, args.seed, args.runs_dir, args.steps, vllm_python=args.vllm_python,
                      vllm_dtype=args.vllm_dtype)
        print(f"{args.engine} seed {args.seed}: held-out {summary['accuracy_before']:.3f} → "
              f"{summary['accuracy_after']:.3f} in {summary['seconds']:.0f} s")
    else:
        parser.error("give --engine (one run) or --report")


if __name__ == "__main__":
    main()
