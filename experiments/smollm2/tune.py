r"""SmolLM2-135M-Instruct, tuned: LoGRA vs AdamW on the same weights with both step sizes swept (issue 33).

experiments/smollm2/parity.py compared the two at matched, untuned step sizes (AdamW lr 1e-5, LoGRA per-layer ratio
5e-5). Here each contender's step size is swept over 3 values (×3 apart, around the matched one) on seed 0, then
each contender's best value runs 2 more seeds (3 in all). Same task, SFT warm start, RL batches and run length as
parity.py (its COMMON settings; the warm start of each seed is computed once and shared by every run of that seed).

Contenders:
  adamw-targets          AdamW on the 7 projections of the 30 layers, the rest frozen; lr ∈ {1e-6, 3e-6, 1e-5, 3e-5}
                         (1e-6 added because 3e-6, the first grid's edge, won)
  logra-layer            LoGRA sketch-native rank 64, per-layer ratio ∈ {1.7e-5, 5e-5, 1.5e-4}, no KL control
  logra-layer-m0.9-kinf  logra-layer + a first moment β₁ = 0.9 with one fixed projection (the best LoGRA of the
                         demo study, experiments/momentum)

Run:  nice -n 10 python -m experiments.smollm2.tune --phase sweep|best|matched [--jobs 1] [--contenders ...]
      [--seeds ...] [--report]
Writes experiments/smollm2/tune/{sweep,best}.{json,md} and tune.png; runs in tune/runs/ (git-ignored; reused), SFT
warm starts in parity/runs/sft_cache (shared with parity.py). A run the committed results already hold (this
study's JSON files, or parity.py's results.json: its two contenders at the matched values, same settings) is taken
from them, not run again; its point names the file.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from experiments.parity.run import merge_into
from experiments.smollm2.parity import COMMON, CONFIG
from experiments.smollm2.parity import OUT as PARITY_OUT
from experiments.sweep import accuracy_after as sweep_accuracy_after
from experiments.sweep import load_config, run_sweep

HERE = Path(__file__).parent
OUT = HERE / "tune"
SWEEP_SEEDS, BEST_SEEDS = (0,), (0, 1, 2)
ADAMW = {"name": "adamw", "targets_only": True, "kl_control": False}
LOGRA = {"name": "logra", "ratio_scope": "layer", "kl_control": False}
# contender → (step-size field, grid, fixed optimizer overrides); the grids hold parity.py's matched value
MATCHED = {"learning_rate": 1e-5, "update_ratio": 5e-5}
CONTENDERS: dict[str, tuple[str, tuple[float, ...], dict[str, Any]]] = {
    "adamw-targets": ("learning_rate", (1e-6, 3e-6, 1e-5, 3e-5), ADAMW),
    "logra-layer": ("update_ratio", (1.7e-5, 5e-5, 1.5e-4), LOGRA),
    "logra-layer-m0.9-kinf": ("update_ratio", (1.7e-5, 5e-5, 1.5e-4), {**LOGRA, "momentum": 0.9, "refresh": False}),
}


def cell(contender: str, value: float) -> str:
    return f"{contender}@{CONTENDERS[contender][0]}={value:g}"


def split(name: str) -> tuple[str, float]:
    """cell's inverse: (contender, value)."""
    contender, setting = name.split("@")
    return contender, float(setting.split("=")[1])


def overrides(contender: str, value: float) -> dict[str, Any]:
    name, _, fixed = CONTENDERS[contender]
    return {**COMMON, "optimizer": {**fixed, name: value}}


# Results files whose runs are not run again (committed, while the run directories are not): this study's phases
# and parity.py's matched runs, which are values on these contenders' grids with the same settings.
RECORDED = [OUT / f"{phase}.json" for phase in ("matched", "sweep", "best")] + [PARITY_OUT / "results.json"]


def accuracy_after(contender: str, value: float, seed: int) -> float | None:
    """The run's final held-out accuracy, from its run directory or a RECORDED file; None if neither holds it."""
    return sweep_accuracy_after(OUT, cell(contender, value), overrides(contender, value), seed, RECORDED)


def best_value(contender: str) -> float | None:
    """The grid value with the highest mean held-out accuracy over the sweep's seeds (finished runs only)."""
    means = {}
    for v in CONTENDERS[contender][1]:
        accs = [accuracy_after(contender, v, s) for s in SWEEP_SEEDS]
        if None not in accs:
            means[v] = statistics.fmean(accs)
    return max(means, key=means.get) if means else None


