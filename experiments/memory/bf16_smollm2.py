r"""bfloat16 weight storage where the steps are small: SmolLM2-135M-Instruct at its tuned LoGRA per-layer ratio
(issue 46, item 3).

bf16_weights.py checked the stochastic-rounding merge on the demo at a per-layer ratio of 3e-3, where a step moves
each weight by about one bfloat16 spacing. SmolLM2's tuned ratio is 5e-5 (experiments/smollm2/tune): most entries
of a step are far below half a spacing, which rounding to nearest would drop and the stochastic merge carries only
in expectation. Two contenders, paired per seed (the same SFT warm start: cached per seed, or computed by both runs
of a pair that run side by side; only the weights' storage differs):
  logra-layer-f32    LoGRA sketch-native rank 64, per-layer update ratio 5e-5, no KL control, float32 weights
                     (experiments/smollm2/tune's best LoGRA)
  logra-layer-bf16   the same with optimizer.weight_dtype = "bfloat16" (stochastic-rounding merges)
Same task and batches as experiments/smollm2/parity.py (its COMMON settings), RL_STEPS RL steps (not parity's 40:
six runs of 40 do not fit this shared 2-core machine's budget), held-out greedy accuracy every 10 steps.

Inside every run, each train step's low-rank updates are measured against the weights they update (target leaves
only): the share of entries whose intended update |ΔW| = |U·A| is below half a bfloat16 spacing of the weight (the
updates rounding to nearest would lose: what the stochastic rounding carries), below one spacing, and the share of
entries whose stored weight actually changed. Per run: <workdir>/updates.jsonl, one line per step.

Run:  nice -n 10 python -m experiments.memory.bf16_smollm2 [--seeds 0 1 2] [--jobs 2]
Writes experiments/memory/bf16_smollm2/{results.json, results.md, curves.png} (runs in bf16_smollm2/runs/,
git-ignored and reused; seed<k>.json and seed<k>_curves.png per seed as its pair finishes).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.smollm2.parity import COMMON, CONFIG
from experiments.sweep import load_config, paired, run_dir, run_sweep
from experiments.sweep import table as sweep_table

OUT = Path(__file__).parent / "bf16_smollm2"
RL_STEPS = 20
LOGRA = {"name": "logra", "ratio_scope": "layer", "kl_control": False, "update_ratio": 5e-5}
BASE = {**COMMON, "train": {**COMMON["train"], "steps": RL_STEPS, "checkpoint_every": 10}}
CONTENDERS = {"logra-layer-f32": {**BASE, "optimizer": LOGRA},
              "logra-layer-bf16": {**BASE, "optimizer": {**LOGRA, "weight_dtype": "bfloat16"}}}


def half_bf16_spacing(w: Any) -> Any:
    """Half the bfloat16 spacing at each entry of w (at w rounded to bfloat16): |w| = m·2^e with m ∈ [0.5, 1)
    (frexp) has spacing 2^(e − 1 − 7) for bfloat16's 7 stored mantissa bits."""
    import jax.numpy as jnp

    _, e = jnp.frexp(jnp.abs(w.astype(jnp.bfloat16).astype(jnp.float32)))
    return jnp.ldexp(jnp.float32(1.0), e - 9)


def _leaf_sums(u: Any, w0: Any, w1: Any) -> dict[str, Any]:
    """One target's sums for `update_stats` (jitted: one program per target shape)."""
    import jax.numpy as jnp

    delta = u.to_dense(w0)
    half = half_bf16_spacing(w0)
    realised = w1.astype(jnp.float32) - w0.astype(jnp.float32)
    return {"entries": jnp.float32(delta.size), "below_half": jnp.sum(jnp.abs(delta) < half),
            "below_one": jnp.sum(jnp.abs(delta) < 2 * half), "changed": jnp.sum(w1 != w0),
            "err_sq": jnp.sum((realised - delta) ** 2), "delta_sq": jnp.sum(delta**2)}


def update_stats(updates: Any, old: Any, new: Any) -> dict[str, float]:
    """Over every entry of the low-rank updates' target weights: shares of |ΔW| < half a bfloat16 spacing of W and
    < one spacing (ΔW the intended update U·A, `LowRankUpdate.to_dense`), of entries whose stored weight changed,
    and the realised update's relative error ‖W_new − W_old − ΔW‖ / ‖ΔW‖ (0 up to float32 rounding for float32
    weights; the rounding's own error for bfloat16)."""
    import jax

    from logra_jax.optim.lowrank import LowRankUpdate

    is_update = lambda x: isinstance(x, LowRankUpdate)
    flat = lambda tree: {jax.tree_util.keystr(p): x for p, x in
                         jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_update)[0]}
    old_w, new_w = flat(old), flat(new)
    leaf_sums = jax.jit(_leaf_sums)
    sums = dict.fromkeys(("entries", "below_half", "below_one", "changed", "err_sq", "delta_sq"), 0.0)
    for path, u in flat(updates).items():
        if is_update(u):
            for key, value in leaf_sums(u, old_w[path], new_w[path]).items():
                sums[key] += float(value)
    n = sums["entries"]
    return {"entries": n, "share_below_half_spacing": sums["below_half"] / n,
            "share_below_one_spacing": sums["below_one"] / n, "share_changed": sums["changed"] / n,
            # a step with every advantage 0 (no group with differing rewards) updates nothing
            "realised_rel_error": (sums["err_sq"] / sums["delta_sq"]) ** 0.5 if sums["delta_sq"] else None}


