"""A first moment for LoGRA across subspace changes (issue 33): the like-for-like study.

Contenders, all from the same SFT warm start of their seed and on the same batches (experiments/parity's setup; only
the optimizer differs), LoGRA at today's best rule (per-layer update ratio, rank 64, no KL control):
  logra-layer            today's best LoGRA: fresh projections every step, no momentum
  logra-layer-m{β}-k{κ}  + `optimizer.momentum` β₁ (logra_jax.optim.momentum), projections held κ steps
                         (`optimizer.refresh_every`; κ = inf: `optimizer.refresh=False`, one fixed projection)
  logra-layer-k{κ}       the refresh period alone, without momentum
  ...-r{r}               at rank r instead of 64 (the rank phase)
  adamw-targets          AdamW on exactly LoGRA's targets, the like-for-like reference
Protocol (experiments/parity's): "sweep" runs each swept contender's per-layer update ratio over RATIOS × seeds 0
and 1; "best" runs every contender at its best value × seeds 0–4. logra-layer's and AdamW-targets' best values
are those of experiments/parity's sweep of the same task (4 values × 2 seeds, read from its sweep.json); a
contender that is not swept here runs at logra-layer's best ratio. "rank", for the no-momentum rule and the
fixed-projection momentum rule: r ∈ RANKS × RATIOS on seed 0 (rank_sweep.json), then each (rule, rank) at its best
ratio × seeds 0–2 (rank.json); it reports each rank at its best ratio. "alone": the refresh period without
momentum (κ = ∞ and 10) beside logra-layer and the momentum with a fixed projection, all at logra-layer's best
ratio × seeds 0–2 (alone.json), so the effect of each half is separate on the same warm starts.

Run:  nice -n 10 python -m experiments.momentum.run --task demo|three_digit --phase sweep|best|rank|alone [--jobs 2]
      [--contenders ...] [--seeds ...] [--ratios ...] [--report]
Writes experiments/momentum/<task>/{sweep,best,rank}.{json,md}, rank_sweep.json (a phase's contenders accumulate
over invocations) and best_curves.png / rank.png; runs in <task>/runs/ (git-ignored; finished runs are reused, so a
re-invocation only adds what is missing). The committed {sweep,best}.json choose the best phase's values, but no run
is taken from them: the demo's seed 0 there started from a warm start an older model initialisation computed (see
the README), so every phase runs all its cells from this code's warm starts. --report starts no run and tabulates
what has finished.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.parity import run as parity
from experiments.sweep import accuracy_after, finished_summary, merged, plot_curves, run_dir, run_sweep

HERE = Path(__file__).parent
RATIOS = (1e-3, 3e-3, 1e-2)
RANKS = (4, 16, 64)
SWEEP_SEEDS, BEST_SEEDS, RANK_SWEEP_SEEDS, RANK_SEEDS = (0, 1), (0, 1, 2, 3, 4), (0,), (0, 1, 2)
BASE = "logra-layer"


def logra_variant(ratio: float, momentum: float, every: int | None, rank: int = 64) -> dict[str, dict[str, Any]]:
    """logra-layer at `ratio` with momentum β₁, projections held `every` steps (None: fixed for ever), rank r."""
    over = parity.variant("logra-layer", ratio)
    refresh = {"refresh": False} if every is None else {"refresh": True, "refresh_every": every}
    return {"optimizer": {**over["optimizer"], "momentum": momentum, "rank": rank, **refresh}}


def contender_name(momentum: float, every: int | None, rank: int = 64) -> str:
    m = f"-m{momentum:g}" if momentum else ""
    k = "" if every == 1 else f"-k{'inf' if every is None else every}"
    r = "" if rank == 64 else f"-r{rank}"
    return f"logra-layer{m}{k}{r}"


# contender → (swept here?, builder of the overrides at a step size). In order of how much each tells.
Builder = Callable[[float], dict[str, dict[str, Any]]]
CONTENDERS: dict[str, tuple[bool, Builder]] = {
    BASE: (False, lambda v: logra_variant(v, 0.0, 1)),
    contender_name(0.9, None): (True, lambda v: logra_variant(v, 0.9, None)),
    contender_name(0.9, 10): (True, lambda v: logra_variant(v, 0.9, 10)),
    "adamw-targets": (False, lambda v: parity.variant("adamw-targets", v)),
    contender_name(0.9, 1): (False, lambda v: logra_variant(v, 0.9, 1)),
    contender_name(0.0, None): (False, lambda v: logra_variant(v, 0.0, None)),
    contender_name(0.0, 10): (False, lambda v: logra_variant(v, 0.0, 10)),
}
# the alone phase: the refresh period without momentum beside the rule and the momentum, one ratio, RANK_SEEDS
ALONE = (BASE, contender_name(0.0, None), contender_name(0.0, 10), contender_name(0.9, None))
# the rank phase's rules: name → (β₁, κ)
RANK_RULES = {"fresh": (0.0, 1), "m0.9-kinf": (0.9, None)}
RULE_LABELS = {"fresh": "per-layer ratio, fresh projections", "m0.9-kinf": "+ momentum 0.9, fixed projection"}


def rank_contender(rule: str, rank: int) -> str:
    momentum, every = RANK_RULES[rule]
    return contender_name(momentum, every, rank)


def field(contender: str) -> str:
    return "learning_rate" if contender.startswith("adamw") else "update_ratio"


def cell(contender: str, value: float) -> str:
    return f"{contender}@{field(contender)}={value:g}"


def parity_best(task: str) -> dict[str, float]:
    """logra-layer's and AdamW-targets' best step sizes in experiments/parity's sweep of `task`."""
    sweep = json.loads((parity.HERE / task / "sweep.json").read_text())
    best = parity.best_values(sweep)
    return {BASE: best["logra-layer"], "adamw-targets": best["adamw-targets"]}


