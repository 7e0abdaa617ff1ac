"""The Qwen2.5-1.5B RL train step on one accelerator: real peak memory and median step time per optimizer.

  python experiments/device/step_check.py --out step.json            # on the GPU (check.sh runs it)
  python experiments/device/step_check.py --out step.json --smoke    # tiny model on CPU (the tests)

Contenders (built as the training loop builds them: `logra_jax.memory_analysis.build_rl_step` and
`contender_sections`): adamw (every parameter), adamw_targets (exactly LoGRA's targets, the rest frozen) and
logra_sketch_native_kl (sketch-native LoGRA, rank 256, with the predicted-KL probe on 2 sequences, as the paper
runs it); last, the same with `implementation="pallas"` (the GPU kernels for the sketched projections).
Model: `paper_numerics("qwen2.5-1.5b")` (bf16 compute, fp32 weights, remat per block, chunked attention), random
init; one 4096-token sequence (512 prompt) per step; log-probs in chunks of 512.

Each contender runs in its own process (so `memory_stats()["peak_bytes_in_use"]` is its own peak, with
XLA_PYTHON_CLIENT_PREALLOCATE=false) under a time limit: init on the device, one AOT compile (its
`memory_analysis()` is recorded too), one warm-up step, then `--steps` timed steps (each ended by
block_until_ready; the state donated as in the loop); the median is reported. A contender that fails or runs out
of time is recorded with its error; the others still run. Ratios are LoGRA's against each AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# In order of need, should time run short; the last is LoGRA with the Pallas kernels (on a GPU the Triton ones)
# for the sketched projections, which decides whether they may become the default.
CONTENDERS = ("logra_sketch_native_kl", "adamw", "adamw_targets", "logra_sketch_native_kl_pallas")
PROBES = 2  # the paper's KL probe: 2 single-response sequences per device


def _settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"model": "tiny", "seq_len": 64, "prompt_len": 16, "rank": 8, "logprob_chunk": 16}
    return {"model": "qwen2.5-1.5b", "seq_len": 4096, "prompt_len": 512, "rank": 256, "logprob_chunk": 512}


def _random_batch(abstract: Any, vocab: int, prompt_len: int, seed: int) -> Any:
    """Concrete arrays for the step's batch: random tokens, every position valid, responses after the prompt."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def make(path, sds):
        name = jax.tree_util.keystr(path)
        if "tokens" in name:
            return jnp.asarray(rng.integers(0, vocab, sds.shape), sds.dtype)
        if "kl_mask" in name:  # the probed positions: the response
            return jnp.asarray(np.arange(sds.shape[-1])[None, :] >= prompt_len).repeat(sds.shape[0], 0)
        if sds.dtype == jnp.bool_:
            return jnp.ones(sds.shape, jnp.bool_)
        if "rollout_logprobs" in name:
            return jnp.asarray(-np.log(vocab) + 0.1 * rng.normal(size=sds.shape), sds.dtype)
        return jnp.asarray(rng.normal(size=sds.shape), sds.dtype)

    return jax.tree_util.tree_map_with_path(make, abstract)


