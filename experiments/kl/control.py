"""(c) Predicted-KL control on/off and a budget sweep on the demo task: accuracy, stability, KL per step.

Base: configs/demo.py (budget 2e-2 → 5e-3 per token over the 200 RL steps). "off" uses the fixed update ratio
(3e-3) with no controller; the budget variants scale the demo's schedule by 0.25 and 4. The controller's
α ≤ alpha_max = 3 caps a step at 3 × the update ratio, so the last variant also raises the ratio to 1e-2 (then the
budget, not the cap, sizes the steps).

Run: python -m experiments.kl.control              (writes results.json, results.md, curves.png in control/)
"""

import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments.sweep import cli, run_dir, run_metrics

VARIANTS = {
    "kl off": {"optimizer": {"kl_control": False}},
    "budget ×0.25": {"optimizer": {"kl_budget": 5e-3, "kl_budget_final": 1.25e-3}},
    "budget ×1 (demo)": {},
    "budget ×4": {"optimizer": {"kl_budget": 8e-2, "kl_budget_final": 2e-2}},
    "budget ×4, ratio 1e-2": {"optimizer": {"kl_budget": 8e-2, "kl_budget_final": 2e-2, "update_ratio": 1e-2}},
}



def kl_table(results: Mapping[str, Any], out_dir: Path) -> str:
    """Per variant and seed: realised KL per token of each step on its probe responses (median, max), realised /
    predicted (median and the 10th–90th percentile range), the fraction of steps whose α hit alpha_max, and the
    held-out greedy accuracy at every evaluation."""
    lines = ["| variant | seed | realised KL median | realised KL max | realised / predicted: median (p10–p90) | "
             "α capped | held-out accuracy at steps 0, 50, …, 200 |", "|---" * 7 + "|"]
    for name, variant in results["variants"].items():
        for seed in (p["seed"] for p in variant["seeds"]):
            rows = run_metrics(out_dir, name, seed)
            evals = ", ".join(f"{r['eval_accuracy']:.2f}" for r in rows if "eval_accuracy" in r)
            steps = [r for r in rows if "kl_realised" in r]
            if not steps:
                lines.append(f"| {name} | {seed} | – | – | – | – | {evals} |")
                continue
            kl = [r["kl_realised"] for r in steps]
            ratio = [r["kl_realised"] / r["kl_predicted"] for r in steps if r["kl_predicted"] > 0]
            deciles = statistics.quantiles(ratio, n=10)
            config = json.loads((run_dir(out_dir, name, seed) / "config.json").read_text())
            alpha_max = config["optimizer"]["alpha_max"]
            capped = sum(r["kl_alpha"] >= alpha_max * (1 - 1e-6) for r in steps) / len(steps)
            lines.append(f"| {name} | {seed} | {statistics.median(kl):.2e} | {max(kl):.2e} | "
                         f"{statistics.median(ratio):.2f} ({deciles[0]:.2f}–{deciles[-1]:.2f}) | {capped:.0%} | "
                         f"{evals} |")
    return "\n".join(lines)


if __name__ == "__main__":
    cli(__doc__, VARIANTS, default_seeds=(0, 1), out_dir=Path(__file__).parent / "control",
        title="Predicted-KL control, demo task", extra_table=kl_table)
