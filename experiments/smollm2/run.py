"""(d) A short RL run of SmolLM2-135M-Instruct on CPU: LoGRA vs dense AdamW, reward, accuracy and memory.

Base: configs/smollm2_arithmetic.py (chat prompts, one-digit additions, GRPO + PPO/TIS, 8 prompts × 4 samples,
LoGRA sketch-native rank 64 with predicted-KL control). AdamW updates every parameter densely at lr 1e-6 (not
tuned). 20 RL steps, one seed: this is a CPU smoke-scale run.

Run: python -m experiments.smollm2.run               (writes results.json, results.md, curves.png here)
"""

from pathlib import Path

from experiments.sweep import cli

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2_arithmetic.py"
SHORT = {"train": {"steps": 20, "eval_every": 10, "checkpoint_every": 10}}
VARIANTS = {
    "logra": SHORT,
    "adamw-lr1e-6": {**SHORT, "optimizer": {"name": "adamw", "learning_rate": 1e-6, "kl_control": False}},
}

if __name__ == "__main__":
    cli(__doc__, VARIANTS, default_seeds=(0,), out_dir=Path(__file__).parent, base_config=CONFIG,
        title="SmolLM2-135M-Instruct RL on CPU")
