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
Mixture-of-experts placements (Qwen3-MoE presets `qwen3-30b-a3b` and `qwen3-235b-a22b`; same recipe):
  `:30b-a3b`         Qwen3-30B-A3B on 8 × 80 GB GPUs            (--target=h100:8)
  `:30b-a3b,4chip`   Qwen3-30B-A3B on 4 TPU v5p chips (95 GiB)   (--target=v5p:2x2x1)
  `:30b-a3b,v5e8`    Qwen3-30B-A3B on 8 TPU v5e chips (16 GiB)    (--target=v5e:2x4)
  `:235b-a22b`       Qwen3-235B-A22B on 8 × 80 GB GPUs           (--target=h100:8)
  `:235b-a22b,h200`  Qwen3-235B-A22B on 8 × 141 GB GPUs, the trainer in the engine's layout, experts at
                     LoGRA rank 64   (--target=h200:8)
The mesh is FSDP over every device (train.mesh_fsdp = -1). Plan the whole job before renting accelerators:
  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=v5e:2x4
"""

import ml_collections

from logra_jax.job.run_config import RunConfig, check_variant

# Placement variants → the devices they are planned for (the microbatches follow from the count).
PLACEMENTS = {"72b": 8, "72b,4chip": 4, "qwen3-32b": 8, "7b,1gpu": 1, "1.5b,1chip": 1, "30b-a3b": 8,
              "30b-a3b,4chip": 4, "30b-a3b,v5e8": 8, "235b-a22b": 8, "235b-a22b,h200": 8}
VARIANTS = ("1.5b", "7b", "27b", "qwen3-8b", "dense-27b", "1.5b,runlocal", "7b,runlocal", *PLACEMENTS)
PRESETS = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b", "27b": "gemma3-27b", "qwen3-8b": "qwen3-8b",
           "dense-27b": "dense-27b", "72b": "qwen2.5-72b", "qwen3-32b": "qwen3-32b", "30b-a3b": "qwen3-30b-a3b",
           "235b-a22b": "qwen3-235b-a22b"}


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
    # The MoE placements keep `place`'s settings (bfloat16 weights from the first byte, one response per device per
    # microbatch, 32 slots, full remat). Qwen3-MoE has 4 KV heads, so the colocated engine's tensor group is at most
    # 4 and on 8 devices it holds 1/4 of the weights per device (`engine_layout`'s docstring).
    #  - `:30b-a3b` (h100:8), `:30b-a3b,4chip` (v5p:2x2x1) and `:30b-a3b,v5e8` (v5e:2x4): FSDP over every device;
    #    the engine's own tensor-4 copy is 15.3 GB per device. On v5e (16 GiB) that copy beside the trainer's
    #    1/8 shards (7.6 GB) is what the rollout cannot hold; the trainer in the engine's layout instead would put
    #    15.3 GB of weights on every 16 GiB chip before any state, sketch or activation.
    #  - `:235b-a22b` (h100:8): FSDP over the 8 GPUs (58.8 GB of bf16 weights per GPU). The engine's tensor-4 copy
    #    alone is 117.5 GB per GPU, more than an H100 holds, whatever the trainer's layout: the plan shows the
    #    rollout as the phase that stops it (its program's arguments, the engine's weights and KV cache, are
    #    112.78 GiB per GPU before any temporary).
    #  - `:235b-a22b,h200` (h200:8): the trainer in the engine's layout (`engine_layout`), so the weights are held
    #    once (1/4 per device, 117.5 GB), not 1/8 + 1/4 (176 GB); the train step's room beside them is the rest
    #    of the 141 GB, so the experts take a smaller LoGRA rank (`optimizer.rank_rules`: the sketches of the
    #    down projections, [E, D, r] float32 per layer with D over no mesh axis in this layout, are 50.5 GB per
    #    device at r = 256 and 12.6 GB at r = 64; attention keeps r = 256). r = 64 is that arithmetic, not a
    #    measured fit: the plan's weights, state and cache fit (118.30 GiB of 141 in the rollout) but XLA:GPU's
    #    temporaries (below) overflow every MoE program, so it cannot yet say which r the experts need here. On
    #    4 × v5p the 30B job fits at r = 256 for every target.
    #  - XLA:GPU (jaxlib 0.10.2) lowers `jax.lax.ragged_dot` to a dense product over every expert (64× the flops
    #    and a [G, M, N] temporary on a 64-expert example; libtpu runs its grouped-matmul kernel): on the GPU
    #    targets the MoE programs' temporaries are that expansion's (experiments/memory/README.md).
    #  - On GPUs the engine holds the stacked layers (`rollout.decode_layers = "stacked"`), not one array per layer:
    #    the same bytes held, and XLA:GPU compiles the scanned decode step in minutes where the 94 unrolled MoE
    #    layers of 235B took 12 minutes for the refill program alone on this 2-core machine (on paper the per-layer
    #    engine reads fewer bytes per decode step: XLA:GPU copies a stack's slices, see rollout.decode_layers).
    #  - Expert parallelism (`model.expert_parallel`: each device holds E / n experts whole, tokens all-gathered to
    #    them) on the GPU FSDP placements: at 235B on 8 × H100 it brings the train step from 325.06 to 181.16 GiB
    #    (XLA:GPU multiplies every token by every expert it holds, see above: E / n of them instead of E). Not on
    #    the TPUs: on 8 × v5e the 30B train step's temporaries grew from 19.15 to 27.54 GiB with it (the gathered
    #    tokens), the rollout unchanged (the engine's decode layout has no fsdp axis to split the experts over).
    if size in ("30b-a3b", "235b-a22b"):
        c.rollout.decode_layers = "stacked"
        c.model.expert_parallel = arg in ("30b-a3b", "235b-a22b")
    if arg == "30b-a3b":
        # 16 rollout slots, not 32: XLA:GPU's dense expert products scale with the rows the engine runs at once;
        # at 32 slots the rollout needs 90.39 GiB of the 80 (`python -m logra_jax.plan ... --target=h100:8`), at
        # 16 it needs 57.44 (its time on paper 15.4 min against 9.6: more waves of decode steps).
        c.rollout.slots = 16
    if arg == "235b-a22b,h200":
        engine_layout(c, devices=8, tensor=4)
        c.optimizer.rank_rules = "mlp=64"  # the experts (every MLP of Qwen3-MoE is one); see above
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


def engine_layout(c: ml_collections.ConfigDict, devices: int, tensor: int) -> None:
    """The trainer in the colocated engine's decode layout, so that the engine holds the trainer's bfloat16
    matrices as they are (no second copy of the weights), as `:72b,4chip` does.

    Qwen3-MoE has 4 KV heads, so the engine's tensor group is at most 4 (`rollout.engine.decode_tensor_sizes`:
    every device holds whole KV heads) and on 8 devices its weights are split over 4 and replicated over the 2
    data-parallel groups: 1/4 of the weights per device, whatever the trainer does. With an FSDP trainer (1/8) the
    rollout holds both, 3/8 of the weights per device; in this layout, 1/4. `model.expert_parallel` splits the
    trainer's experts over the fsdp axis, which is 1 here and in the engine's decode layout: experts split over
    the data-parallel groups in the engine would bring it to about 1/8.
    """
    # data 2 × tensor 4: rollout.engine.decode_mesh's (data = n / t, fsdp = 1, tensor = t) mesh, device order
    # included, so every trainer leaf's sharding is the engine's.
    c.train.update(mesh_data=devices // tensor, mesh_fsdp=1, mesh_tensor=tensor)
    c.rollout.decode_tensor = tensor
    # The engine holds the trainer's stacks (on GPUs "per_layer" would hold one array per layer: a copy).
    c.rollout.decode_layers = "stacked"
    # One response per data-parallel group per microbatch (tensor parallelism does not split rows).
    c.train.microbatches = c.rollout.prompts_per_step * c.rollout.num_samples // c.train.mesh_data
