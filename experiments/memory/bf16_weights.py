"""bfloat16 weight storage (`optimizer.weight_dtype="bfloat16"`, stochastic merges) against float32 weights: does
learning change on the demo task? (issue 34, item 3)

Two contenders, from the same SFT warm start of their seed and on the same batches (experiments/parity's setup;
only the weights' storage differs): today's best LoGRA (per-layer update ratio 3e-3, rank 64, no KL control) with
float32 weights, and the same with bfloat16 weights. The runs live beside experiments/momentum's (same base
config, same SFT cache), so its finished float32 runs are reused and only what is missing runs.

Run:  nice -n 5 python -m experiments.memory.bf16_weights [--seeds 0 1 2] [--jobs 2]
Writes experiments/memory/bf16_weights.{json,md,png} (the png: reward and held-out curves).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from experiments.momentum.run import HERE as MOMENTUM
from experiments.momentum.run import _name, logra_variant, results_table
from experiments.parity.run import task_config
from experiments.sweep import merged, run_sweep

OUT = Path(__file__).parent
FP32 = _name(0.0, 1)
BF16 = FP32.replace("logra-layer", "logra-layer-bf16")
CONTENDERS = {FP32: logra_variant(0.0, 1),
              BF16: {"optimizer": {**logra_variant(0.0, 1)["optimizer"], "weight_dtype": "bfloat16"}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    runs = MOMENTUM / "demo"
    base = merged(task_config("demo"), {"sft": {"cache_dir": str(runs / "runs" / "sft_cache")}})
    title = f"demo task, seeds {', '.join(map(str, args.seeds))}: LoGRA with float32 vs bfloat16 weights"
    results = run_sweep(base, CONTENDERS, args.seeds, runs, jobs=args.jobs, step_memory=False, title=title,
                        name="bf16_weights")
    results["command"] = "nice -n 5 python -m experiments.memory.bf16_weights --seeds " + " ".join(
        map(str, args.seeds)) + f" --jobs {args.jobs}"
    (OUT / "bf16_weights.json").write_text(json.dumps(results, indent=1) + "\n")
    text = results_table(results, args.seeds)
    (OUT / "bf16_weights.md").write_text(text + "\n")
    shutil.move(runs / "bf16_weights.png", OUT / "bf16_weights.png")  # run_sweep wrote them beside the runs
    (runs / "bf16_weights.json").unlink(missing_ok=True)
    print(text)


if __name__ == "__main__":
    main()
