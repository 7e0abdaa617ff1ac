"""Routing in RL (issue 60, item 5): how often the rollout engine and the trainer route a response token to different
experts, what that does to the log-probs the TIS weight sees, and what routing replay leaves.

Definitions (logra_jax.rl.routing): response token j's log-prob comes from position P + j − 1; it "differs" in a
MoE layer when the engine's recorded top-k set there (`Rollout.experts`) is not the set the trainer's teacher-forced
forward chooses; it is "affected" when some MoE layer differs at or before that position (the KV cache carries a
difference forward). Gaps are |log μ − log π| (engine vs trainer), TIS weights min(exp(log π − log μ), 2).

Part "tiny": the tiny MoE preset (`tiny-qwen3-moe`: 2 layers, 4 experts, top-2), compute dtypes (trainer /
engine) float32 / float32, bfloat16 / bfloat16 and float32 / bfloat16 (`VARIANTS`), the colocated engine on one
CPU device; 16 random prompts of 8 tokens × 4 samples × 24 new tokens (temperature 1). Measured at random init and
after STEPS LoGRA RL steps (rank 16, update ratio 1e-2, no replay) on a toy reward (the share of even response
tokens): per MoE layer and any-layer shares, the gaps and TIS weights on affected / unaffected tokens, with a
gradient-free trainer forward replaying the engine's ids or not (the same rollout, the same weights); and the
train step's own routing metrics (its forward is what the TIS weight sees), replayed or not at step 0.
Part "demo": configs/demo.py:moe (the MoE demo model, 4 layers, 4 experts, top-2, float32) with optimizer.rank = 16,
DEMO_STEPS RL steps from the demo's SFT warm start, rollout.routing_replay off and on; the per-step routing
metrics of metrics.jsonl (the train step reports them with every MoE rollout of the JAX engine).

Run:  nice -n 10 python -m experiments.moe.routing --part tiny
      nice -n 10 python -m experiments.moe.routing --part demo [--sft-cache DIR]
      python -m experiments.moe.routing --part report
Writes experiments/moe/routing/{tiny.json, demo.json, routing.png} (demo runs in routing/runs/, git-ignored).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).parent
OUT = HERE / "routing"
STEPS = 10
DEMO_STEPS = 20
PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 16, 4, 8, 24
CAP = 2.0
# (trainer's compute dtype, engine's): the same dtype (the job's colocated engine), and a bfloat16 engine beside a
# float32 trainer (as a bf16 inference server beside a float32 trainer)
VARIANTS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"))


def _measure(model: Any, rollout: Any, prompt_len: int) -> dict[str, Any]:
    """Per-layer and any-layer mismatch shares, gaps and TIS weights of one rollout under the trainer's weights,
    without and with replay."""
    from flax import nnx

    from logra_jax.rl.objective import routed_response_logprobs
    from logra_jax.rl.routing import response_routing

    @nnx.jit
    def trainer(model, tokens, mask, experts):
        return routed_response_logprobs(model, tokens, mask, prompt_len, experts=experts)

    valid = np.asarray(rollout.response_mask)
    mu = np.asarray(rollout.logprobs)
    out: dict[str, Any] = {"tokens": int(valid.sum())}
    for name, replay in (("no_replay", None), ("replay", rollout.experts)):
        logp, own = trainer(model, rollout.tokens, rollout.attention_mask(), replay)
        layers, affected = (np.asarray(a) for a in response_routing(rollout.experts, own, rollout.prompt_mask,
                                                                    rollout.response_mask))
        logp = np.asarray(logp)
        gap, weight = np.abs(mu - logp), np.minimum(np.exp(np.clip(logp - mu, -20, 20)), CAP)
        mean = lambda x, m: float(x[m].mean()) if m.any() else None
        hit, clean = valid & affected, valid & ~affected
        out[name] = {
            "layer_share": [float(layers[..., i][valid].mean()) for i in range(layers.shape[-1])],
            "any_layer_share": float(layers.any(-1)[valid].mean()), "affected_share": float(affected[valid].mean()),
            "gap_affected": mean(gap, hit), "gap_unaffected": mean(gap, clean), "gap_all": mean(gap, valid),
            "gap_max": float(gap[valid].max()),
            "tis_affected": mean(weight, hit), "tis_unaffected": mean(weight, clean),
            "tis_capped_share": float((weight[valid] >= CAP).mean()),
            "tis_far_share": float((np.abs(weight[valid] - 1) > 0.1).mean()),  # TIS weights off 1 by > 10%
        }
    return out


def _tiny_run(dtype: str, engine_dtype: str) -> dict[str, Any]:
    """Part "tiny" for the trainer's compute dtype and the engine's: measurements at step 0 and after STEPS RL
    steps."""
    from flax import nnx

    from logra_jax.job.phases import init_train_state, rl_train_step
    from logra_jax.job.run_config import OptimizerSection
    from logra_jax.models.config import preset
    from logra_jax.models.decoder import init_model
    from logra_jax.parallel.sharding import MeshConfig, make_mesh
    from logra_jax.rl.advantages import grpo_advantages
    from logra_jax.rl.losses import LossConfig
    from logra_jax.rollout.engine import ColocatedEngine
    from logra_jax.rollout.sampling import SamplingConfig

    config = preset("tiny-qwen3-moe", dtype=dtype)
    model = init_model(config, seed=0)
    plan, graphdef, state, rest = init_train_state(
        OptimizerSection(name="logra", rank=16, update_ratio=1e-2, ratio_scope="layer"), model)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, eos_id=1, pad_id=0, num_samples=SAMPLES)
    engine = ColocatedEngine(preset("tiny-qwen3-moe", dtype=engine_dtype), sampling,
                             make_mesh(MeshConfig(), jax.devices()[:1]), state.params, rest)
    step = jax.jit(rl_train_step(graphdef, plan, LossConfig(tis_cap=CAP), PROMPT_LEN))
    replay_step = jax.jit(rl_train_step(graphdef, plan, LossConfig(tis_cap=CAP), PROMPT_LEN, routing_replay=True))
    routing = lambda metrics: {k: float(v) for k, v in metrics.items() if k.startswith("routing/")
                               or k in ("tis_weight", "rollout_mismatch")}
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, config.vocab_size, (PROMPTS, PROMPT_LEN)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    result: dict[str, Any] = {"dtype": dtype, "engine_dtype": engine_dtype, "steps": {}, "train_step": {}}
    for i in range(STEPS + 1):
        rollout = engine.generate(prompts, mask, jax.random.key(i))
        if i in (0, STEPS):
            result["steps"][i] = _measure(nnx.merge(graphdef, state.params, rest), rollout, PROMPT_LEN)
            print(f"tiny {dtype}/{engine_dtype} step {i}: {json.dumps(result['steps'][i])}", flush=True)
        if i == STEPS:
            break
        # (the measurement's forward is a separate, gradient-free program; the train step's below is what the TIS
        # weight sees: both are recorded)
        even = np.asarray(rollout.tokens[:, PROMPT_LEN:] % 2 == 0) & np.asarray(rollout.response_mask)
        rewards = even.sum(1) / np.maximum(np.asarray(rollout.response_mask).sum(1), 1)
        batch = {"tokens": rollout.tokens, "attention_mask": rollout.attention_mask(),
                 "response_mask": rollout.response_mask,
                 "advantages": grpo_advantages(jnp.asarray(rewards, jnp.float32), SAMPLES),
                 "rollout_logprobs": rollout.logprobs, "finished": rollout.finished, "experts": rollout.experts}
        if i == 0:  # the train step's own forward, replayed (its update unused)
            result["train_step"]["replay_step0"] = routing(replay_step(state, rest, batch)[1])
        state, metrics, updates = step(state, rest, batch)
        result["train_step"][i] = routing(metrics)
        engine.publish(updates, state.params)
        print(f"tiny {dtype}/{engine_dtype} RL step {i + 1}: reward {rewards.mean():.3f}, "
              f"routing/mismatch_share {float(metrics['routing/mismatch_share']):.4f}", flush=True)
    return result


def tiny() -> None:
    start = time.time()
    results = {f"{trainer}/{engine}": _tiny_run(trainer, engine) for trainer, engine in VARIANTS}
    OUT.mkdir(exist_ok=True)
    (OUT / "tiny.json").write_text(json.dumps({"config": {
        "preset": "tiny-qwen3-moe", "prompts": PROMPTS, "samples": SAMPLES, "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS, "rl_steps": STEPS, "optimizer": "logra rank 16, update_ratio 1e-2 per layer",
        "seconds": round(time.time() - start)}, "results": results}, indent=1) + "\n")


DEMO_ARGS = ("--config.optimizer.rank=16", f"--config.train.steps={DEMO_STEPS}", "--config.train.eval_every=0",
             "--config.train.checkpoint_every=0")


def demo(sft_cache: str) -> None:
    """Part "demo": the two runs (replay off / on) one after the other, then demo.json."""
    runs = OUT / "runs"
    for replay in (False, True):
        workdir = runs / f"replay-{'on' if replay else 'off'}"
        if (workdir / "metrics.jsonl").exists() and '"finished"' in (workdir / "log.txt").read_text():
            continue
        cmd = [sys.executable, "-m", "logra_jax.main", "--config=configs/demo.py:moe", f"--workdir={workdir}",
               *DEMO_ARGS, f"--config.rollout.routing_replay={replay}"]
        if sft_cache:
            cmd.append(f"--config.sft.cache_dir={sft_cache}")
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    report_demo()


def report_demo() -> None:
    from logra_jax.job.metrics import read_metrics
    from logra_jax.rl.routing import ROUTING_METRICS

    out: dict[str, Any] = {"command": "python -m logra_jax.main --config=configs/demo.py:moe " + " ".join(DEMO_ARGS)
                           + " --config.rollout.routing_replay={False,True}", "runs": {}}
    for replay in ("off", "on"):
        records = [r for r in read_metrics(OUT / "runs" / f"replay-{replay}" / "metrics.jsonl")
                   if "routing/mismatch_share" in r]
        series = {name: [r[name] for r in records] for name in (*ROUTING_METRICS, "tis_weight", "rollout_mismatch",
                                                               "reward_mean")}
        out["runs"][replay] = {"steps": [r["step"] for r in records], "series": series,
                               "mean": {k: float(np.mean(v)) for k, v in series.items() if v},
                               "response_tokens": int(sum(r["loss_denominator"] for r in records))}
    (OUT / "demo.json").write_text(json.dumps(out, indent=1) + "\n")


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    tiny_path, demo_path = OUT / "tiny.json", OUT / "demo.json"
    if tiny_path.exists():
        results = json.loads(tiny_path.read_text())["results"]
        labels, shares, gaps_hit, gaps_clean = [], [], [], []
        for dtype, r in results.items():
            for step, m in r["steps"].items():
                labels.append(f"{dtype.replace('float', 'f')}\nstep {step}")
                shares.append(m["no_replay"]["layer_share"] + [m["no_replay"]["any_layer_share"]])
                gaps_hit.append((m["no_replay"]["gap_affected"] or 0, m["replay"]["gap_affected"] or 0))
                gaps_clean.append((m["no_replay"]["gap_unaffected"] or 0, m["replay"]["gap_unaffected"] or 0))
        shares = np.array(shares)
        x = np.arange(len(labels))
        width = 0.8 / shares.shape[1]
        for i in range(shares.shape[1]):
            name = "any layer" if i == shares.shape[1] - 1 else f"MoE layer {i}"
            axes[0].bar(x + i * width, 100 * shares[:, i], width, label=name)
        axes[0].set_xticks(x + 0.4 - width / 2, labels)
        axes[0].set(ylabel="response tokens whose top-k set differs (%)",
                    title="tiny-qwen3-moe: engine vs gradient-free trainer forward")
        axes[0].legend(fontsize=8)
        gaps = np.array([[h[0], c[0], h[1], c[1]] for h, c in zip(gaps_hit, gaps_clean)])
        for i, name in enumerate(("affected, no replay", "unaffected, no replay", "affected, replay",
                                  "unaffected, replay")):
            axes[1].bar(x + i * 0.2, gaps[:, i], 0.2, label=name)
        axes[1].set_xticks(x + 0.3, labels)
        axes[1].set(yscale="log", ylabel="mean |log μ − log π|", title="tiny-qwen3-moe: log-prob gap (same forward)")
        axes[1].legend(fontsize=8)
    if demo_path.exists():
        runs = json.loads(demo_path.read_text())["runs"]
        for replay, style in (("off", "-"), ("on", "--")):
            r = runs[replay]
            for name, color in (("routing/mismatch_share", "C0"), ("routing/affected_share", "C1")):
                axes[2].plot(r["steps"], 100 * np.array(r["series"][name]), style, color=color,
                             label=f"{name.split('/')[1]}, replay {replay}")
        axes[2].set(xlabel="RL step", ylabel="% of response tokens", title="demo (configs/demo.py:moe, rank 16)")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "routing.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("tiny", "demo", "report"), required=True)
    parser.add_argument("--sft-cache", default="", help="config.sft.cache_dir for the demo runs' SFT warm start")
    args = parser.parse_args()
    if args.part == "tiny":
        tiny()
    elif args.part == "demo":
        demo(args.sft_cache)
    else:
        report_demo()
    plot()


if __name__ == "__main__":
    main()
