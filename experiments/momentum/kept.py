"""What the momentum transfer keeps: the fraction of the carried direction's energy a fresh projection holds.

For M in the coordinates of A_old, the transfer (logra_jax.optim.momentum) gives M' with M'·A_new the orthogonal
projection of M·A_old onto A_new's row space; for an independent draw that keeps ≈ r/k of ‖M·A_old‖².
Measured here with the library's own transfer_matrix at the demo's and the paper's shapes (Qwen2.5-7B q/o: k = 3584,
down_proj: k = 18944), one random M of 64 rows per shape.

Run:  python -m experiments.momentum.kept
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from logra_jax.optim.momentum import transfer_matrix
from logra_jax.optim.projection import projection

SHAPES = ((64, 128), (64, 384), (256, 3584), (256, 18944))  # (r, k): demo rank 64; paper rank 256


def main() -> None:
    rng = np.random.default_rng(0)
    print("| r | k | kept ‖M'A_new‖²/‖M A_old‖² | r/k |\n|---|---|---|---|")
    for r, k in SHAPES:
        a_old, a_new = projection(1, r, k), projection(2, r, k)
        m = jnp.asarray(rng.normal(size=(64, r)), jnp.float32)
        kept = jnp.linalg.norm(m @ transfer_matrix(a_old, a_new) @ a_new) ** 2 / jnp.linalg.norm(m @ a_old) ** 2
        print(f"| {r} | {k} | {float(kept):.4f} | {r / k:.4f} |")


if __name__ == "__main__":
    main()
