r"""One decode step and the whole rollout of the paper's recipe on paper, by the real compilers, against the floor.

  python experiments/rollout/plans.py                # every cell (compile-only venvs: make venv-tpu venv-cuda)
  python experiments/rollout/plans.py --cells 7b@v5e:2x4 --python /path/to/venv/bin/python
  python experiments/rollout/plans.py --cells 27b@h100:8 \
      --planned 27b@h100:8=experiments/memory/whole_job_cells/27b@h100_8@logra_kl.json   # a whole-job plan's rollout

Each cell is `python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:SIZE --target=TARGET --phases rollout
--json ...` (prompts of 512 tokens, responses ≤ 3,072, 256 prompts in 32 slots), run with the target's
compiler: the engine's programs in its decode layout, the decode step's per-device HBM and collective bytes from
the compiled HLO (`logra_jax.planner.hlo_cost`), its time by `aot.roofline`, beside the floor (the engine's weights /
devices + the KV cache read / devices, at HBM bandwidth), and the rollout of one RL step with every response at
its budget. Writes experiments/rollout/plans.{json,md,png} and each cell's plan JSON under plans/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CELLS = ("1.5b@v5e:2x4", "7b@v5e:2x4", "27b@v5e:2x4", "1.5b@h100:8", "7b@h100:8", "27b@h100:8")


def _python(target: str, override: str | None) -> str:
    if override:
        return override
    venv = ".venv-tpu" if target.startswith("v") else ".venv-cuda"
    return str(REPO / venv / "bin" / "python")


def _plan(cell: str, python: str | None, planned: Path | None = None) -> dict:
    """One cell: `logra_jax.plan --phases rollout` run now, or the rollout phase of a plan already made by the same
    command (`planned`: e.g. a whole-job plan from experiments/memory/whole_job.py, copied beside the others)."""
    size, target = cell.split("@")
    out = HERE / "plans" / f"{size}_{target.replace(':', '-')}.rollout.json"
    out.parent.mkdir(exist_ok=True)
    if planned is not None:
        out.write_text(planned.read_text())
    else:
        command = [_python(target, python), "-m", "logra_jax.plan",
                   f"--config=configs/paper_qwen2.5_math.py:{size}", f"--target={target}", "--phases", "rollout",
                   f"--json={out}"]
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", PYTHONPATH=str(REPO))
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
        if not out.is_file():
            raise RuntimeError(f"{cell}: {' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    plan = json.loads(out.read_text())
    phase = next(p for p in plan["phases"] if p["name"] == "rollout")
    step, whole = phase["per_decode_step"], phase["time"]
    return {"cell": cell, "size": size, "target": target, "jax": plan["jax"], "fits": phase["total"] <= plan[
        "hbm_bytes"], "peak_gib": phase["total"] / 2**30, "note": phase["note"], "decode_step": step,
        "rollout": whole, "ratio_to_floor": step["est_seconds"] / step["floor_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--python", default=None, help="interpreter with the target's compiler (default: the venv)")
    parser.add_argument("--planned", nargs="*", default=[], metavar="CELL=PLAN_JSON",
                        help="take these cells' rollout from plans already made (e.g. whole_job_cells/*.json)")
    args = parser.parse_args()
    planned = dict(item.split("=", 1) for item in args.planned)
    rows, start = [], time.time()
    for i, cell in enumerate(args.cells):
        eta = f", ETA {(time.time() - start) / i * (len(args.cells) - i) / 60:.0f} min" if i else ""
        print(f"[{i + 1}/{len(args.cells)}] {cell}{eta}", flush=True)
        rows.append(_plan(cell, args.python, Path(planned[cell]) if cell in planned else None))
        r = rows[-1]
        print(f"    decode step {r['decode_step']['est_seconds'] * 1e3:.1f} ms = {r['ratio_to_floor']:.2f}× the "
              f"floor; rollout {r['rollout']['est_seconds'] / 60:.1f} min", flush=True)
    _write(rows)


def _write(rows: list[dict]) -> None:
    """plans.{json,md,png} from these cells and the cells of an earlier run not rerun now (each compiler's cells may
    come from a run under its own interpreter)."""
    import matplotlib

    earlier = HERE / "plans.json"
    if earlier.is_file():
        fresh = {r["cell"] for r in rows}
        kept = [r for r in json.loads(earlier.read_text())["cells"] if r["cell"] not in fresh]
        rows = sorted(kept + rows, key=lambda r: CELLS.index(r["cell"]) if r["cell"] in CELLS else len(CELLS))

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["| model @ target | decode step: HBM GB | collectives GB | est. ms | floor GB | floor ms | × floor | "
             "rollout of one RL step (every response at its budget) | rollout peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["decode_step"]
        lines.append(f"| {r['cell']} | {d['hbm_bytes'] / 1e9:.2f} | {d['collective_bytes'] / 1e9:.3f} | "
                     f"{d['est_seconds'] * 1e3:.1f} | {d['floor_bytes'] / 1e9:.2f} | {d['floor_seconds'] * 1e3:.1f} | "
                     f"{r['ratio_to_floor']:.2f} | {r['rollout']['est_seconds'] / 60:.1f} min | "
                     f"{r['peak_gib']:.2f}{'' if r['fits'] else ' (does not fit)'} |")
    (HERE / "plans.md").write_text("\n".join(lines) + "\n")
    (HERE / "plans.json").write_text(json.dumps({"command": "python " + " ".join(sys.argv), "cells": rows},
                                                indent=1))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["decode_step"]["est_seconds"] * 1e3 for r in rows], 0.4, label="decode step")
    ax.bar([i + 0.2 for i in x], [r["decode_step"]["floor_seconds"] * 1e3 for r in rows], 0.4,
           label="floor (weights + KV / devices)")
    ax.set_xticks(list(x), [r["cell"] for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("ms per decode step (on paper)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "plans.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
