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
contenders (finished runs are reused); "routing" runs the given cells again into <out>/routing/ for their routing
metrics (the train step logs `routing/...` since the commit after the grid's code; logra_jax.rl.routing);
--report only tabulates and plots what has finished.

Run:  nice -n 10 python -m experiments.moe.learning --phase warm --seeds 1 2 --jobs 1   (alongside the next)
      nice -n 10 python -m experiments.moe.learning --phase grid --seeds 0 1 2 [--jobs 2]
      nice -n 10 python -m experiments.moe.learning --phase routing --seeds 0 --variants <the two best cells>
      python -m experiments.moe.learning --report
Writes experiments/moe/learning/{learning.json, learning.png} (runs in learning/runs/, git-ignored). The best step
sizes are chosen on the seeds on which every cell has finished (the same for both contenders), the verdict is taken
on the seeds where both best cells have: `--variants` runs a subset of the cells (e.g. the best ones on more seeds).
learning.png adds the routing mismatch over the run (the share of response tokens whose top-k set differs between
the engine's rollout and the trainer's forward in some layer, and the share affected) of the routing phase's runs
of the best cells.
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
    largest_drop,
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


def report(out: Path, seeds: tuple[int, ...]) -> dict[str, Any]:
    """Per cell: held-out before/after on each of `seeds` that has finished; per contender: the best step size,
    the highest mean over the sweep seeds (those of `seeds` on which every cell of both contenders has finished:
    the same seeds for both); the paired verdict LoGRA − AdamW (points) at the best step sizes, on the seeds where
    both have finished. Writes out/learning.json and out/learning.png."""
    cells: dict[str, Any] = {}
    for name in variants():
        done = [s for s in seeds if finished_summary(out, name, s) is not None]
        summaries = [finished_summary(out, name, s) for s in done]
        rows = [run_metrics(out, name, s) for s in done]
        cells[name] = {"seeds": done, "accuracy_before": [x["accuracy_before"] for x in summaries],
                       "accuracy_after": [x["accuracy_after"] for x in summaries],
                       "largest_drop": [largest_drop([r["eval_accuracy"] for r in m if "eval_accuracy" in r])
                                        for m in rows],
                       "step_time_median": statistics.median(r["step_time"] for m in rows for r in m if "loss" in r)
                       if rows else None,
                       "routing_mismatch_mean": _routing_mean(rows)}
    sweep_seeds = [s for s in seeds if all(s in c["seeds"] for c in cells.values())]
    best, verdict, verdict_seeds = {}, None, []
    if sweep_seeds:
        for contender, (_, grid, _) in CONTENDERS.items():
            best[contender] = max((variant_name(contender, v) for v in grid),
                                  key=lambda n: statistics.fmean(_after(cells[n], sweep_seeds)))
        a, b = cells[best["logra"]], cells[best["adamw-targets"]]
        verdict_seeds = [s for s in seeds if s in a["seeds"] and s in b["seeds"]]
        diffs = [100 * (x - y) for x, y in zip(_after(a, verdict_seeds), _after(b, verdict_seeds), strict=True)]
        verdict = paired(diffs, names=("LoGRA", "AdamW-targets"))
    results = {"rl_steps": RL_STEPS, "sweep_seeds": sweep_seeds, "verdict_seeds": verdict_seeds, "cells": cells,
               "best": best, "paired_points": verdict, "routing": routing_series(out / "routing", seeds)}
    (out / "learning.json").write_text(json.dumps(results, indent=1) + "\n")
    if best:
        plot(out, results)
    return results


def table(results: dict[str, Any]) -> str:
    """Markdown: per cell, held-out after RL per seed and mean ± std, the largest drop between evaluations, the
    median step time; the best cell of each contender in bold."""
    lines = ["| contender | step size | held-out after, per seed | mean ± std | largest drop | step time (s) |",
             "|---" * 6 + "|"]
    for name, cell in results["cells"].items():
        contender, setting = name.split("@")
        after = cell["accuracy_after"]
        mean = statistics.fmean(after) if after else float("nan")
        sd = statistics.stdev(after) if len(after) > 1 else 0.0
        mark = "**" if name in results["best"].values() else ""
        time = "–" if cell["step_time_median"] is None else f"{cell['step_time_median']:.2f}"
        lines.append(f"| {mark}{contender}{mark} | {setting} | "
                     f"{', '.join(f'{a:.3f}' for a in after)} | {mean:.3f} ± {sd:.3f}"
                     f" | {max(cell['largest_drop'], default=0.0):.3f} | {time} |")
    return "\n".join(lines)


def _after(cell: dict[str, Any], seeds: list[int]) -> list[float]:
    """A cell's final held-out accuracy on `seeds`, in that order."""
    by_seed = dict(zip(cell["seeds"], cell["accuracy_after"], strict=True))
    return [by_seed[s] for s in seeds]


def routing_series(out: Path, seeds: tuple[int, ...]) -> dict[str, Any]:
    """Per cell re-run by the routing phase (out = <study>/routing): per seed, held-out before/after and the per-step
    routing metrics of its metrics.jsonl (`routing/...`); cells or seeds without them are left out."""
    series: dict[str, Any] = {}
    for name in variants():
        for seed in seeds:
            summary = finished_summary(out, name, seed)
            if summary is None:
                continue
            steps = [r for r in run_metrics(out, name, seed) if "loss" in r and ROUTING in r]
            if steps:
                keys = sorted(k for k in steps[0] if k.startswith("routing/"))
                series.setdefault(name, {})[str(seed)] = {
                    "accuracy_before": summary["accuracy_before"], "accuracy_after": summary["accuracy_after"],
                    "steps": [r["step"] for r in steps], **{k: [r[k] for r in steps] for k in keys}}
    return series


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

    seeds, cells = results["verdict_seeds"], results["cells"]
    routing = results["routing"]
    fig, axes = plt.subplots(1, 3 if routing else 2, figsize=(15 if routing else 11, 4.2))
    for i, (contender, (field, grid, _)) in enumerate(CONTENDERS.items()):
        color = f"C{i}"
        names = [variant_name(contender, v) for v in grid]
        xs = np.arange(len(grid)) + (i - 0.5) * 0.08
        for k, name in enumerate(names):
            after = _after(cells[name], results["sweep_seeds"])
            axes[0].plot([xs[k]] * len(after), after, ".", color=color, alpha=0.5)
        means = [statistics.fmean(_after(cells[n], results["sweep_seeds"])) for n in names]
        axes[0].plot(xs, means, "o-", color=color, label=f"{contender} ({field}: {', '.join(f'{v:g}' for v in grid)})")
        if contender not in results["best"]:
            continue
        best = results["best"][contender]
        rows = [run_metrics(out, best, s) for s in seeds]
        steps = sorted({r["step"] for m in rows for r in m if "eval_accuracy" in r})
        acc = [np.mean([r["eval_accuracy"] for m in rows for r in m if r["step"] == s and "eval_accuracy" in r])
               for s in steps]
        axes[1].plot(steps, acc, "o-", color=color, label=best)
        for seed, run in routing.get(best, {}).items():
            axes[2].plot(run["steps"], run[ROUTING], color=color, label=f"{best}, seed {seed}")
            affected = "routing/affected_share"
            if affected in run:
                axes[2].plot(run["steps"], run[affected], "--", color=color, label=f"affected tokens, seed {seed}")
    axes[0].set(xticks=range(3), xticklabels=["low", "mid", "high"], xlabel="step size (×3 apart)",
                ylabel=f"held-out accuracy after {results['rl_steps']} RL steps",
                title=f"step-size sweep (seeds {', '.join(map(str, results['sweep_seeds']))})")
    axes[1].set(xlabel="RL step", ylabel="held-out greedy accuracy",
                title=f"at each best step size (mean of seeds {', '.join(map(str, seeds))})")
    if routing:
        axes[2].set(xlabel="RL step", ylabel="share of response tokens", title="routing mismatch engine vs trainer")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("MoE demo (4 experts, top-2): LoGRA vs AdamW on the same targets")
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("warm", "grid", "routing"), default="grid")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(variants()), choices=list(variants()),
                        help="grid cells to run (default: all)")
    parser.add_argument("--out-dir", type=Path, default=OUT)
    parser.add_argument("--report", action="store_true", help="start no run; tabulate and plot what has finished")
    args = parser.parse_args()
    out, seeds = args.out_dir, tuple(args.seeds)
    if not args.report:
        base = base_config(out)
        if args.phase == "warm":  # the warm start alone: one RL step, the same task and SFT settings (the cache key)
            run_sweep(merged(base, {"train": {"steps": 1, "eval_every": 0}}), {"warm": {}}, seeds, out,
                      jobs=args.jobs, step_memory=False, name="runs/warm", title="warm starts")
            return
        if args.phase == "routing":  # the cells again, with the code that logs the routing metrics
            run_sweep(base, {n: variants()[n] for n in args.variants}, seeds, out / "routing", jobs=args.jobs,
                      step_memory=False, name="runs/routing", title="routing mismatch")
            return
        # the sweep's own summary and curves of this invocation's cells go with the runs (not committed)
        run_sweep(base, {n: variants()[n] for n in args.variants}, seeds, out, jobs=args.jobs, step_memory=False,
                  name="runs/grid", title=f"MoE demo, LoGRA vs AdamW-targets, {RL_STEPS} RL steps")
    results = report(out, SEEDS)
    print(table(results))
    print(json.dumps({k: results[k] for k in ("best", "paired_points")}, indent=1))


if __name__ == "__main__":
    main()