def recorded(out: Path) -> list[Path]:
    """The task's committed results files: the best phase chooses its values from them where the sweep's runs are
    not here (no run is taken from them, see the docstring)."""
    return [out / f"{phase}.json" for phase in ("sweep", "best", "rank")]


def finished(out: Path, name: str, seeds: tuple[int, ...]) -> bool:
    """Whether every seed's run has finished here (runs are not taken from the results files: see the docstring)."""
    return all(finished_summary(out, name, seed) is not None for seed in seeds)


def best_value(out: Path, contender: str, grid: tuple[float, ...], seeds: tuple[int, ...]) -> float | None:
    """The grid value with the highest mean final held-out accuracy over `seeds` (finished runs only)."""
    means = {}
    for v in grid:
        accs = [accuracy_after(out, cell(contender, v), CONTENDERS[contender][1](v), s, recorded(out)) for s in seeds]
        if None not in accs:
            means[v] = statistics.fmean(accs)
    return max(means, key=means.get) if means else None


def sweep_table(results: dict[str, Any]) -> str:
    lines = ["| contender | step size | held-out after, per seed | mean | largest drop |", "|---" * 5 + "|"]
    for name, v in results["variants"].items():
        accs = [p["accuracy_after"] for p in v["seeds"]]
        contender, setting = name.split("@")
        lines.append(f"| {contender} | {setting} | {', '.join(f'{a:.3f}' for a in accs)} | "
                     f"{statistics.fmean(accs):.3f} | {max(p['largest_drop'] for p in v['seeds']):.3f} |")
    return "\n".join(lines)


def paired(v: dict[str, Any], ref: dict[str, Any] | None) -> tuple[str, str]:
    """v's held-out after minus ref's on the seeds both ran (points): per seed, and their mean."""
    if ref is None or v is ref:
        return "–", "–"
    by_seed = {p["seed"]: p["accuracy_after"] for p in ref["seeds"]}
    diffs = [100 * (p["accuracy_after"] - by_seed[p["seed"]]) for p in v["seeds"] if p["seed"] in by_seed]
    return ", ".join(f"{d:+.1f}" for d in diffs), f"{statistics.fmean(diffs):+.1f}" if diffs else "–"


