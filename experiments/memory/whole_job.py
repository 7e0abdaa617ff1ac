"""The whole job's memory plan (`python -m logra_jax.plan`) for the paper's recipe at several scales and targets.

  python experiments/memory/whole_job.py [--cells 7b@v5e:2x4 27b@h100:8 ...] [--extra '--config.rollout.slots=64']
  python experiments/memory/whole_job.py --table_only     # the table of the cells planned so far

Each cell is the paper's config (configs/paper_qwen2.5_math.py:<size>, FSDP over every device of the target, the
paper's batch: 256 prompts × ≤ 3072 new tokens) planned for one optimizer: AdamW on every weight, AdamW on
LoGRA's targets only (like for like), and LoGRA sketch-native with its predicted-KL probe. TPU targets compile
with libtpu (.venv-tpu), GPU targets with XLA:GPU (.venv-cuda), cpu:N with XLA:CPU at --hbm_gib (make venv-tpu /
make venv-cuda create them). One plan per process (each target needs its own devices). In the table "–" is a
phase the config does not run (the paper's recipe has no SFT warm start and no reference KL). Writes <out>.json,
<out>.md (the table) and <out>.png (per-phase bars) from every cell planned so far (<out>_cells/*.json), printing
each cell as it finishes.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# AdamW keeps float32 weights (bfloat16 storage needs LoGRA's stochastic merges; a placement variant sets it).
OPTIMIZERS = {
    "adamw": ["optimizer.name=adamw", "optimizer.sketch_native=False", "optimizer.kl_control=False",
              "optimizer.learning_rate=1e-6", "optimizer.weight_dtype=float32"],
    "adamw_targets": ["optimizer.name=adamw", "optimizer.targets_only=True", "optimizer.sketch_native=False",
                      "optimizer.kl_control=False", "optimizer.learning_rate=1e-6", "optimizer.weight_dtype=float32"],
    "logra_kl": [],  # the paper's config as it is: LoGRA sketch-native + predicted-KL control
}
# (size, target, HBM GiB for cpu targets): the table
CELLS = ("1.5b@v5e:2x2", "7b@v5e:2x2", "7b@v5e:2x4", "27b@h100:8", "qwen3-8b@v5e:2x4")


def python_for(target: str) -> str:
    chip = target.partition(":")[0]
    venv = ".venv-tpu" if chip.startswith("v") else ".venv-cuda" if chip in ("h100", "h200", "a100") else ".venv"
    return str(REPO / venv / "bin" / "python")


def cell_path(out: Path, size: str, target: str, optimizer: str) -> Path:
    return out.parent / f"{out.name}_cells" / f"{size}@{target.replace(':', '_')}@{optimizer}.json"


def read_cell(path: Path) -> dict:
    """A cell's plan JSON with its size, target, optimizer (from the file name) and whether every phase fits."""
    size, _, optimizer = path.stem.split("@")
    result = json.loads(path.read_text())
    result.update(size=size, optimizer=optimizer,
                  status=0 if all(p["total"] <= result["hbm_bytes"] for p in result["phases"]) else 3)
    return result


def plan_cell(size: str, target: str, optimizer: str, out: Path, extra: list[str]) -> dict:
    """One `logra_jax.plan` run; its JSON (with the exit status) or the error it printed."""
    path = cell_path(out, size, target, optimizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [python_for(target), "-m", "logra_jax.plan", f"--config=configs/paper_qwen2.5_math.py:{size}",
               f"--target={target}", f"--json={path}", *extra,
               *(f"--config.{s}" for s in OPTIMIZERS[optimizer])]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    if done.returncode not in (0, 3):
        return {"size": size, "target": target, "optimizer": optimizer, "error": (done.stdout + done.stderr)[-2000:]}
    result = read_cell(path)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def table(results: list[dict]) -> str:
    gib = 2**30
    rows = ["| model @ target | HBM GiB | optimizer | start | warm start | trainer init | rollout | train step | "
            "policy sync | evaluation | peak phase | fits |", "|" + "---|" * 12]
    names = ("start", "warm start", "trainer init", "rollout", "train step", "policy sync", "evaluation")
    for r in results:
        if "error" in r:
            rows.append(f"| {r['size']} @ {r['target']} | | {r['optimizer']} | error: see JSON |" + " |" * 8)
            continue
        phases = {p["name"]: p for p in r["phases"]}
        cells = [f"{phases[n]['total'] / gib:.2f}" + (" (refused)" if phases[n]["refused"] else "")
                 if n in phases else "–" for n in names]
        peak = max(r["phases"], key=lambda p: p["total"])
        rows.append(f"| {r['size']} @ {r['target']} | {r['hbm_bytes'] / gib:.2f} | {r['optimizer']} | "
                    + " | ".join(cells) + f" | {peak['name']} | {'yes' if r['status'] == 0 else '**no**'} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    names = ("start", "warm start", "trainer init", "rollout", "train step", "policy sync", "evaluation")
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(ok)), 5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next((p["total"] / 2**30 for p in r["phases"] if p["name"] == name), 0) for r in ok]
        ax.bar([j + i * width for j in range(len(ok))], values, width, label=name)
    for j, r in enumerate(ok):
        ax.hlines(r["hbm_bytes"] / 2**30, j - width / 2, j + 0.8, colors="k", linestyles="dashed")
    ax.set_xticks([j + 0.4 for j in range(len(ok))],
                  [f"{r['size']}@{r['target']}\n{r['optimizer']}" for r in ok], fontsize=7)
    ax.set_ylabel("GiB per device (dashed: HBM)")
    ax.set_yscale("log")
    ax.set_title("Whole-job plan per phase (python -m logra_jax.plan), paper recipe")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", default=list(CELLS), help="size@target, e.g. 7b@v5e:2x4")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--out", default=str(REPO / "experiments" / "memory" / "whole_job"))
    parser.add_argument("--extra", default="", help="more plan flags in one string, e.g. "
                        "'--config.rollout.slots=64 --phases=\"train step\"'")
    parser.add_argument("--table_only", action="store_true", help="tabulate the cells already planned")
    args = parser.parse_args()
    out = Path(args.out)
    for cell in [] if args.table_only else args.cells:
        size, _, target = cell.partition("@")
        for optimizer in args.optimizers:
            result = plan_cell(size, target, optimizer, out, shlex.split(args.extra))
            summary = result.get("error", "").splitlines()[-1:] if "error" in result else [
                f"peak {max(p['total'] for p in result['phases']) / 2**30:.2f} GiB, "
                f"{'fits' if result['status'] == 0 else 'DOES NOT FIT'} ({result['seconds']:.0f} s)"]
            print(f"{cell} {optimizer}: {summary[0] if summary else 'error'}", flush=True)
    results = [read_cell(path) for path in sorted(out.parent.glob(f"{out.name}_cells/*.json"))]
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(table(results) + "\n")
    plot(results, out.with_suffix(".png"))
    print(table(results))


if __name__ == "__main__":
    sys.exit(main())