def prepare(config: Any, section: Any, s: dict[str, Any], return_updates: bool = False) -> tuple[Any, ...]:
    """The loop's RL step on the first local device: (compiled step, state, rest, batch, compile-time bytes).

    State and rest are initialised on the device in their shardings (as the loop does); the batch is random.
    """
    import jax

    from logra_jax import sharding as shd
    from logra_jax.memory_analysis import build_rl_step

    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1), jax.local_devices()[:1])
    init, step, abstract_batch = build_rl_step(config, section, 1, seq_len=s["seq_len"], prompt_len=s["prompt_len"],
                                               logprob_chunk=s["logprob_chunk"], return_updates=return_updates)
    (state, rest), (state_sh, rest_sh) = shd.init_sharded(init, lambda a: (
        shd.train_state_shardings(a[0], mesh), shd.param_shardings(a[1], mesh, sources=a[0].params)))
    batch_sh = shd.batch_shardings(abstract_batch, mesh)
    batch = jax.device_put(_random_batch(abstract_batch, config.vocab_size, s["prompt_len"], seed=0), batch_sh)
    out_sh = (state_sh, shd.replicated(mesh)) + ((None,) if return_updates else ())
    jitted = shd.jit_train_step(step, mesh, in_shardings=(state_sh, rest_sh, batch_sh), out_shardings=out_sh)
    compiled = jitted.lower(state, rest, batch).compile()
    m = compiled.memory_analysis()
    nbytes = None if m is None else {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
                                     "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}
    return compiled, state, rest, batch, nbytes


def child(name: str, smoke: bool, steps: int) -> dict[str, Any]:
    """One contender in this process: init, compile, warm up, time; returns its record."""
    import dataclasses

    import jax

    from logra_jax.memory_analysis import contender_sections, paper_numerics
    from logra_jax.models.config import preset

    s = _settings(smoke)
    config = preset("tiny") if smoke else paper_numerics(s["model"], s["seq_len"])
    section = contender_sections(s["rank"])[name.removesuffix("_pallas")]
    if name.endswith("_pallas"):
        section = dataclasses.replace(section, implementation="pallas", interpret=jax.default_backend() == "cpu")
    if section.kl_control:
        section = dataclasses.replace(section, probe_responses=PROBES)
    device = jax.local_devices()[0]
    record: dict[str, Any] = {"device": device.device_kind, "platform": device.platform}
    start = time.perf_counter()
    compiled, state, rest, batch, record["compiled_bytes"] = prepare(config, section, s)
    state, metrics = compiled(state, rest, batch)
    jax.block_until_ready(metrics)
    record["init_compile_first_step_s"] = time.perf_counter() - start
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, rest, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    record["step_s"] = times
    record["median_step_s"] = statistics.median(times)
    record["loss"] = float(metrics["loss"]) if "loss" in metrics else None
    stats = device.memory_stats() or {}
    record["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    record["parameters"] = int(sum(x.size for x in jax.tree.leaves(state.params)))
    return record


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None


def parent(args: argparse.Namespace) -> dict[str, Any]:
    s = _settings(args.smoke)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    report: dict[str, Any] = {**s, "probe_responses": PROBES, "steps": args.steps, "contenders": {},
                              "command": " ".join(sys.argv)}
    began = time.perf_counter()
    for name in CONTENDERS:
        start = time.perf_counter()
        limit = min(args.timeout, args.budget_s - (start - began))
        if limit < 20:
            report["contenders"][name] = {"error": f"skipped: the budget of {args.budget_s:.0f} s was spent"}
            print(f"[step_check] {name}: skipped (budget spent)", flush=True)
            continue
        print(f"[step_check] {name}: start (limit {limit:.0f} s)", flush=True)
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)] + (["--smoke"] if args.smoke
                                                                                         else [])
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode == 0 and lines:
                record = json.loads(lines[-1][len("RESULT "):])
            else:
                record = {"error": f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-4:])}
        except subprocess.TimeoutExpired:
            record = {"error": f"timed out after {limit:.0f} s"}
        record["wall_s"] = time.perf_counter() - start
        report["contenders"][name] = record
        median = record.get("median_step_s")
        peak = record.get("peak_bytes_in_use")
        print(f"[step_check] {name}: {record['wall_s']:.0f} s; median step "
              f"{'-' if median is None else f'{1e3 * median:.1f} ms'}; peak "
              f"{'-' if peak is None else f'{peak / 2 ** 30:.2f} GiB'}"
              + (f"; ERROR {record['error'][:200]}" if "error" in record else ""), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))  # what is measured so far survives a kill
    c = report["contenders"]
    logra = c.get("logra_sketch_native_kl", {})
    pallas = c.get("logra_sketch_native_kl_pallas", {})
    report.setdefault("ratios", {})["pallas_time_vs_xla"] = _ratio(pallas.get("median_step_s"),
                                                                   logra.get("median_step_s"))
    for base, suffix in (("adamw", ""), ("adamw_targets", "_targets")):
        report.setdefault("ratios", {})[f"logra_peak_vs_adamw{suffix}"] = _ratio(
            logra.get("peak_bytes_in_use"), c.get(base, {}).get("peak_bytes_in_use"))
        report["ratios"][f"logra_time_vs_adamw{suffix}"] = _ratio(
            logra.get("median_step_s"), c.get(base, {}).get("median_step_s"))
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"[step_check] ratios {json.dumps(report['ratios'])}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="step.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model, short sequences (CPU)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per contender (default 80; 60 smoke)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no contender after this many seconds; cap each one's limit by what is left")
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        print("RESULT " + json.dumps(child(args.child, args.smoke, args.steps)), flush=True)
        return
    args.timeout = args.timeout or (60.0 if args.smoke else 80.0)
    parent(args)


if __name__ == "__main__":
    main()