def best_table(results: dict[str, Any], references: tuple[str, ...]) -> str:
    """Per contender: held-out before/after (mean ± std over seeds), per seed, paired differences against each
    of `references` (cells of the same results)."""
    refs = [(r.split("@")[0], results["variants"].get(r)) for r in references]
    head = " | ".join(f"paired vs {name} (points) | mean" for name, _ in refs)
    lines = [f"| contender (best step size) | seeds | held-out before | held-out after, mean ± std | per seed | "
             f"{head} | largest drop | step time (s) |", "|---" * (7 + 2 * len(refs)) + "|"]
    for name, v in results["variants"].items():
        after = [p["accuracy_after"] for p in v["seeds"]]
        before = [p["accuracy_before"] for p in v["seeds"]]
        cols = " | ".join(" | ".join(paired(v, ref)) for _, ref in refs)
        sd = statistics.stdev(after) if len(after) > 1 else 0.0
        times = [p["step_time_median"] for p in v["seeds"]]
        lines.append(f"| {name} | {len(after)} | {statistics.fmean(before):.3f} | {statistics.fmean(after):.3f} ± "
                     f"{sd:.3f} | {', '.join(f'{a:.3f}' for a in after)} | {cols} | "
                     f"{max(p['largest_drop'] for p in v['seeds']):.3f} | {statistics.median(times):.2f} |")
    return "\n".join(lines)