def table(results: dict[str, Any]) -> str:
    lines = ["| contender | step size | held-out before | held-out after, per seed | mean ± std | largest drop | "
             "step time (s) |", "|---" * 7 + "|"]
    for name, v in results["variants"].items():
        after = [p["accuracy_after"] for p in v["seeds"]]
        sd = statistics.stdev(after) if len(after) > 1 else 0.0
        contender, setting = name.split("@")
        lines.append(f"| {contender} | {setting} | {v['mean_std']['accuracy_before'][0]:.3f} | "
                     f"{', '.join(f'{a:.3f}' for a in after)} | {statistics.fmean(after):.3f} ± {sd:.3f} | "
                     f"{max(p['largest_drop'] for p in v['seeds']):.3f} | "
                     f"{statistics.median(p['step_time_median'] for p in v['seeds']):.1f} |")
    return "\n".join(lines)


def plot(path: Path) -> None:
    """Left: held-out accuracy after RL against each contender's step size (the sweep, seed 0); right: each
    contender's best step size per seed (the best phase). From sweep.json and best.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    phases = {p: json.loads((OUT / f"{p}.json").read_text())["variants"] for p in ("sweep", "best")
              if (OUT / f"{p}.json").exists()}
    for i, contender in enumerate(CONTENDERS):
        field = CONTENDERS[contender][0]
        # step size in units of the matched one, so AdamW's lr and LoGRA's ratio share an axis
        pts = sorted((split(n)[1] / MATCHED[field], statistics.fmean(q["accuracy_after"] for q in v["seeds"]))
                     for n, v in phases.get("sweep", {}).items() if split(n)[0] == contender)
        if pts:
            ax_s.plot(*zip(*pts, strict=True), "o-", color=f"C{i}", label=contender)
        for n, v in phases.get("best", {}).items():
            if split(n)[0] == contender:
                seeds = [q["seed"] for q in v["seeds"]]
                ax_b.plot(seeds, [q["accuracy_after"] for q in v["seeds"]], "o-", color=f"C{i}",
                          label=f"{contender} ({n.split('@')[1]})")
    ax_s.set(xscale="log", xlabel="step size / parity.py's matched one (lr 1e-5, ratio 5e-5)",
             ylabel="held-out accuracy after 40 RL steps", title="sweep, seed 0")
    ax_b.set(xlabel="seed", xticks=list(BEST_SEEDS), title="best step size per contender")
    for ax in (ax_s, ax_b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, two-digit additions: step sizes tuned")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", default="sweep", choices=("sweep", "best", "matched"),
                        help="matched: every contender at parity.py's matched step size (no sweep)")
    parser.add_argument("--seeds", type=int, nargs="+", help="instead of the phase's seeds")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--report", action="store_true", help="start no run: tabulate what has finished")
    args = parser.parse_args()
    base = load_config(CONFIG)  # COMMON's SFT cache is parity.py's: the warm starts are shared with that study
    if args.phase == "sweep":
        seeds = SWEEP_SEEDS
        variants = {cell(c, v): overrides(c, v) for c in args.contenders for v in CONTENDERS[c][1]}
    elif args.phase == "matched":
        seeds = SWEEP_SEEDS
        matched = {c: MATCHED[CONTENDERS[c][0]] for c in args.contenders}
        variants = {cell(c, v): overrides(c, v) for c, v in matched.items()}
    else:
        seeds = BEST_SEEDS
        chosen = {c: best_value(c) for c in args.contenders}
        variants = {cell(c, v): overrides(c, v) for c, v in chosen.items() if v is not None}
    seeds = tuple(args.seeds) if args.seeds else seeds
    if args.report:
        variants = {n: v for n, v in variants.items()
                    if all(accuracy_after(*split(n), s) is not None for s in seeds)}
    else:
        for seed in seeds:  # seed by seed: an interrupted study still holds paired seeds
            run_sweep(base, variants, [seed], OUT, jobs=args.jobs, step_memory=False, name=f"runs/{args.phase}_last",
                      reuse=RECORDED)
    results = run_sweep(base, variants, seeds, OUT, jobs=args.jobs, step_memory=False, name=f"runs/{args.phase}_all",
                        title=f"SmolLM2-135M-Instruct, step sizes tuned: {args.phase}", reuse=RECORDED)
    results["command"] = (f"nice -n 10 python -m experiments.smollm2.tune --phase {args.phase} --jobs {args.jobs} "
                          f"--contenders {' '.join(args.contenders)}"
                          + (f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds else ""))
    results = merge_into(OUT / f"{args.phase}.json", results)  # with earlier invocations' contenders
    text = table(results)
    (OUT / f"{args.phase}.md").write_text(text + "\n")
    plot(OUT / "tune.png")
    print(text)


if __name__ == "__main__":
    main()
