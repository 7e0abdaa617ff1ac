"""How the KL controller behaved in runs: q's swings, α at its cap, prediction vs realised KL.

  python experiments/parity/probe_stats.py experiments/parity/demo/runs/logra-kl@kl_budget=0.02-seed*

For each run directory (its metrics.jsonl): the median factor by which q changes between consecutive steps,
the fraction of steps with α at alpha_max, the median and 90th percentile of realised / predicted KL (α²q), the
largest realised KLs with their predictions, and the refused / undone step counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np


def probe_stats(workdir: Path, alpha_max: float = 3.0) -> dict[str, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "kl_q" in r]
    if not steps:
        raise ValueError(f"{workdir}: no KL-controlled step in metrics.jsonl")
    q = np.array([r["kl_q"] for r in steps])
    swing = np.exp(np.abs(np.diff(np.log(q[q > 0])))) if (q > 0).sum() > 1 else np.array([1.0])
    realised = np.array([r["kl_realised"] for r in steps])
    predicted = np.array([r["kl_predicted"] for r in steps])
    ok = predicted > 0
    ratio = realised[ok] / predicted[ok]
    worst = np.argsort(realised)[-2:][::-1]
    return {"steps": len(steps), "q_swing_median": float(np.median(swing)),
            "alpha_at_cap": float(np.mean([r["kl_alpha"] >= alpha_max for r in steps])),
            "realised_over_predicted_median": float(np.median(ratio)),
            "realised_over_predicted_p90": float(np.percentile(ratio, 90)),
            "largest_realised": [float(realised[i]) for i in worst],
            "their_predictions": [float(predicted[i]) for i in worst],
            "refused": float(sum(r.get("kl_refused", 0) for r in steps)),
            "undone": float(sum(r.get("kl_undone", 0) for r in steps))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    stats = {str(run): probe_stats(run) for run in args.runs}
    for run, s in stats.items():
        print(f"{run}: {json.dumps(s)}")
    if len(stats) > 1:
        keys = ("q_swing_median", "alpha_at_cap", "realised_over_predicted_median", "realised_over_predicted_p90")
        print("median over runs:", {k: round(statistics.median(s[k] for s in stats.values()), 3) for k in keys})


if __name__ == "__main__":
    main()
