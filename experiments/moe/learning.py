"""LoGRA vs AdamW on the same targets, the demo task on the MoE demo model (issue 60, item 7).

Model and recipe: configs/demo.py:moe (a 4-layer, 128-wide Qwen3-MoE decoder, 4 experts of width 192, top-2; the
dense demo's SFT warm start and RL recipe). Contenders, from the same SFT warm start of their seed and on the same
batches (only the optimizer differs):
  logra          the demo's LoGRA (sketch-native, rank 64 on every attention projection and every expert's
                 gate/up/down, per-layer update ratio, sketch-space momentum 0.9 with one fixed projection);
                 step size: optimizer.update_ratio
  adamw-targets  AdamW on exactly LoGRA's targets (attention projections and the experts), the rest frozen (routers,
                 norms, embedding), no KL control; step size: optimizer.learning_rate
Each step size over 3 values a factor 3 apart, centred on the dense demo's best of experiments/parity's sweep (LoGRA
3e-3, AdamW on the targets 3e-4), every (contender, step size) on seeds 0, 1, 2. Each contender's best step size is
the one with the highest mean final held-out accuracy over the seeds; the verdict is
`experiments.sweep.paired` on the per-seed differences (LoGRA − AdamW, points) at the two best step sizes.

The RL run is shortened for every arm alike: RL_STEPS (50) steps instead of the demo's 200 (the same batch: 16
prompts × 16 samples), held-out evaluations every 25 steps, no checkpoints; the SFT warm start is the demo's
(1000 steps). Phases: "warm" computes the seeds' SFT warm starts (a 1-step run each, cached in
<out>/runs/sft_cache, so the grid's runs load them instead of computing them side by side); "grid" runs the
contenders (finished runs are reused); --report only tabulates and plots what has finished.

Run:  nice -n 10 python -m experiments.moe.learning --phase warm --seeds 1 2 --jobs 1   (alongside the next)
      nice -n 10 python -m experiments.moe.learning --phase grid --seeds 0 1 2 [--jobs 2]
      python -m experiments.moe.learning --report
Writes experiments/moe/learning/{grid.json, learning.json, learning.png} (runs in learning/runs/, git-ignored).
If the runs' metrics carry the routing metrics (`routing/...`, logra_jax.rl.routing), learning.png adds the
routing mismatch over the run at each contender's best step size.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from experiments.sweep import (
    DEMO_CONFIG,
    finished_summary,
    load_config,
    merged,
    paired,
    run_metrics,
    run_sweep,
)

HERE = Path(__file__).parent
OUT = HERE / "learning"
RL_STEPS = 50
SEEDS = (0, 1, 2)
# contender → (step-size field, grid, fixed optimizer overrides)
CONTENDERS: dict[str, tuple[str, tuple[float, ...], dict[str, Any]]] = {
    "logra": ("update_ratio", (1e-3, 3e-3, 1e-2), {}),
    "adamw-targets": ("learning_rate", (1e-4, 3e-4, 1e-3),
                      {"name": "adamw", "targets_only": True, "kl_control": False, "momentum": 0.0}),
}
ROUTING = "routing/mismatch_share"


def base_config(out: Path) -> dict[str, Any]:
    """configs/demo.py:moe with the RL run shortened (RL_STEPS steps, evaluations every 25, no checkpoints) and the
    warm starts cached in out/runs/sft_cache."""
    return merged(load_config(DEMO_CONFIG, "moe"), {
        "train": {"steps": RL_STEPS, "eval_every": 25, "checkpoint_every": 0},
        "sft": {"cache_dir": str(out / "runs" / "sft_cache")}})


def variant_name(contender: str, value: float) -> str:
    return f"{contender}@{CONTENDERS[contender][0]}={value:g}"


def variants() -> dict[str, dict[str, dict[str, Any]]]:
    """Every (contender, step size) cell's overrides, by name."""
    return {variant_name(c, v): {"optimizer": {**fixed, field: v}}
            for c, (field, grid, fixed) in CONTENDERS.items() for v in grid}


def accuracies(out: Path, name: str, seeds: tuple[int, ...]) -> list[float] | None:
    """Final held-out accuracy per seed of a cell; None unless every seed has finished."""
    summaries = [finished_summary(out, name, s) for s in seeds]
    return None if None in summaries else [s["accuracy_after"] for s in summaries]


