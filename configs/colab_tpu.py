r"""colab/rl_tpu.ipynb's job: LoGRA RL of Qwen2.5-Math-1.5B-Instruct on GSM8K on one TPU chip (Colab's v5e-1/v6e-1).

The paper's recipe (configs/paper_qwen2.5_math.py `:1.5b,1chip`: sketch-native LoGRA at rank 256, predicted-KL step
control, bfloat16 weight storage, one response per microbatch, full remat, 32 rollout slots) at a Colab session's
scale: 16 GSM8K prompts × 4 samples per step (GRPO advantages, PPO/TIS policy loss), 512 new tokens, 40 steps, 256
held-out test problems, and the Pallas kernels (optimizer.implementation) for the sketched projection, RowAdam and
the merge. The notebook points model.checkpoint and task.jsonl_* at what it downloads.

Run (on a TPU v5e-1 / v6e-1 runtime, with the files the notebook fetched):
  python -m logra_jax.main --config=configs/colab_tpu.py --workdir=runs/colab_tpu \
    --config.model.checkpoint=/content/data/Qwen2.5-Math-1.5B-Instruct \
    --config.task.jsonl_train=/content/data/gsm8k_train.jsonl --config.task.jsonl_eval=/content/data/gsm8k_test.jsonl
Smoke (CPU, a minute): python -m logra_jax.main --config=configs/colab_tpu.py:smoke --workdir=/tmp/colab_smoke

Variants:
  ""       the TPU job (planned by experiments/colab: python -m logra_jax.plan --config=configs/colab_tpu.py ...)
  "adamw"  the same job with dense AdamW on every weight (float32 weights): the comparison the plan refuses
  "smoke"  the notebook's CPU smoke run: the bundled SmolLM2-135M-Instruct on 1-digit arithmetic, 2 steps, XLA
           kernels (Pallas targets TPU and GPU only)
"""

import ml_collections

from logra_jax.job.run_config import RunConfig, check_variant

VARIANTS = ("", "adamw", "smoke")
MODEL = "Qwen/Qwen2.5-Math-1.5B-Instruct"  # the Hugging Face hub repository colab/rl_tpu.ipynb downloads
DATASET = "openai/gsm8k"  # and its GSM8K (config "main": train 7473, test 1319 problems)


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    arg = check_variant(__file__, arg, VARIANTS)
    c = ml_collections.ConfigDict(RunConfig().to_dict())
    # checkpoint and data files are set by the notebook; the plan, without them, uses the preset's shapes
    c.model.update(preset="qwen2.5-1.5b", checkpoint="", tokenizer="checkpoint",
                   overrides=dict(dtype="bfloat16", remat="full", attention_impl="chunked", max_seq_len=1024))
    c.task.update(kind="jsonl", jsonl_train="", jsonl_eval="", prompt_style="chat", eval_size=256)
    c.rollout.update(prompts_per_step=16, num_samples=4, max_new_tokens=512, temperature=1.0, workers=0, slots=32)
    c.algorithm.update(estimator="grpo", policy="ppo", tis_cap=2.0, kl_beta=0.0, aggregation="token_mean")
    c.optimizer.update(name="logra", rank=256, variant="paper", update_ratio=6e-5, refresh=True,
                       distribution="rademacher", base_seed=42, b2=0.95, eps=1e-8, round_bf16=True,
                       sketch_native=True, non_targets="frozen", kl_control=True, kl_budget=2e-4,
                       kl_budget_final=2e-5, kl_schedule_steps=40, alpha_max=3.0, probe_responses=8,
                       implementation="pallas", weight_dtype="bfloat16")
    # No model.overrides.param_dtype (the paper's placements create the weights in bfloat16 from the first byte): a
    # checkpoint's loader takes none, reading float32; the trainer's init then stores them in bfloat16. The plan,
    # without a checkpoint, creates float32 random weights the same way.
    c.train.update(steps=40, microbatches=64, seed=0, eval_every=20, checkpoint_every=20, keep_checkpoints=1,
                   mesh_data=1, mesh_fsdp=-1, mesh_tensor=1)
    if arg == "adamw":  # as experiments/memory/fits.py plans AdamW: every weight, float32, no sketch, no KL probe
        c.optimizer.update(name="adamw", sketch_native=False, kl_control=False, learning_rate=1e-6,
                           weight_dtype="float32")
    if arg == "smoke":
        from logra_jax.models.smollm2 import smollm2_gguf_path

        c.model.checkpoint = str(smollm2_gguf_path())
        c.model.overrides = ml_collections.ConfigDict(dict(max_seq_len=256))  # float32, as loaded
        c.task.update(kind="arithmetic", difficulty=1, operations="+", train_size=64, eval_size=8)
        c.rollout.update(prompts_per_step=2, num_samples=2, max_new_tokens=8, slots=0)
        c.optimizer.update(rank=16, probe_responses=2, kl_schedule_steps=2, implementation="xla",
                           weight_dtype="float32", round_bf16=None)
        c.train.update(steps=2, microbatches=1, eval_every=0, checkpoint_every=2, mesh_fsdp=1)  # export reads it
    return c
