r"""The CPU demo: a small character-level decoder learns two-digit addition, then LoGRA RL teaches it to carry.

SFT warm start on two-digit additions *without* carries (plus 100 examples of the RL task), then 200 steps of RL
with LoGRA (sketch-native, rank 64, update ratio 3e-3 applied per layer, a first moment β₁ = 0.9 in sketch
coordinates with one fixed projection: the best LoGRA setting of experiments/momentum) on two-digit additions
*with* at least one carry; the held-out problems (also with carries) are never trained on. Prints held-out greedy
accuracy before and after RL and writes runs/demo/reward_curve.png.
Measured (seed 0, this exact configuration, experiments/momentum's rank study's run of it, 2026-12-06): 16.8% →
68.8% held-out on a 2-core AMD EPYC (evaluations every 50 steps: 0.168, 0.348, 0.445, 0.539, 0.688); 5.9% → 71.1%
on the study's 2-core Intel Xeon from an earlier warm start. XLA compiles for the host CPU, and the 1000-step SFT
amplifies last-bit differences, so seed-exact numbers differ between CPU types. Over 5 seeds (experiments/momentum/README.md) 70.4 ± 30.6%
after RL, against 69.2 ± 30.7% for AdamW on the same weights and 65.8 ± 28.5% for the same LoGRA without the
momentum (seed 4's SFT warm start fails for all alike on that Xeon; seeds 0–3: 83.7%, 82.4%, 77.8%). A warm start
whose final loss (the mean of its last 50 SFT steps) is above sft.max_final_loss = 0.1 stops the run before RL with
an error naming the seed and the loss: healthy ones end at 0.014–0.075 here, that dud ended at 0.587 (its last step).
The paper's rule (fresh projections every step, no momentum) is two overrides away:
--config.optimizer.momentum=0 --config.optimizer.refresh=True; the predicted-KL controller one more:
--config.optimizer.kl_control=True --config.optimizer.kl_budget=0.32 --config.optimizer.ratio_scope=global.

The mixture-of-experts demo (variant "moe"): the same task, SFT and RL recipe on a Qwen3-MoE decoder of the same
size (preset tiny-qwen3-moe at the demo's shapes: hidden 128, 4 layers, the same attention plus Qwen3's q/k norm),
every MLP 4 experts of width 192 with top-2 routing (weights renormalised). A token's active MLP is 2 × 3 × 128 ×
192 = 147,456 weights per layer, the dense demo's 3 × 128 × 384 exactly (0.81 M active of 1.40 M parameters, dense
0.80 M); rank 64 fits the expert width (down_proj's sketch spans its 192 inputs). LoGRA sketches each expert from its
own tokens; the routers stay frozen with the other non-targets (optimizer.non_targets="router" trains them). XLA:CPU
lowers the grouped expert matmul to a dense masked product over all 4 experts, so its MLP costs twice the dense
demo's here. Measured (seed 0, this exact configuration, 2026-12-07, 2 shared cores of the AMD EPYC): SFT final
loss 0.0040, held-out 55.9% → 89.5% (evaluations every 50 steps: 0.559, 0.891, 0.867, 0.871, 0.895), 1211 s;
experiments/moe/README.md ("Learning") compares it with AdamW on the same targets over 3 seeds.

Run:   python -m logra_jax.main --config=configs/demo.py --workdir=runs/demo     (what `make demo` does)
Quick: python -m logra_jax.main --config=configs/demo.py:runlocal --workdir=/tmp/demo
MoE:   python -m logra_jax.main --config=configs/demo.py:moe --workdir=runs/demo-moe
       python -m logra_jax.main --config=configs/demo.py:moe,runlocal --workdir=/tmp/demo-moe
"""

import ml_collections

from logra_jax.job.run_config import RunConfig, check_variant

VARIANTS = ("", "runlocal", "moe", "moe,runlocal")
# The MoE demo model (variant "moe"): the dense demo's decoder with every MLP a Qwen3-MoE layer of 4 experts of
# width 192, top-2 (the module docstring says why).
MOE_OVERRIDES = dict(num_experts=4, experts_per_token=2, expert_intermediate_size=192)


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    check_variant(__file__, arg, VARIANTS)
    moe = arg.split(",")[0] == "moe"
    c = ml_collections.ConfigDict(RunConfig().to_dict())  # every field, so any can be overridden on the CLI
    c.optimizer.round_bf16 = ml_collections.config_dict.placeholder(bool)  # None: the variant's own; CLI-settable
    c.model.update(preset="tiny", tokenizer="char", init_seed=0,
                   overrides=dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                                  num_kv_heads=2, head_dim=32, max_seq_len=64))
    if moe:
        c.model.preset = "tiny-qwen3-moe"
        c.model.overrides = {**c.model.overrides, **MOE_OVERRIDES}
    c.task.update(kind="arithmetic", difficulty=2, operations="+", carries="some", train_size=4096, eval_size=256,
                  prompt_style="compact", seed=0)
    # max_final_loss: a warm start that ends on one of the SFT's plateaus (loss ≈ 0.5-1.1) stops the run, naming the
    # seed and the loss, instead of 200 RL steps that cannot learn (module docstring).
    c.sft.update(steps=1000, batch_size=64, learning_rate=3e-3, difficulty=2, operations="+", carries="none",
                 train_size=4000, task_examples=100, max_final_loss=0.1)
    c.rollout.update(prompts_per_step=16, num_samples=16, max_new_tokens=5, temperature=1.0, workers=0)
    c.algorithm.update(estimator="grpo", policy="ppo", tis_cap=2.0, aggregation="token_mean")
    # The best LoGRA setting of experiments/momentum (5 seeds): a fixed update ratio applied per layer, and a first
    # moment in sketch coordinates with one fixed projection (κ = ∞), which needs no transfer.
    c.optimizer.update(name="logra", rank=64, update_ratio=3e-3, ratio_scope="layer", sketch_native=True,
                       momentum=0.9, refresh=False,
                       kl_control=False, kl_budget=2e-2, kl_budget_final=5e-3, kl_schedule_steps=200,
                       probe_responses=8)
    c.train.update(steps=200, microbatches=2, seed=0, eval_every=50, checkpoint_every=50, keep_checkpoints=2)
    if arg.endswith("runlocal"):
        c.sft.steps = 20
        c.sft.max_final_loss = 0.0  # 20 steps check the plumbing, not the learning
        c.task.eval_size = 32
        c.train.steps = 4
        c.train.eval_every = 0
        c.train.checkpoint_every = 2
    return c
