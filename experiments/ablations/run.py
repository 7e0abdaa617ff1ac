"""(b) LoGRA ablations on the demo task: rank, projection refresh, projection distribution.

Base: configs/demo.py (rank 64, Rademacher, refresh every step, predicted-KL control). Rank 128 is the model
width (every target's input width except the MLP down projection's 384).

Run: python -m experiments.ablations.run            (writes results.json, results.md, curves.png here)
"""

from pathlib import Path

from experiments.sweep import cli

VARIANTS = {
    "r4": {"optimizer": {"rank": 4}},
    "r16": {"optimizer": {"rank": 16}},
    "r64 (demo)": {},
    "r128 (width)": {"optimizer": {"rank": 128}},
    "refresh off": {"optimizer": {"refresh": False}},
    "gaussian": {"optimizer": {"distribution": "gaussian"}},
}

if __name__ == "__main__":
    cli(__doc__, VARIANTS, default_seeds=(0, 1), out_dir=Path(__file__).parent,
        title="LoGRA ablations, demo task")
