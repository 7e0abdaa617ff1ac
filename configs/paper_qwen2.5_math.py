r"""The paper's recipe (docs/method.md §7) for Qwen2.5-Math-1.5B / 7B on accelerators.

Single-response REINFORCE with a running baseline (outcome 1 if correct else −0.01, baseline = EMA 0.1 of earlier
batches), truncated importance sampling (rollout vs trainer) capped at 2, no reference KL, LoGRA at rank 256
(Rademacher, refreshed every step, RowAdam β₂ 0.95, relative ε 1e-8, update ratio 6e-5, bf16 factors),
sketch-native (no dense target gradient), predicted-KL step control (budget 2e-4 → 2e-5 over 300 updates, α ≤ 3,
2 probe responses per data-parallel rank), DAPO-Math-7.5K for training and MATH-500 held out.

The checkpoint and data are not downloaded: point the config at local copies.
Run (1.5B, 4 training devices):
  python -m logra_jax.main --config=configs/paper_qwen2.5_math.py:1.5b --workdir=runs/qwen1.5b \
    --config.model.checkpoint=/path/to/Qwen2.5-Math-1.5B \
    --config.task.jsonl_train=/path/to/dapo_math_7.5k.jsonl --config.task.jsonl_eval=/path/to/math500.jsonl
7B: same with `:7b`; `:27b` is the paper's 27B run on Gemma-3-27B's architecture (`gemma3-27b`: point
model.checkpoint at google/gemma-3-27b-pt or -it, a Gemma3ForConditionalGeneration directory whose text decoder is
loaded); `:qwen3-8b` the same recipe on Qwen3-8B(-Base). `:dense-27b` keeps the Llama-layout 27B-class preset
(Gemma-3-27B widths) that experiments/memory's earlier 27B plans measured. Argument "runlocal" after the size
(e.g. `:1.5b,runlocal`) shrinks batch and lengths for a quick smoke run of the same recipe.
Placements (experiments/memory/fits.py plans each; the settings they change are commented in `place`):
  `:72b`         Qwen2.5-72B on one node of 8 × 80 GB GPUs      (--target=h100:8)
  `:72b,4chip`   Qwen2.5-72B on 4 TPU v5p chips (95 GiB each), tensor-parallel   (--target=v5p:2x2x1)
  `:qwen3-32b`   Qwen3-32B on 8 × 80 GB GPUs                    (--target=h100:8)
  `:7b,1gpu`     Qwen2.5-Math-7B on one 80 GB GPU               (--target=h100:1)
  `:1.5b,1chip`  Qwen2.5-Math-1.5B on one TPU v5e chip (16 GiB, a Colab TPU)   (--target=v5e:1x1)
The mesh is FSDP over every device (train.mesh_fsdp = -1). Plan the whole job before renting accelerators:
  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=v5e:2x4
"""

import ml_collections

from logra_jax.job.run_config import RunConfig, check_variant

# Placement variants → the devices they are planned for (the microbatches follow from the count).
PLACEMENTS = {"72b": 8, "72b,4chip": 4, "qwen3-32b": 8, "7b,1gpu": 1, "1.5b,1chip": 1}
VARIANTS = ("1.5b", "7b", "27b", "qwen3-8b", "dense-27b", "1.5b,runlocal", "7b,runlocal", *PLACEMENTS)
PRESETS = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b", "27b": "gemma3-27b", "qwen3-8b": "qwen3-8b",
           "dense-27b": "dense-27b", "72b": "qwen2.5-72b", "qwen3-32b": "qwen3-32b"}


