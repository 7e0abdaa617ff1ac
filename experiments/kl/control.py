"""(c) Predicted-KL control on/off and a budget sweep on the demo task: accuracy, stability, KL per step.

Base: configs/demo.py (budget 2e-2 → 5e-3 per token over the 200 RL steps). "off" uses the fixed update ratio
(3e-3) with no controller; the budget variants scale the demo's schedule by 1/4 and 4. The controller's
α ≤ alpha_max = 3 caps a step at 3 × the update ratio, so the last variant also raises the ratio to 1e-2 (then the
budget, not the cap, sizes the steps).

Run: python -m experiments.kl.control              (writes results.json, results.md, curves.png in control/)
"""

from pathlib import Path

from experiments.sweep import cli

VARIANTS = {
    "kl off": {"optimizer": {"kl_control": False}},
    "budget ×1/4": {"optimizer": {"kl_budget": 5e-3, "kl_budget_final": 1.25e-3}},
    "budget ×1 (demo)": {},
    "budget ×4": {"optimizer": {"kl_budget": 8e-2, "kl_budget_final": 2e-2}},
    "budget ×4, ratio 1e-2": {"optimizer": {"kl_budget": 8e-2, "kl_budget_final": 2e-2, "update_ratio": 1e-2}},
}

if __name__ == "__main__":
    cli(__doc__, VARIANTS, default_seeds=(0, 1), out_dir=Path(__file__).parent / "control",
        title="Predicted-KL control, demo task")
