"""Tunix's GRPO learner with logra_jax's `logra(...)` as the actor optimizer, on a tiny random Gemma3 (CPU).

Needs the scratch environment of experiments/tunix/README.md (google-tunix beside the project's pins); it is not
part of the project's own requirements, and no test imports it.

    /tmp/tunix-venv/bin/python experiments/tunix/grpo_logra.py [--steps 40] [--update-ratio 1e-2] [--generations 4]

What it builds:
  * model: tunix.models.gemma3.model.Gemma3 with a tiny ModelConfig (2 layers, d=32, 2 query heads, 1 KV head,
    random weights, float32): its attention weights are Tunix's 3-D / 4-D einsum kernels
      attn.q_einsum.w       [N, D, H]     rows (N, H), width D
      attn.kv_einsum.w      [2, K, D, H]  batch axis 0 (k and v), rows (K, H), width D
      attn.attn_vec_einsum.w[N, H, D]     rows D, width (N, H)
    and its MLP kernels are nnx.Linear [in, out] (gate_proj / up_proj / down_proj), the default LoGRA layout
    (Tunix initialises those to zeros; they are refilled with random values here, see tiny_gemma3).
  * tokenizer: Tunix's own MockVocab (tunix.tests.test_common, shipped in the wheel): 22 words, no download.
  * reward: the fraction of completion words equal to "Tunix" (a toy verifiable reward).
  * optimizer: logra(rank=4, variant="paper", ratio_scope="layer", rules=the Gemma3 rules above); Tunix's
    PeftTrainer wraps it in nnx.Optimizer, which adds updates with optax.apply_updates, so the LowRankUpdate
    updates must be dense: `logra(..., dense_updates=True)`.
It prints the loss / reward / KL per step (from Tunix's own metric loggers), then the relative change of each
target and of a few non-targets (frozen by logra: they must not move).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grain.python as grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.gemma3 import model as gemma3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

from logra_jax.core.tree_paths import path_str
from logra_jax.optim import logra
from logra_jax.optim.targets import MatrixDims, TargetRule, find_targets

GEMMA3_RULES = (
    TargetRule(r"attn\.q_einsum\.w$", MatrixDims(rows=(0, 2), width=(1,))),
    TargetRule(r"attn\.kv_einsum\.w$", MatrixDims(rows=(1, 3), width=(2,))),
    TargetRule(r"attn\.attn_vec_einsum\.w$", MatrixDims(rows=(2,), width=(0, 1))),
    TargetRule(r"mlp\.(gate|up|down)_proj\.kernel$", MatrixDims(rows=(-1,), width=(-2,))),
)
PROMPTS = ["input string", "hello world", "My name", "hello there", "Tunix library", "distributed training"]
GOAL_WORD = "Tunix"


def build_optimizer(rank: int, update_ratio: float) -> optax.GradientTransformation:
    """logra on the Gemma3 targets with dense updates: nnx.Optimizer merges them with optax.apply_updates."""
    return logra(rank=rank, update_ratio=update_ratio, ratio_scope="layer", rules=GEMMA3_RULES, dense_updates=True)


def tiny_gemma3(vocab_size: int, seed: int) -> gemma3.Gemma3:
    config = gemma3.ModelConfig(num_layers=2, num_embed=vocab_size, embed_dim=32, hidden_dim=64, num_heads=2,
                                head_dim=16, num_kv_heads=1, sliding_window_size=16, param_dtype=jnp.float32)
    model = gemma3.Gemma3(config, rngs=nnx.Rngs(seed))
    # Tunix's Gemma3 initialises every MLP kernel to zeros (real weights come from a checkpoint): the MLP then has
    # zero gradients, and LoGRA's update ratio (a fraction of ‖W‖) would keep a zero weight at zero anyway. Give
    # the MLP kernels random LeCun-normal values instead.
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))

    def fill(kp, x):
        if path_str(kp).split(".")[-2] in ("gate_proj", "up_proj", "down_proj") and not jnp.any(x):
            return jax.random.normal(next(keys), x.shape, x.dtype) * x.shape[0] ** -0.5
        return x

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, pure))
    nnx.update(model, state)
    return model


def goal_reward(prompts, completions, **kwargs):
    """Fraction of the completion's words equal to GOAL_WORD."""
    del prompts, kwargs
    out = []
    for c in completions:
        words = c.split()
        out.append(sum(w == GOAL_WORD for w in words) / max(len(words), 1))
    return out


