"""Learning parity, like for like: does LoGRA learn as well as dense Adam on the same weights?

Contenders (every one starts from the same SFT warm start of its seed, computed once per seed and cached, and runs
the same RL steps on the same batches; only the optimizer differs):
  adamw-all        AdamW on every parameter
  adamw-targets    AdamW on exactly LoGRA's targets (attention + MLP projections), the rest frozen
  adamw-targets-b1zero  adamw-targets without AdamW's first moment (β₁ = 0), as RowAdam has none: an ablation
  galore           optax GaLore (rank 64) on the targets, AdamW elsewhere
  logra-kl         LoGRA (sketch-native, rank 64) with the predicted-KL controller (demo's raw ratio 3e-3)
  logra-fixed      LoGRA with a fixed update ratio (no KL control)
  logra-nt-adamw   LoGRA with a fixed update ratio and the non-targets trained by AdamW (lr 1e-4, not swept)
  rowadam-dense    LoGRA's RowAdam + update ratio on the targets' dense gradients (no sketch)
  logra-layer      LoGRA, fixed ratio applied per layer (each layer moves by the ratio of its own norm): a remedy
  logra-layer-kl   the per-layer ratio under the predicted-KL controller
  logra-kl-undo    logra-kl with steps undone when the realised KL on the probe exceeds 4× the budget (the remedy)
Protocol: each contender's step size (AdamW/GaLore lr, LoGRA update ratio or KL budget) over 4 log-spaced values
× 2 seeds ("sweep"); then each contender's best value (highest mean final held-out accuracy) with 5 seeds
("best"; seeds 0 and 1 are reused). Reported per seed: held-out before/after, the largest drop between
consecutive evaluations; curves of the best settings.

Tasks: "demo" (configs/demo.py: two-digit additions with carries after SFT on additions without) and
"three_digit" (three-digit additions with carries after SFT on three-digit additions without; shares no tuning
with the demo).

Run:  python -m experiments.parity.run --task demo [--phase sweep|best|all] [--jobs 2] [--contenders ...]
(finished runs are reused; a later invocation with other contenders adds them to the same tables)
Writes experiments/parity/<task>/{sweep,best}.json and .md (every contender run so far), sweep.png (held-out vs
step size), best_curves.png, and {sweep,best}_last.json / _curves.png (this invocation's runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from experiments.sweep import demo_base, merged, plot_curves, run_sweep

HERE = Path(__file__).parent
# Every LoGRA contender states its step rule in full (kl_control, ratio_scope), so that none depends on what
# configs/demo.py happens to default to (since this study it runs the per-layer ratio without KL control).
NO_KL = {"kl_control": False}
GLOBAL, LAYER = {"ratio_scope": "global"}, {"ratio_scope": "layer"}
# contender → (step-size field, grid, fixed overrides)
CONTENDERS: dict[str, tuple[str, tuple[float, ...], dict[str, Any]]] = {
    "adamw-all": ("learning_rate", (3e-5, 1e-4, 3e-4, 1e-3), {"name": "adamw", **NO_KL}),
    "adamw-targets": ("learning_rate", (3e-5, 1e-4, 3e-4, 1e-3), {"name": "adamw", "targets_only": True, **NO_KL}),
    # Ablation of the first moment: RowAdam has none; does AdamW lose LoGRA's remaining points without its own?
    "adamw-targets-b1zero": ("learning_rate", (3e-5, 1e-4, 3e-4, 1e-3),
                           {"name": "adamw", "targets_only": True, "adam_b1": 0.0, **NO_KL}),
    "galore": ("learning_rate", (1e-4, 3e-4, 1e-3, 3e-3), {"name": "galore", **NO_KL}),
    "logra-kl": ("kl_budget", (1.25e-3, 5e-3, 2e-2, 8e-2, 3.2e-1), {"kl_control": True, **GLOBAL}),
    "logra-fixed": ("update_ratio", (1e-3, 3e-3, 1e-2, 3e-2), {**NO_KL, **GLOBAL}),
    "logra-nt-adamw": ("update_ratio", (1e-3, 3e-3, 1e-2, 3e-2),
                       {"non_targets": "adamw", "learning_rate": 1e-4, **NO_KL, **GLOBAL}),
    "rowadam-dense": ("update_ratio", (1e-3, 3e-3, 1e-2, 3e-2), {"name": "row_adam", **NO_KL, **GLOBAL}),
    # The remedy tried for the component at fault (the step-size rule, see README): each layer moves by the
    # update ratio of its own norm (optimizer.ratio_scope="layer") instead of one global ratio.
    "logra-layer": ("update_ratio", (1e-3, 3e-3, 1e-2, 3e-2), {**NO_KL, **LAYER}),
    # The per-layer ratio (raw ratio 3e-3) under the predicted-KL controller: the controller rescales the
    # per-layer step to the budget.
    "logra-layer-kl": ("kl_budget", (5e-3, 2e-2, 8e-2, 3.2e-1), {"kl_control": True, "update_ratio": 3e-3,
                                                                  **LAYER}),
    # The remedy tried for LoGRA's drops: logra-kl whose steps are undone when the realised KL on the probe
    # exceeds 4× the budget (optimizer.kl_undo_above).
    "logra-kl-undo": ("kl_budget", (5e-3, 2e-2, 8e-2, 3.2e-1), {"kl_control": True, "kl_undo_above": 4.0,
                                                                 **GLOBAL}),
}
SWEEP_SEEDS, BEST_SEEDS = (0, 1), (0, 1, 2, 3, 4)


def task_config(task: str) -> dict[str, Any]:
    """The base config of a task (demo's model, RL and SFT settings; the task and SFT problems differ)."""
    base = demo_base()
    if task == "three_digit":
        base = merged(base, {"task": {"difficulty": 3, "carries": "some"},
                             "sft": {"difficulty": 3, "carries": "none"}})
    elif task != "demo":
        raise ValueError(f"--task must be 'demo' or 'three_digit', got {task!r}")
    return merged(base, {"sft": {"cache_dir": str(HERE / task / "runs" / "sft_cache")}})


def merge_into(path: Path, results: dict[str, Any]) -> dict[str, Any]:
    """`results` plus the variants already in the file at `path` (written by earlier or concurrent invocations)
    that this one did not run, so contenders can be run in separate invocations; rewrites `path`."""
    if path.exists():
        earlier = json.loads(path.read_text())["variants"]
        results = {**results, "variants": {**{k: v for k, v in earlier.items() if k not in results["variants"]},
                                           **results["variants"]}}
    path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def variant_name(contender: str, value: float) -> str:
    return f"{contender}@{CONTENDERS[contender][0]}={value:g}"


def variant(contender: str, value: float) -> dict[str, dict[str, Any]]:
    field, _, fixed = CONTENDERS[contender]
    overrides = {**fixed, field: value}
    if field == "kl_budget":
        overrides["kl_budget_final"] = value / 4  # the demo's schedule shape (2e-2 → 5e-3)
    return {"optimizer": overrides}


def best_values(sweep: dict[str, Any]) -> dict[str, float]:
    """Each contender's grid value with the highest mean final held-out accuracy over the sweep's seeds."""
    best = {}
    for contender, (_, grid, _) in CONTENDERS.items():
        means = {v: sweep["variants"][variant_name(contender, v)]["mean_std"]["accuracy_after"][0] for v in grid
                 if variant_name(contender, v) in sweep["variants"]}
        if means:
            best[contender] = max(means, key=means.get)
    return best


def sweep_table(sweep: dict[str, Any]) -> str:
    lines = ["| contender | step size | held-out after (seed 0, seed 1) | mean | largest drop |", "|---" * 5 + "|"]
    for name, v in sweep["variants"].items():
        accs = [p["accuracy_after"] for p in v["seeds"]]
        drops = [p["largest_drop"] for p in v["seeds"]]
        contender, setting = name.split("@")
        lines.append(f"| {contender} | {setting} | {', '.join(f'{a:.3f}' for a in accs)} | "
                     f"{statistics.fmean(accs):.3f} | {max(drops):.3f} |")
    return "\n".join(lines)


def best_table(best: dict[str, Any]) -> str:
    lines = ["| contender (best step size) | held-out before | held-out after, mean ± std | per seed | "
             "largest drop (worst seed) | step time (s) |", "|---" * 6 + "|"]
    for name, v in best["variants"].items():
        ms = v["mean_std"]
        per_seed = ", ".join(f"{p['accuracy_after']:.3f}" for p in v["seeds"])
        lines.append(f"| {name} | {ms['accuracy_before'][0]:.3f} | {ms['accuracy_after'][0]:.3f} ± "
                     f"{ms['accuracy_after'][1]:.3f} | {per_seed} | {max(p['largest_drop'] for p in v['seeds']):.3f} "
                     f"| {ms['step_time_median'][0]:.2f} |")
    return "\n".join(lines)


def plot_sweep(sweep: dict[str, Any], path: Path, title: str) -> None:
    """Mean final held-out accuracy against step size, one panel per kind of step size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = sorted({field for field, _, _ in CONTENDERS.values()})
    fig, axes = plt.subplots(1, len(fields), figsize=(4.5 * len(fields), 3.8), sharey=True)
    for ax, field in zip(axes, fields, strict=True):
        for i, (contender, (f, grid, _)) in enumerate(CONTENDERS.items()):
            names = [variant_name(contender, v) for v in grid]
            if f != field or not all(n in sweep["variants"] for n in names):
                continue
            runs = [sweep["variants"][n]["seeds"] for n in names]
            ax.plot(grid, [statistics.fmean(p["accuracy_after"] for p in r) for r in runs], "o-", color=f"C{i}",
                    label=contender)
            for v, r in zip(grid, runs, strict=True):
                ax.scatter([v] * len(r), [p["accuracy_after"] for p in r], color=f"C{i}", s=8, alpha=0.5)
        ax.set(xscale="log", xlabel=field, title=field)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("final held-out accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="demo", choices=("demo", "three_digit"))
    parser.add_argument("--phase", default="all", choices=("sweep", "best", "all"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    args = parser.parse_args()
    out = HERE / args.task
    base = task_config(args.task)
    title = f"learning parity, {args.task} task"
    if args.phase in ("sweep", "all"):
        variants = {variant_name(c, v): variant(c, v) for c in args.contenders for v in CONTENDERS[c][1]}
        sweep = run_sweep(base, variants, SWEEP_SEEDS, out, jobs=args.jobs, title=f"{title}: step-size sweep",
                          step_memory=False, name="sweep_last")
        sweep = merge_into(out / "sweep.json", sweep)
        (out / "sweep.md").write_text(sweep_table(sweep) + "\n")
        plot_sweep(sweep, out / "sweep.png", f"{title}: final held-out accuracy vs step size (2 seeds)")
        print(sweep_table(sweep))
    if args.phase in ("best", "all"):
        sweep = json.loads((out / "sweep.json").read_text())
        chosen = best_values(sweep)
        variants = {variant_name(c, chosen[c]): variant(c, chosen[c]) for c in args.contenders if c in chosen}
        best = run_sweep(base, variants, BEST_SEEDS, out, jobs=args.jobs, title=f"{title}: best settings",
                         name="best_last")
        best = merge_into(out / "best.json", best)
        plot_curves(out, {name: {} for name in best["variants"]}, BEST_SEEDS, f"{title}: best settings",
                    filename="best_curves.png")
        (out / "best.md").write_text(best_table(best) + "\n")
        print(best_table(best))


if __name__ == "__main__":
    main()