def get_config(arg: str = "1.5b") -> ml_collections.ConfigDict:
    arg = check_variant(__file__, arg, VARIANTS)
    size, _, variant = arg.partition(",")
    c = ml_collections.ConfigDict(RunConfig().to_dict())
    c.model.update(preset=PRESETS[size], checkpoint="", tokenizer="checkpoint",
                   overrides=dict(dtype="bfloat16", remat="full", attention_impl="chunked", max_seq_len=4096))
    c.task.update(kind="jsonl", jsonl_train="", jsonl_eval="", prompt_style="chat", eval_size=500)
    c.rollout.update(prompts_per_step=256, num_samples=1, max_new_tokens=3072, temperature=1.0, workers=0)
    c.algorithm.update(estimator="reinforce", baseline_momentum=0.1, policy="reinforce", tis_cap=2.0,
                       kl_beta=0.0, reward_correct=1.0, reward_incorrect=-0.01, aggregation="token_mean")
    c.optimizer.update(name="logra", rank=256, variant="paper", update_ratio=6e-5, refresh=True,
                       distribution="rademacher", base_seed=42, b2=0.95, eps=1e-8, round_bf16=True,
                       sketch_native=True, non_targets="frozen", kl_control=True, kl_budget=2e-4,
                       kl_budget_final=2e-5, kl_schedule_steps=300, alpha_max=3.0, probe_responses=8)
    c.train.update(steps=500, microbatches=64, seed=0, eval_every=50, checkpoint_every=25, keep_checkpoints=3,
                   mesh_data=1, mesh_fsdp=-1, mesh_tensor=1)
    # Continuous batching in 32 slots: the KV cache holds 32 of the 256 rows at a time, each finished row's slot
    # taking the next prompt (python -m logra_jax.plan: 256 rows at once do not fit 16 GiB per TPU v5e chip).
    c.rollout.slots = 32
    if arg in PLACEMENTS:
        place(c, PLACEMENTS[arg])
    if arg == "72b,4chip":
        # The trainer in the engine's decode layout (tensor parallelism over the 4 chips, no FSDP), so that the
        # colocated engine holds the trainer's bfloat16 matrices as they are: with FSDP the engine's own tensor-4
        # copy (34 GiB per chip) sits beside the trainer's and the rollout needs 98.35 GiB of the 95
        # (experiments/memory/plan/72b_v5p_2x2x1_fsdp4.json). Tensor parallelism does not split rows: one
        # response per microbatch.
        c.train.update(mesh_fsdp=1, mesh_tensor=4, microbatches=c.rollout.prompts_per_step * c.rollout.num_samples)
    if variant == "runlocal":
        c.rollout.update(prompts_per_step=8, max_new_tokens=64)
        c.task.eval_size = 16
        c.optimizer.probe_responses = 2
        c.train.update(steps=2, microbatches=2, eval_every=0, checkpoint_every=0, mesh_fsdp=1)
    return c


def place(c: ml_collections.ConfigDict, devices: int) -> None:
    """The memory-saving settings of a placement variant: the recipe is unchanged (batch, lengths, rank, KL probe);
    only where the bytes sit and how many are alive at once."""
    # bfloat16 weight storage (stochastic-rounding merges; experiments/memory/bf16_weights*): the weights at 2
    # bytes, not 4, and an engine computing in bfloat16 holds the trainer's matrices as they are wherever its
    # layout is the trainer's (one device: no copy of its own).
    c.optimizer.weight_dtype = "bfloat16"
    # ... and so from the first byte: created or read in bfloat16 (model.overrides.param_dtype follows
    # optimizer.weight_dtype, also when a command line sets it back to float32 for AdamW), never a float32 copy
    # of the whole model first (72B on 4 TPU v5p: 68 GiB per chip, beside the bfloat16 copy the optimizer makes).
    c.model.overrides.param_dtype = c.optimizer.get_ref("weight_dtype")
    # One response per device per microbatch: the train step's activations are one 3584-token sequence's.
    c.train.microbatches = c.rollout.prompts_per_step * c.rollout.num_samples // devices
    # rollout.slots stays 32 (the KV cache of 32 rows, spread over the devices) and model.overrides.remat "full"
    # (each block's activations recomputed in the backward): the recipe's own settings already.
