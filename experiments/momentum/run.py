"""A first moment for LoGRA across subspace changes (issue 33): a reduced, like-for-like study on the demo task.

Contenders, all from the same SFT warm start of their seed and on the same batches (experiments/parity's setup; only
the optimizer differs), LoGRA at today's best rule (per-layer update ratio 3e-3, rank 64, no KL control):
  logra-layer            today's best LoGRA: fresh projections every step, no momentum
  logra-layer-m{β}-k{κ}  + `optimizer.momentum` β₁ (logra_jax.optim.momentum), projections held κ steps
                         (`optimizer.refresh_every`; κ = inf: `optimizer.refresh=False`, one fixed projection)
  logra-layer-k{κ}       the refresh period alone, without momentum
  adamw-targets          AdamW on exactly LoGRA's targets at its best lr (3e-4), the like-for-like reference
Reduced protocol (the full one — step-size sweep × 2 seeds, then best × 5 — did not fit the shared 2-core CPU):
every contender at one step size (the parity sweep's best for the no-momentum rule and AdamW), seeds run in order
(all contenders of seed 0, then of seed 1, ...) so that an interrupted study still holds paired seeds.

Run:  nice -n 10 python -m experiments.momentum.run [--seeds 0 1] [--jobs 1] [--contenders ...] [--report]
Writes experiments/momentum/demo/results_seeds<seeds>.{json,md} and curves_seeds<seeds>.png; runs in demo/runs/
(git-ignored; finished runs are reused, so a re-invocation only adds what is missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from experiments.parity.run import task_config, variant
from experiments.sweep import merged, run_dir, run_sweep

HERE = Path(__file__).parent
RATIO = 3e-3  # logra-layer's best in experiments/parity (demo, 5 seeds)


def logra_variant(momentum: float, every: int | None) -> dict[str, dict[str, Any]]:
    """logra-layer at RATIO with momentum β₁ and projections held `every` steps (None: fixed for ever)."""
    over = variant("logra-layer", RATIO)
    refresh = {"refresh": False} if every is None else {"refresh": True, "refresh_every": every}
    return {"optimizer": {**over["optimizer"], "momentum": momentum, **refresh}}


def _name(momentum: float, every: int | None) -> str:
    m = f"-m{momentum:g}" if momentum else ""
    k = "" if every == 1 else f"-k{'inf' if every is None else every}"
    return f"logra-layer{m}{k}@update_ratio={RATIO:g}"


# In order of how much each tells (the order runs are started in, per seed).
CONTENDERS: dict[str, dict[str, dict[str, Any]]] = {
    _name(0.0, 1): logra_variant(0.0, 1),
    _name(0.9, 10): logra_variant(0.9, 10),
    _name(0.9, None): logra_variant(0.9, None),
    _name(0.9, 1): logra_variant(0.9, 1),
    "adamw-targets@learning_rate=0.0003": variant("adamw-targets", 3e-4),
    _name(0.0, 10): logra_variant(0.0, 10),
    _name(0.0, None): logra_variant(0.0, None),
}


def results_table(results: dict[str, Any], seeds: list[int]) -> str:
    """Per contender: held-out before/after (mean ± std over seeds), per seed, paired gain over logra-layer."""
    base = results["variants"].get(_name(0.0, 1))
    lines = ["| contender | seeds | held-out before | held-out after, mean ± std | per seed | paired vs logra-layer "
             "(points) | largest drop | step time (s) |", "|---" * 8 + "|"]
    for name, v in results["variants"].items():
        after = [p["accuracy_after"] for p in v["seeds"]]
        before = [p["accuracy_before"] for p in v["seeds"]]
        paired = "–"
        if base is not None and name != _name(0.0, 1):
            ref = {p["seed"]: p["accuracy_after"] for p in base["seeds"]}
            diffs = [100 * (p["accuracy_after"] - ref[p["seed"]]) for p in v["seeds"] if p["seed"] in ref]
            paired = ", ".join(f"{d:+.1f}" for d in diffs)
        sd = statistics.stdev(after) if len(after) > 1 else 0.0
        times = [p["step_time_median"] for p in v["seeds"]]
        lines.append(f"| {name} | {len(after)} | {statistics.fmean(before):.3f} | {statistics.fmean(after):.3f} ± "
                     f"{sd:.3f} | {', '.join(f'{a:.3f}' for a in after)} | {paired} | "
                     f"{max(p['largest_drop'] for p in v['seeds']):.3f} | {statistics.fmean(times):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--report", action="store_true",
                        help="start no run: tabulate the contenders whose runs of every --seeds have finished")
    args = parser.parse_args()
    out = HERE / "demo"
    base = merged(task_config("demo"), {"sft": {"cache_dir": str(out / "runs" / "sft_cache")}})
    variants = {name: CONTENDERS[name] for name in args.contenders}
    if args.report:
        variants = {name: v for name, v in variants.items()
                    if all((run_dir(out, name, seed) / "summary.json").exists() for seed in args.seeds)}
    else:
        for seed in args.seeds:  # seed by seed, so an interrupted study still holds paired seeds
            run_sweep(base, variants, [seed], out, jobs=args.jobs, step_memory=False, name=f"seed{seed}_last")
    tag = "seeds" + "".join(map(str, args.seeds))
    title = f"demo task, seeds {', '.join(map(str, args.seeds))}: LoGRA with momentum / held projections"
    results = run_sweep(base, variants, args.seeds, out, jobs=args.jobs, step_memory=False, title=title,
                        name=f"results_{tag}")
    results["command"] = "nice -n 10 python -m experiments.momentum.run " + " ".join(
        ["--seeds", *map(str, args.seeds), "--jobs", str(args.jobs), *(["--report"] if args.report else [])])
    (out / f"results_{tag}.json").write_text(json.dumps(results, indent=1) + "\n")
    text = results_table(results, args.seeds)
    (out / f"results_{tag}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