def report(out: Path, seeds: tuple[int, ...]) -> dict[str, Any]:
    """Per cell: held-out before/after per seed; per contender: the best step size (highest mean over seeds);
    the paired verdict LoGRA − AdamW at the best step sizes. Writes out/learning.json and out/learning.png."""
    cells: dict[str, Any] = {}
    for name in variants():
        after = accuracies(out, name, seeds)
        if after is None:
            continue
        before = [finished_summary(out, name, s)["accuracy_before"] for s in seeds]
        rows = [run_metrics(out, name, s) for s in seeds]
        cells[name] = {"accuracy_before": before, "accuracy_after": after, "mean_after": statistics.fmean(after),
                       "step_time_median": statistics.median(r["step_time"] for m in rows for r in m if "loss" in r),
                       "routing_mismatch_mean": _routing_mean(rows)}
    best = {}
    for contender, (_, grid, _) in CONTENDERS.items():
        done = [variant_name(contender, v) for v in grid if variant_name(contender, v) in cells]
        if len(done) == len(grid):
            best[contender] = max(done, key=lambda n: cells[n]["mean_after"])
    verdict = None
    if len(best) == 2:
        a, b = cells[best["logra"]]["accuracy_after"], cells[best["adamw-targets"]]["accuracy_after"]
        verdict = paired([100 * (x - y) for x, y in zip(a, b, strict=True)], names=("LoGRA", "AdamW-targets"))
    results = {"seeds": list(seeds), "rl_steps": RL_STEPS, "cells": cells, "best": best, "paired_points": verdict}
    (out / "learning.json").write_text(json.dumps(results, indent=1) + "\n")
    if best:
        plot(out, results)
    return results


def _routing_mean(rows: list[list[dict[str, Any]]]) -> float | None:
    values = [r[ROUTING] for m in rows for r in m if ROUTING in r]
    return statistics.fmean(values) if values else None


def plot(out: Path, results: dict[str, Any]) -> None:
    """Held-out accuracy vs step size (mean and each seed), held-out accuracy over the run at each contender's best
    step size (mean of seeds), and the routing mismatch over the run where the metrics carry it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    seeds, cells = results["seeds"], results["cells"]
    routing = any(c["routing_mismatch_mean"] is not None for c in cells.values())
    fig, axes = plt.subplots(1, 3 if routing else 2, figsize=(15 if routing else 11, 4.2))
    for i, (contender, (field, grid, _)) in enumerate(CONTENDERS.items()):
        color = f"C{i}"
        names = [variant_name(contender, v) for v in grid]
        xs = np.arange(len(grid)) + (i - 0.5) * 0.08
        for k, name in enumerate(names):
            if name in cells:
                axes[0].plot([xs[k]] * len(seeds), cells[name]["accuracy_after"], ".", color=color, alpha=0.5)
        means = [cells[n]["mean_after"] if n in cells else np.nan for n in names]
        axes[0].plot(xs, means, "o-", color=color, label=f"{contender} ({field}: {', '.join(f'{v:g}' for v in grid)})")
        if contender not in results["best"]:
            continue
        best = results["best"][contender]
        rows = [run_metrics(out, best, s) for s in seeds]
        steps = sorted({r["step"] for m in rows for r in m if "eval_accuracy" in r})
        acc = [np.mean([r["eval_accuracy"] for m in rows for r in m if r["step"] == s and "eval_accuracy" in r])
               for s in steps]
        axes[1].plot(steps, acc, "o-", color=color, label=best)
        if routing:
            share = [[r.get(ROUTING, np.nan) for r in m if "loss" in r] for m in rows]
            n = min(len(x) for x in share)
            axes[2].plot(np.arange(1, n + 1), np.nanmean([x[:n] for x in share], axis=0), color=color, label=best)
    axes[0].set(xticks=range(3), xticklabels=["low", "mid", "high"], xlabel="step size (×3 apart)",
                ylabel=f"held-out accuracy after {results['rl_steps']} RL steps", title="step-size sweep")
    axes[1].set(xlabel="RL step", ylabel="held-out greedy accuracy", title="at each best step size (mean of seeds)")
    if routing:
        axes[2].set(xlabel="RL step", ylabel="share of response tokens", title="routing mismatch engine vs trainer")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"MoE demo (4 experts, top-2): LoGRA vs AdamW on the same targets ({len(seeds)} seeds)")
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("warm", "grid"), default="grid")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=OUT)
    parser.add_argument("--report", action="store_true", help="start no run; tabulate and plot what has finished")
    args = parser.parse_args()
    out, seeds = args.out_dir, tuple(args.seeds)
    if not args.report:
        base = base_config(out)
        if args.phase == "warm":  # the warm start alone: one RL step, the same task and SFT settings (the cache key)
            run_sweep(merged(base, {"train": {"steps": 1, "eval_every": 0}}), {"warm": {}}, seeds, out,
                      jobs=args.jobs, step_memory=False, name="warm", title="warm starts")
            return
        run_sweep(base, variants(), seeds, out, jobs=args.jobs, step_memory=False, name="grid",
                  title=f"MoE demo, LoGRA vs AdamW-targets, {RL_STEPS} RL steps")
    results = report(out, tuple(SEEDS) if args.report else seeds)
    print(json.dumps({k: results[k] for k in ("best", "paired_points")}, indent=1))


if __name__ == "__main__":
    main()