def _measuring(step_fn: Callable[..., Any], path: Path) -> Callable[..., Any]:
    """The train step, with each step's update statistics appended to `path` (the old weights copied first: the
    step donates them)."""
    import jax
    import jax.numpy as jnp

    def step(state: Any, rest: Any, batch: Any, probe: Any) -> Any:
        old = jax.tree.map(jnp.copy, state.params)
        new_state, out, updates = step_fn(state, rest, batch, probe)
        record = {"step": int(new_state.step), **update_stats(updates, old, new_state.params)}
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return new_state, out, updates

    return step


def run_measured(config: dict[str, Any], workdir: str, step_memory: bool = False) -> dict[str, Any]:
    """Worker process (`run_sweep(worker=...)`): one run whose train step is wrapped by `_measuring`."""
    import logra_jax.job.train as train
    from experiments.sweep import _run_one

    build = train._trainer

    def trainer(*args: Any, **kwargs: Any) -> Any:
        t = build(*args, **kwargs)
        t.step_fn = _measuring(t.step_fn, Path(workdir) / "updates.jsonl")
        return t

    train._trainer = trainer
    return _run_one(config, workdir, step_memory)


def read_updates(name: str, seed: int) -> list[dict[str, Any]]:
    """One run's per-step update statistics (the last record of a step wins: a resumed run repeats none, but a
    step interrupted after its record may be)."""
    path = run_dir(OUT, name, seed) / "updates.jsonl"
    by_step = {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if r}
    return [by_step[s] for s in sorted(by_step)]


def summary(results: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """Per contender: per seed the update statistics' medians over the steps that updated; across seeds the
    paired bf16 − f32 differences of final held-out accuracy and reward."""
    out: dict[str, Any] = {}
    for name, v in results["variants"].items():
        per_seed = []
        for point in v["seeds"]:
            rows = read_updates(name, point["seed"])
            moved = [r for r in rows if r["realised_rel_error"] is not None]  # steps that updated anything
            per_seed.append({"seed": point["seed"], "steps_measured": len(rows), "steps_updating": len(moved), **{
                key: statistics.median(r[key] for r in moved) for key in
                ("share_below_half_spacing", "share_below_one_spacing", "share_changed", "realised_rel_error")}})
        out[name] = per_seed
    f32, bf16 = (results["variants"][n]["seeds"] for n in CONTENDERS)
    diffs = {key: [b[key] - f[key] for f, b in zip(f32, bf16, strict=True)]
             for key in ("accuracy_after", "final_reward")}
    out["paired_bf16_minus_f32"] = {k: paired(d, names=("bfloat16", "float32")) for k, d in diffs.items()}
    return out


def markdown(results: dict[str, Any], stats: dict[str, Any]) -> str:
    lines = [sweep_table(results), "",
             "| contender | seed | held-out after | share of |ΔW| < ½ bf16 spacing | < 1 spacing | stored weight "
             "changed | ‖realised − ΔW‖ / ‖ΔW‖ |", "|---" * 7 + "|"]
    for name in CONTENDERS:
        points = {p["seed"]: p for p in results["variants"][name]["seeds"]}
        for s in stats[name]:
            lines.append(f"| {name} | {s['seed']} | {points[s['seed']]['accuracy_after']:.3f} | "
                         f"{s['share_below_half_spacing']:.4f} | {s['share_below_one_spacing']:.4f} | "
                         f"{s['share_changed']:.4f} | {s['realised_rel_error']:.3f} |")
    diff = stats["paired_bf16_minus_f32"]
    lines += ["", "Paired bf16 − f32 (per seed; mean ± std): held-out accuracy "
              + ", ".join(f"{d:+.3f}" for d in diff["accuracy_after"]["per_seed"])
              + f" ({diff['accuracy_after']['mean']:+.3f} ± {diff['accuracy_after']['std']:.3f}); final reward "
              + ", ".join(f"{d:+.3f}" for d in diff["final_reward"]["per_seed"])
              + f" ({diff['final_reward']['mean']:+.3f} ± {diff['final_reward']['std']:.3f}).", "",
              "Verdict (held-out accuracy, {:.0%} Student-t interval of the paired mean {:+.3f} … {:+.3f}): {}.".format(
                  diff["accuracy_after"]["level"], *diff["accuracy_after"]["interval"],
                  diff["accuracy_after"]["verdict"])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    title = (f"SmolLM2-135M-Instruct, {RL_STEPS} RL steps, seeds {', '.join(map(str, args.seeds))}: LoGRA "
             "(per-layer ratio 5e-5) with float32 vs bfloat16 weights")
    base = load_config(CONFIG)
    for seed in args.seeds:  # seed by seed: each seed's pair finishes (and shares its warm start) before the next
        run_sweep(base, CONTENDERS, [seed], OUT, jobs=args.jobs, step_memory=False, title=title,
                  worker=run_measured, name=f"seed{seed}")
    results = run_sweep(base, CONTENDERS, args.seeds, OUT, jobs=args.jobs, step_memory=False, title=title,
                        worker=run_measured)
    results["command"] = ("nice -n 10 python -m experiments.memory.bf16_smollm2 --seeds "
                          + " ".join(map(str, args.seeds)) + f" --jobs {args.jobs}")
    results["updates"] = summary(results, args.seeds)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results, results["updates"])
    (OUT / "results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
