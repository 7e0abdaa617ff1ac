"""Does AdamW's first moment explain LoGRA's remaining gap on the demo task? (an ablation of experiments/parity)

RowAdam has no first moment. AdamW on LoGRA's targets at its best learning rate (3e-4 in the demo sweep) is run
with and without its β₁ (`optimizer.adam_b1` 0.9 vs 0; without, also at 1e-4, which suits it better), beside
LoGRA's best rule (per-layer update ratio 3e-3), on the same seeds, warm starts and batches (the SFT warm starts
are shared with experiments/parity/run.py's demo runs).
If AdamW without β₁ falls to LoGRA's level, the missing first moment is what costs LoGRA its points.

Run:  python -m experiments.parity.momentum [--seeds 0 1 2] [--jobs 2]
Writes experiments/parity/demo_momentum/{results.json,results.md,curves.png}; runs in demo_momentum/runs/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.parity.run import task_config, variant
from experiments.sweep import run_sweep, table

OUT = Path(__file__).parent / "demo_momentum"
VARIANTS = {
    "adamw-targets@learning_rate=0.0003": variant("adamw-targets", 3e-4),
    "adamw-targets-b1zero@learning_rate=0.0003": variant("adamw-targets-b1zero", 3e-4),
    "adamw-targets-b1zero@learning_rate=0.0001": variant("adamw-targets-b1zero", 1e-4),
    "logra-layer@update_ratio=0.003": variant("logra-layer", 3e-3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    results = run_sweep(task_config("demo"), VARIANTS, args.seeds, OUT, jobs=args.jobs, step_memory=False,
                        title="demo task: AdamW with and without its first moment, beside LoGRA")
    text = table(results)
    (OUT / "results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