class PromptSource(grain.RandomAccessDataSource):
    def __init__(self, repeat: int):
        self._data = PROMPTS * repeat

    def __getitem__(self, idx):
        return self._data[idx]

    def __len__(self):
        return len(self._data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=4, help="GRPO group size G")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--update-ratio", type=float, default=1e-2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--fixed-rollout-seed", action="store_true",
                    help="keep Tunix's behaviour: the same sampling key at every step")
    args = ap.parse_args()

    vocab = tc.MockVocab()
    actor = tiny_gemma3(vocab.GetPieceSize(), seed=0)
    reference = tiny_gemma3(vocab.GetPieceSize(), seed=0)
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(actor, nnx.Param)))
    targets = find_targets(nnx.state(actor, nnx.Param), GEMMA3_RULES)
    print(f"devices: {jax.devices()}; jax {jax.__version__}")
    print(f"targets ({len(targets)}): " + ", ".join(f"{p} {t.shape}" for p, t in targets.items()))

    optimizer = build_optimizer(args.rank, args.update_ratio)
    print("actor_optimizer: logra(..., dense_updates=True)")

    # Auto axes: jax.make_mesh defaults to Explicit axes in jax 0.10, under which Gemma3's embedding gather
    # (written for Auto sharding) raises a ShardingTypeError.
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=10_000, max_steps=args.steps),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=args.max_new_tokens, max_prompt_length=8, kv_cache_size=64, temperature=1.0,
            seed=jax.random.PRNGKey(0)),
    )
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=vocab,
                                       cluster_config=cluster_config)
    if not args.fixed_rollout_seed:
        # Tunix 0.1.6's vanilla sampler samples with RolloutConfig.seed, PRNGKey(0) when None, on every call: the
        # same key each step. Give each rollout call its own key instead.
        generate, calls = cluster.rollout.generate, [0]

        def fresh_key_generate(prompts, rollout_config, **kwargs):
            calls[0] += 1
            return generate(prompts, dataclasses.replace(rollout_config, seed=jax.random.PRNGKey(calls[0])),
                            **kwargs)

        cluster.rollout.generate = fresh_key_generate
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster, reward_fns=goal_reward,
        algo_config=grpo_lib.GRPOConfig(num_generations=args.generations, num_iterations=1, beta=0.04,
                                        epsilon=0.2))
    train_ds = (grain.MapDataset.source(PromptSource(repeat=args.steps))
                .batch(args.batch).map(lambda x: {"prompts": x}))

    t0 = time.perf_counter()
    learner.train(train_ds)
    wall = time.perf_counter() - t0

    # Per-step numbers from Tunix's own loggers (the actor trainer's loss / kl, the cluster's rewards).
    actor_log = cluster.actor_trainer.metrics_logger
    rl_log = cluster._rl_metrics_logger
    def hist(logger, prefix, name):
        try:
            return [float(v) for v in logger.get_metric_history(prefix, name, "train")]
        except Exception as e:  # a metric this Tunix version does not log
            return f"n/a ({type(e).__name__}: {e})"
    loss, kl = hist(actor_log, "actor", "loss"), hist(actor_log, "actor", "kl")
    reward = hist(rl_log, "rewards", "sum")
    print(f"\nGRPO: {cluster.actor_trainer.train_steps} optimizer steps in {wall:.1f} s")
    if isinstance(loss, list) and isinstance(reward, list):
        for i in range(max(len(loss), len(reward))):
            kl_i = kl[i] if isinstance(kl, list) and i < len(kl) else float("nan")
            r_i = reward[i] if i < len(reward) else float("nan")
            l_i = loss[i] if i < len(loss) else float("nan")
            print(f"step {i + 1}: loss {l_i:+.5f}  mean reward {r_i:.4f}  kl {kl_i:.3e}")
    else:
        print(f"loss {loss}\nkl {kl}\nreward {reward}")

    # RLCluster reshards the actor onto the mesh, i.e. builds a new module: read the trained weights from there.
    trained = cluster.actor_trainer.model
    after = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(trained, nnx.Param)))
    changed_t, changed_nt = [], []
    for (kp, b), a in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
        path = path_str(kp)
        rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        (changed_t if path in targets else changed_nt).append((path, rel))
    print("\nrelative change ‖W_after − W_before‖ / ‖W_before‖:")
    for path, rel in changed_t:
        print(f"  target     {path:40s} {rel:.3e}")
    for path, rel in changed_nt:
        print(f"  non-target {path:40s} {rel:.3e}")
    ok_t = all(rel > 0 for _, rel in changed_t)
    ok_nt = all(rel == 0 for _, rel in changed_nt)
    print(f"\nevery target moved: {ok_t}; every non-target frozen: {ok_nt}")
    if not (ok_t and ok_nt):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
