"""(a) LoGRA vs dense AdamW vs optax GaLore on the demo's arithmetic RL task, several seeds.

Every variant starts from the same SFT warm start (configs/demo.py: additions without carries) and runs the same
200 RL steps on additions with carries; only the optimizer differs. LoGRA is the demo's setting (sketch-native,
rank 64, predicted-KL control). The baselines update the same weights' gradients densely (AdamW on every
parameter) or through GaLore's rank-64 projected Adam on the same targets. AdamW runs at two learning rates
(1e-4, 3e-4), GaLore at 3e-4; none of the three optimizers was tuned further.

Run: python -m experiments.optimizers.run           (writes results.json, results.md, curves.png here)
"""

from pathlib import Path

from experiments.sweep import cli

VARIANTS = {
    "logra": {},
    "adamw-lr1e-4": {"optimizer": {"name": "adamw", "learning_rate": 1e-4, "kl_control": False}},
    "adamw-lr3e-4": {"optimizer": {"name": "adamw", "learning_rate": 3e-4, "kl_control": False}},
    "galore-lr3e-4": {"optimizer": {"name": "galore", "learning_rate": 3e-4, "kl_control": False}},
}

if __name__ == "__main__":
    cli(__doc__, VARIANTS, default_seeds=(0, 1, 2), out_dir=Path(__file__).parent,
        title="LoGRA vs AdamW vs GaLore, demo task")
