"""The accelerator check's table and check.json, from what check.sh's steps wrote into one folder.

  python experiments/device/summary.py OUT_DIR

Reads lower.json, bench_<platform>.json, sync.json, step.json and exit_status.txt (each step's exit status; a
missing file is reported as missing, never as a pass), checks the issue's targets and prints one table:
  kernels  every Pallas kernel within 1e-5 (float32 data) / 1e-2 (bfloat16 data) of its full-precision reference;
           never slower than XLA (best setting); ≥ 70% of roofline for the merge and the row moment
  step     LoGRA's peak memory ≤ 0.5 × AdamW-all's and its median step time ≤ 0.8 × (Qwen2.5-1.5B)
  sync     trainer and rollout weights bitwise equal after 5 synced low-rank updates
Writes OUT_DIR/check.json. Exit status 0 when every step ran (targets missed are results, not failures).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOFLINE_TARGET = {"merge": 70.0, "row_moment_paper": 70.0, "row_moment_nemo": 70.0}
STEP_TARGETS = {"peak_vs_adamw": 0.5, "time_vs_adamw": 0.8}


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tolerance(row: dict[str, Any]) -> float:
    optimizer_side = row["kernel"] in ROOFLINE_TARGET  # float32 sketches and weights whatever the activations
    return 1e-5 if optimizer_side or row["dtype"] == "float32" else 1e-2


def kernel_verdicts(bench: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for row in bench["results"]:
        xla, default, best = row["xla"], row["pallas"], row["pallas_best"]
        entry = {"kernel": row["kernel"], "model": row["model"], "layer": row["layer"], "dtype": row["dtype"],
                 "xla_ms": 1e3 * xla["median_s"] if "median_s" in xla else None,
                 "pallas_ms": 1e3 * default["median_s"] if "median_s" in default else None,
                 "best_ms": 1e3 * best["median_s"] if "median_s" in best else None,
                 "best_settings": best.get("settings"), "xla_pct_roofline": xla.get("pct_roofline"),
                 "best_pct_roofline": best.get("pct_roofline"), "tolerance": _tolerance(row),
                 "pallas_error": default.get("max_rel_error"), "error_text": default.get("error")}
        errors = [e.get("max_rel_error") for e in row["pallas_settings"] if "max_rel_error" in e]
        entry["accurate"] = bool(errors) and max(errors) <= entry["tolerance"]
        entry["not_slower"] = entry["best_ms"] is not None and entry["xla_ms"] is not None and \
            entry["best_ms"] <= entry["xla_ms"]
        target = ROOFLINE_TARGET.get(row["kernel"])
        entry["roofline_ok"] = None if target is None else (entry["best_pct_roofline"] or 0.0) >= target
        rows.append(entry)
    return rows


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _yes(flag: Any) -> str:
    return {True: "yes", False: "NO", None: "-"}[flag]


def main() -> None:
    out = Path(sys.argv[1])
    status = out / "exit_status.txt"  # one "step code" line per step that ran
    rcs = dict(line.split() for line in status.read_text().splitlines() if line.strip()) if status.exists() else {}
    lower = _load(out / "lower.json")
    bench_files = sorted(out.glob("bench_*.json"))
    bench = _load(bench_files[0]) if bench_files else None
    sync, step = _load(out / "sync.json"), _load(out / "step.json")
    report: dict[str, Any] = {"exit_status": rcs, "lower": lower, "sync": sync, "step": step}
    lines = []
    if lower:
        failed = [f"{r['platform']}:{r['kernel']}" for r in lower["results"] if not r["ok"]]
        lines.append(f"lowering under jax {lower['jax']}: {len(lower['results']) - len(failed)}/"
                     f"{len(lower['results'])} ok" + (f"; FAILED {failed}" if failed else ""))
    else:
        lines.append(f"lowering: no lower.json (exit {rcs.get('lower', '?')})")
    if bench:
        verdicts = kernel_verdicts(bench)
        report.update(device=bench["device"], platform=bench["platform"], jax=bench["jax"], peaks=bench["peaks"],
                      kernels=verdicts)
        peaks = bench["peaks"]
        lines.append(f"kernels on {bench['device']} ({bench['platform']}, jax {bench['jax']}): copy "
                     f"{peaks['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                     f"{peaks['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
                     + ("" if bench["meaningful_for_speed"] else "  [smoke: times NOT meaningful]"))
        lines.append(f"{'model':>12} {'layer':>8} {'dtype':>8} {'kernel':>16} {'xla ms':>8} {'pallas':>8} "
                     f"{'best':>8} {'%roof':>6} {'rel err':>8} {'tol':>5} acc  fast roof")
        for v in verdicts:
            lines.append(f"{v['model']:>12} {v['layer']:>8} {v['dtype']:>8} {v['kernel']:>16} "
                         f"{_fmt(v['xla_ms']):>8} {_fmt(v['pallas_ms']):>8} {_fmt(v['best_ms']):>8} "
                         f"{_fmt(v['best_pct_roofline'], '.1f'):>6} {_fmt(v['pallas_error'], '.1e'):>8} "
                         f"{v['tolerance']:.0e} {_yes(v['accurate']):>3} {_yes(v['not_slower']):>4} "
                         f"{_yes(v['roofline_ok']):>4}" + (f"  {v['error_text'][:60]}" if v["error_text"] else ""))
    else:
        lines.append(f"kernels: no bench_*.json (exit {rcs.get('kernels', '?')})")
    if sync:
        lines.append(f"sync: {sync.get('verdict', sync)}")
    else:
        lines.append(f"sync: no sync.json (exit {rcs.get('sync', '?')})")
    if step:
        lines.extend(step_lines(step, report))
    else:
        lines.append(f"train step: no step.json (exit {rcs.get('train_step', '?')})")
    (out / "check.json").write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(lines))
    sys.exit(0 if all(code == "0" for code in rcs.values()) else 1)


def step_lines(step: dict[str, Any], report: dict[str, Any]) -> list[str]:
    """The train-step rows: per contender peak GiB and median ms, then LoGRA's ratios against the targets."""
    contenders = step.get("contenders", {})
    lines = [f"train step {step.get('model', '')}: {'contender':>24} {'peak GiB':>9} {'median ms':>10}"]
    for name, c in contenders.items():
        peak = c.get("peak_bytes_in_use")
        median = c.get("median_step_s")
        lines.append(f"{'':>11}{name:>24} {_fmt(peak / 2 ** 30 if peak else None, '.2f'):>9} "
                     f"{_fmt(1e3 * median if median else None, '.1f'):>10}" + (f"  ERROR {c['error'][:80]}"
                                                                                if c.get("error") else ""))
    ratios = step.get("ratios", {})
    if ratios.get("pallas_time_vs_xla") is not None:
        lines.append(f"{'':>11}LoGRA step time, Pallas kernels vs XLA: {ratios['pallas_time_vs_xla']:.3f}")
    verdict = {}
    for key, limit in STEP_TARGETS.items():
        value = ratios.get(f"logra_{key}")
        verdict[key] = None if value is None else value <= limit
        lines.append(f"{'':>11}LoGRA {key.replace('_', ' ')}: {_fmt(value, '.3f')} (target ≤ {limit}) "
                     f"{_yes(verdict[key])}")
    report["step_targets"] = verdict
    return lines


if __name__ == "__main__":
    main()