def rank_table(sweep: dict[str, Any], best: dict[str, Any]) -> str:
    """Per rule and rank: held-out after at each ratio (the sweep's seeds), and at the best ratio per seed and
    mean ± std over the best phase's seeds."""
    lines = ["| rule | rank | " + " | ".join(f"ratio {v:g} (seed 0)" for v in RATIOS)
             + " | best ratio | per seed | mean ± std |", "|---" * (5 + len(RATIOS)) + "|"]
    for rule in RANK_RULES:
        for rank in RANKS:
            contender = rank_contender(rule, rank)
            cells = []
            for v in RATIOS:
                run = sweep["variants"].get(cell(contender, v))
                cells.append("–" if run is None else f"{run['mean_std']['accuracy_after'][0]:.3f}")
            runs = [(v, best["variants"][cell(contender, v)]) for v in RATIOS if cell(contender, v) in
                    best["variants"]]
            if runs:
                v, run = runs[0]
                mean, sd = run["mean_std"]["accuracy_after"]
                per_seed = ", ".join(f"{p['accuracy_after']:.3f}" for p in run["seeds"])
                tail = f"{v:g} | {per_seed} | {mean:.3f} ± {sd:.3f}"
            else:
                tail = "– | – | –"
            lines.append(f"| {RULE_LABELS[rule]} | {rank} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines)


def plot_rank(results: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, rule in enumerate(RANK_RULES):
        xs, ys, errs = [], [], []
        for rank in RANKS:
            contender = rank_contender(rule, rank)
            runs = [results["variants"][cell(contender, v)] for v in RATIOS if cell(contender, v) in
                    results["variants"]]
            if runs:
                best = max(runs, key=lambda r: r["mean_std"]["accuracy_after"][0])
                xs.append(rank)
                ys.append(best["mean_std"]["accuracy_after"][0])
                errs.append(best["mean_std"]["accuracy_after"][1])
        label = RULE_LABELS[rule]
        ax.errorbar(xs, ys, yerr=errs, fmt="o-", color=f"C{i}", capsize=3, label=label)
    ax.set(xscale="log", xticks=list(RANKS), xticklabels=[str(r) for r in RANKS], xlabel="rank r",
           ylabel="final held-out accuracy (best ratio, mean ± std)", title=title)
    ax.minorticks_off()  # only the ranks' ticks on the log axis
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="demo", choices=("demo", "three_digit"))
    parser.add_argument("--phase", default="sweep", choices=("sweep", "best", "rank", "alone"))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--rules", nargs="+", default=list(RANK_RULES), choices=list(RANK_RULES),
                        help="the rank phase's rules")
    parser.add_argument("--seeds", type=int, nargs="+", help="instead of the phase's seeds (a reduced run)")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS),
                        help="sweep: the ratios (extend the grid where its edge wins); best: the ratios to choose from")
    parser.add_argument("--report", action="store_true", help="start no run: tabulate what has finished")
    args = parser.parse_args()
    out = HERE / args.task
    base = merged(parity.task_config(args.task), {"sft": {"cache_dir": str(out / "runs" / "sft_cache")}})
    fixed = parity_best(args.task)
    title = f"{args.task} task: LoGRA with momentum / held projections"

    if args.phase == "sweep":
        seeds = SWEEP_SEEDS
        variants = {cell(c, v): CONTENDERS[c][1](v) for c in args.contenders if CONTENDERS[c][0]
                    for v in args.ratios}
    elif args.phase == "alone":  # the refresh period with and without momentum, at logra-layer's ratio, paired
        seeds = RANK_SEEDS
        variants = {cell(c, fixed[BASE]): CONTENDERS[c][1](fixed[BASE]) for c in ALONE}
    elif args.phase == "best":
        seeds = BEST_SEEDS
        variants = {}
        for c in args.contenders:
            grid = tuple(args.ratios)
            value = best_value(out, c, grid, SWEEP_SEEDS) if CONTENDERS[c][0] else fixed.get(c, fixed[BASE])
            if value is None:
                print(f"{c}: no finished sweep yet (run --phase sweep first); left out")
                continue
            variants[cell(c, value)] = CONTENDERS[c][1](value)
    else:  # the ratios swept per (rule, rank) on seed 0, then each at its best ratio × RANK_SEEDS
        rules = {rule: mk for rule, mk in RANK_RULES.items() if rule in args.rules}
        grid = {cell(rank_contender(rule, r), v): logra_variant(v, m, k, r)
                for rule, (m, k) in rules.items() for r in RANKS for v in RATIOS}
        if args.report:
            grid = {name: v for name, v in grid.items() if finished(out, name, RANK_SWEEP_SEEDS)}
        rank_sweep = parity.merge_into(out / "rank_sweep.json", run_sweep(
            base, grid, RANK_SWEEP_SEEDS, out, jobs=args.jobs, step_memory=False, name="runs/rank_sweep_all",
            title=f"{title}: rank × ratio"))
        seeds, variants = RANK_SEEDS, {}
        for rule, (m, k) in rules.items():
            for r in RANKS:
                means = {v: rank_sweep["variants"][cell(rank_contender(rule, r), v)]["mean_std"]["accuracy_after"][0]
                         for v in RATIOS if cell(rank_contender(rule, r), v) in rank_sweep["variants"]}
                if len(means) == len(RATIOS):
                    best = max(means, key=means.get)
                    variants[cell(rank_contender(rule, r), best)] = logra_variant(best, m, k, r)
    seeds = tuple(args.seeds) if args.seeds else seeds
    if args.report:
        variants = {name: v for name, v in variants.items() if finished(out, name, seeds)}
    else:
        for seed in seeds:  # seed by seed, so an interrupted study still holds paired seeds
            run_sweep(base, variants, [seed], out, jobs=args.jobs, step_memory=False, name=f"runs/{args.phase}_last")
    results = run_sweep(base, variants, seeds, out, jobs=args.jobs, step_memory=False,
                        title=f"{title}: {args.phase}", name=f"runs/{args.phase}_all")
    results["command"] = (f"nice -n 10 python -m experiments.momentum.run --task {args.task} --phase {args.phase}"
                          f" --jobs {args.jobs} --contenders {' '.join(args.contenders)}"
                          + (f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds else ""))
    # with the contenders of earlier invocations of the phase (each phase's contenders can be run separately)
    results = parity.merge_into(out / f"{args.phase}.json", results)
    if args.phase == "sweep":
        text = sweep_table(results)
    elif args.phase == "alone":
        text = best_table(results, (cell(BASE, fixed[BASE]), cell(ALONE[-1], fixed[BASE])))
    elif args.phase == "best":
        text = best_table(results, (cell(BASE, fixed[BASE]), cell("adamw-targets", fixed["adamw-targets"])))
        full = [n for n, v in results["variants"].items() if len(v["seeds"]) == len(BEST_SEEDS)
                and all((run_dir(out, n, s) / "metrics.jsonl").exists() for s in BEST_SEEDS)]  # curves need runs
        plot_curves(out, dict.fromkeys(full), BEST_SEEDS, f"{title}: best settings", filename="best_curves.png")
    else:
        text = rank_table(rank_sweep, results)
        plot_rank(results, out / "rank.png", f"{args.task}: rank at each rule's best ratio ({len(seeds)} seeds)")
    (out / f"{args.phase}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
