"""Asynchronous RL on a 2-core CPU: synchronous vs one-step-off vs one-step-off under a stale-KL budget (issue 62,
item 5b).

Every run puts the rollout engine (our JAX engine) in a worker process of its own pinned to CPU 1
(`rollout.workers=1`, `rollout.engine_cpus=1`) and the trainer on CPU 0 (`taskset -c 0`), in every mode alike, so
that the overlap of rollout and training is measurable on two cores. Modes (everything else identical, all with
the predicted-KL controller on, so every batch's predicted stale KL exists):
  sync      rollout.max_staleness=0: rollout, then training
  off1      rollout.max_staleness=1: the engine generates batch t+1 while the trainer trains batch t
  klbudget  off1 plus rollout.max_stale_kl=X (stale_action "regenerate"): a batch whose predicted stale KL (the
            controller's predicted KL of the update since its policy version) exceeds X is generated again with
            the current policy. X is the median predicted stale KL of the first finished off1 run of the model
            (seed 0), taken once and kept for every seed (written to runs/<model>/max_stale_kl.json).
Models: "demo" (configs/demo.py: the tiny char decoder from its 1000-step SFT warm start, 16 prompts × 16 samples;
the docstring's controller settings kl_budget=0.32, ratio_scope=global; RL shortened to DEMO_STEPS steps, held-out
accuracy on its 256 problems before and after only) and "smollm2" (configs/smollm2_arithmetic.py: SmolLM2-135M,
8 prompts × 4 samples, 32 new tokens, its own controller; RL shortened to SMOLLM2_STEPS steps, held-out on
SMOLLM2_EVAL problems). Runs go one at a time, modes interleaved per seed (sync, off1, klbudget of seed 0, then
seed 1, ...), so that drift of the shared machine hits all modes alike.

The runs use a snapshot of the code at --rev (git archive into runs/code-<rev>), not the working tree that other
engineers edit while the study runs. The demo's SFT warm starts are computed once per seed (phase "warm", one RL
step each, cached in runs/demo/sft_cache) and loaded by every mode.

Reported per (model, mode): median RL-step wall clock in steady state (steps ≥ SKIP_STEPS, after compilation),
its speedup over sync (per seed, paired), held-out accuracy before/after and `experiments.sweep.paired` on the
per-seed differences vs sync (points), staleness in versions and in predicted KL, the share of batches
regenerated, and the realised behaviour KL (k3, engine vs trainer on the batch) against the predicted stale KL:
the realised excess over the sync runs' mismatch level (median behaviour_kl of the same seed's sync run), and a
least-squares slope through the origin of the excess on the prediction, with its correlation.

Run:  python -m experiments.async.run --phase warm               (the demo's 3 warm starts)
      python -m experiments.async.run --model demo --seeds 0 1 2
      python -m experiments.async.run --model smollm2 --seeds 0
      python -m experiments.async.run --report                   (tabulate and plot what has finished)
Writes experiments/async/{async.json, async.png}; run directories in experiments/async/runs/ (git-ignored).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNS = HERE / "runs"
MODES = ("sync", "off1", "klbudget")
DEMO_STEPS = 100
SMOLLM2_STEPS = 12
SMOLLM2_EVAL = 32
SKIP_STEPS = 3  # steps left out of the step-time median (compilation; the pipeline filling)
COMMON = ["--config.rollout.workers=1", "--config.rollout.engine_cpus=1", "--config.optimizer.kl_control=True",
          "--config.train.eval_every=0", "--config.train.checkpoint_every=0"]
MODELS: dict[str, dict[str, Any]] = {
    "demo": {"config": "configs/demo.py", "steps": DEMO_STEPS,
             "flags": ["--config.optimizer.momentum=0", "--config.optimizer.refresh=True",
                       "--config.optimizer.kl_budget=0.32", "--config.optimizer.kl_budget_final=0.08",
                       "--config.optimizer.ratio_scope=global"]},
    "smollm2": {"config": "configs/smollm2_arithmetic.py", "steps": SMOLLM2_STEPS,
                "flags": [f"--config.task.eval_size={SMOLLM2_EVAL}"]},
}


def log(message: str) -> None:
    print(f"{datetime.datetime.now(datetime.UTC):%H:%M:%S} {message}", flush=True)


def code_dir(rev: str) -> Path:
    """A snapshot of the repository at `rev` (git archive), made once."""
    path = RUNS / f"code-{rev}"
    if not (path / "logra_jax").exists():
        path.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    return path


def sft_flags(model: str) -> list[str]:
    return [f"--config.sft.cache_dir={RUNS / 'demo' / 'sft_cache'}"] if model == "demo" else []


def mode_flags(model: str, mode: str) -> list[str]:
    """The flags of one mode (klbudget: its max_stale_kl from runs/<model>/max_stale_kl.json)."""
    if mode == "sync":
        return ["--config.rollout.max_staleness=0"]
    if mode == "off1":
        return ["--config.rollout.max_staleness=1"]
    return ["--config.rollout.max_staleness=1", f"--config.rollout.max_stale_kl={budget(model)['max_stale_kl']!r}"]


def command(model: str, mode: str, seed: int, workdir: Path) -> list[str]:
    """The trainer's command line (run in the code snapshot), pinned to CPU 0."""
    spec = MODELS[model]
    return ["taskset", "-c", "0", sys.executable, "-m", "logra_jax.main", f"--config={spec['config']}",
            f"--workdir={workdir}", f"--config.train.seed={seed}", f"--config.train.steps={spec['steps']}",
            *COMMON, *spec["flags"], *sft_flags(model), *mode_flags(model, mode)]


def run_dir(model: str, mode: str, seed: int) -> Path:
    return RUNS / model / f"{mode}-seed{seed}"


def metrics(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The RL steps' rows, the trainer's wait for its batch as `rollout_wait` (the job logs it as rollout_wait_time
    since fe5f090; the study's runs, of 5722318, as rollout_wait)."""
    return [{**r, "rollout_wait": r.get("rollout_wait", r.get("rollout_wait_time"))} for r in rows if "step_time" in r]


def launch(cmd: list[str], workdir: Path, code: Path, steps: int) -> int:
    """Run one command to completion (its output in workdir/run.log), printing its progress every 30 s; records
    the machine's load average before and after in workdir/meta.json. Returns the exit status."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(code)}
    meta = {"command": cmd, "code": str(code), "started": _now(), "loadavg_before": _loadavg()}
    start = time.perf_counter()
    with (workdir / "run.log").open("w") as out:
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(5)
            if int(time.perf_counter() - start) % 30 < 5:
                done = steps_of(metrics(workdir))
                last = f", last step {done[-1]['step_time']:.2f} s" if done else ""
                log(f"  {workdir.name}: {len(done)}/{steps} RL steps{last} ({time.perf_counter() - start:.0f} s)")
    meta.update(finished=_now(), loadavg_after=_loadavg(), rc=proc.returncode,
                seconds=time.perf_counter() - start)
    (workdir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return proc.returncode


def _now() -> str:
    return f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%S} UTC"


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def budget(model: str) -> dict[str, Any]:
    """The klbudget mode's max_stale_kl for `model`: fixed once from the first finished off1 run (seed 0 if it has
    finished, else the lowest seed): the median of its predicted stale KL over the steps whose batch is a version
    behind (every step but the first)."""
    path = RUNS / model / "max_stale_kl.json"
    if path.exists():
        return json.loads(path.read_text())
    done = sorted(int(p.name.split("seed")[1]) for p in (RUNS / model).glob("off1-seed*")
                  if (p / "summary.json").exists())
    if not done:
        raise RuntimeError(f"{model}: klbudget needs a finished off1 run to choose max_stale_kl from")
    rows = [r for r in steps_of(metrics(run_dir(model, "off1", done[0]))) if r["versions_behind"] >= 1]
    values = [r["stale_kl_predicted"] for r in rows]
    chosen = {"max_stale_kl": float(f"{statistics.median(values):.3g}"), "from": f"off1 seed {done[0]}",
              "rule": "median predicted stale KL of the steps one version behind (3 significant digits)",
              "quartiles": [float(q) for q in statistics.quantiles(values, n=4)]}
    path.write_text(json.dumps(chosen, indent=1) + "\n")
    log(f"{model}: max_stale_kl = {chosen['max_stale_kl']:g} ({chosen['rule']}, {chosen['from']})")
    return chosen


def warm(seeds: list[int], code: Path) -> None:
    """The demo's SFT warm starts: one RL step per seed (colocated engine; the cache key is model, task, SFT
    settings and seed only), computed into runs/demo/sft_cache."""
    for seed in seeds:
        workdir = RUNS / "demo" / f"warm-seed{seed}"
        if (workdir / "summary.json").exists():
            continue
        cmd = ["taskset", "-c", "0", sys.executable, "-m", "logra_jax.main", "--config=configs/demo.py",
               f"--workdir={workdir}", f"--config.train.seed={seed}", "--config.train.steps=1",
               "--config.train.eval_every=0", "--config.train.checkpoint_every=0", *sft_flags("demo")]
        log(f"warm start seed {seed}")
        if launch(cmd, workdir, code, 1):
            raise SystemExit(f"warm start seed {seed} failed: see {workdir / 'run.log'}")


def grid(model: str, seeds: list[int], modes: list[str], code: Path) -> None:
    """Every (seed, mode), one at a time, modes interleaved per seed; finished runs are kept."""
    cells = [(seed, mode) for seed in seeds for mode in modes]
    start = time.perf_counter()
    for i, (seed, mode) in enumerate(cells, 1):
        workdir = run_dir(model, mode, seed)
        if (workdir / "summary.json").exists():
            log(f"[{i}/{len(cells)}] {model} {mode} seed {seed}: finished before")
            continue
        cmd = command(model, mode, seed, workdir)
        log(f"[{i}/{len(cells)}] {model} {mode} seed {seed}: {' '.join(cmd[3:])}")
        rc = launch(cmd, workdir, code, MODELS[model]["steps"])
        elapsed = time.perf_counter() - start
        if rc:
            raise SystemExit(f"{model} {mode} seed {seed} failed (exit {rc}): see {workdir / 'run.log'}")
        s = json.loads((workdir / "summary.json").read_text())
        log(f"[{i}/{len(cells)}] {model} {mode} seed {seed}: held-out {s['accuracy_before']:.3f} → "
            f"{s['accuracy_after']:.3f}, {s['seconds']:.0f} s ({elapsed:.0f} s elapsed, ETA "
            f"{elapsed / i * (len(cells) - i):.0f} s)")
        write_report()


def run_summary(model: str, mode: str, seed: int) -> dict[str, Any] | None:
    """One finished run's numbers (None if it has not finished)."""
    workdir = run_dir(model, mode, seed)
    if not (workdir / "summary.json").exists():
        return None
    s = json.loads((workdir / "summary.json").read_text())
    rows = steps_of(metrics(workdir))
    steady = [r for r in rows if r["step"] > SKIP_STEPS]
    med = lambda key, rs=steady: statistics.median(r[key] for r in rs)
    meta = json.loads((workdir / "meta.json").read_text())
    return {"seed": seed, "accuracy_before": s["accuracy_before"], "accuracy_after": s["accuracy_after"],
            "seconds": s["seconds"], "steps": len(rows), "steady_steps": len(steady),
            "step_time_median": med("step_time"), "rollout_wait_median": med("rollout_wait"),
            "rollout_time_median": med("rollout_time"), "sync_time_median": med("sync_time"),
            "versions_behind_mean": statistics.fmean(r["versions_behind"] for r in rows),
            "stale_kl_predicted_median": med("stale_kl_predicted", rows),
            "regenerated_share": statistics.fmean(r["regenerated"] for r in rows),
            "behaviour_kl_median": med("behaviour_kl", rows), "kl_predicted_median": med("kl_predicted", rows),
            "tis_capped_mean": statistics.fmean(r["tis_capped"] for r in rows),
            "loadavg": [meta["loadavg_before"], meta["loadavg_after"]], "started": meta["started"],
            "per_step": {k: [r[k] for r in rows] for k in
                         ("step", "step_time", "rollout_wait", "versions_behind", "stale_kl_predicted",
                          "regenerated", "behaviour_kl", "kl_predicted")}}


def kl_match(model: str, runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Realised vs predicted stale KL over the steps one version behind (trained as they came) of the off1 and
    klbudget runs whose predicted stale KL is not 0 (those are counted apart: no update was applied). Realised
    excess = behaviour_kl − the median behaviour_kl of the same seed's sync run (the engine/trainer mismatch
    level); its median ratio to the predicted stale KL, the least-squares slope through the origin and the
    Pearson correlation."""
    import numpy as np

    pred, excess, raw = [], [], []
    for mode in ("off1", "klbudget"):
        for seed, r in runs.get(mode, {}).items():
            if seed not in runs.get("sync", {}):
                continue
            base = runs["sync"][seed]["behaviour_kl_median"]
            p = r["per_step"]
            for v, kp, kb in zip(p["versions_behind"], p["stale_kl_predicted"], p["behaviour_kl"], strict=True):
                if v >= 1:
                    pred.append(kp)
                    excess.append(kb - base)
                    raw.append(kb)
    x, y = np.array(pred), np.array(excess)
    zero = x == 0  # the update since the batch's version was not applied (no signal: every advantage zero)
    x, y = x[~zero], y[~zero]
    if len(x) < 3:
        return {}
    ratio = y / x
    return {"points": len(x), "zero_predicted_points": int(zero.sum()),
            "zero_predicted_realised_max": float(np.max(np.array(excess)[zero])) if zero.any() else None,
            "predicted_median": float(np.median(x)), "realised_excess_median": float(np.median(y)),
            "behaviour_kl_median": float(np.median(np.array(raw)[~zero])), "ratio_median": float(np.median(ratio)),
            "ratio_p10_p90": [float(q) for q in np.percentile(ratio, [10, 90])],
            "slope_through_origin": float(x @ y / (x @ x)), "pearson_r": float(np.corrcoef(x, y)[0, 1])}


def compare(model: str, runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per mode vs sync on the seeds both have: per-seed step-time speedup (sync / mode) and the paired
    accuracy-after difference in points (`experiments.sweep.paired`)."""
    from experiments.sweep import paired

    out = {}
    for mode in ("off1", "klbudget"):
        seeds = sorted(set(runs.get(mode, {})) & set(runs.get("sync", {})))
        if not seeds:
            continue
        a, b = runs[mode], runs["sync"]
        out[mode] = {"seeds": seeds,
                     "speedup": [b[s]["step_time_median"] / a[s]["step_time_median"] for s in seeds],
                     "accuracy_after_vs_sync": paired([100 * (a[s]["accuracy_after"] - b[s]["accuracy_after"])
                                                       for s in seeds], names=(mode, "sync"))}
    return out


def write_report() -> dict[str, Any]:
    """Tabulate every finished run into async.json and async.png; returns the results."""
    results: dict[str, Any] = {"machine": _machine(), "skip_steps": SKIP_STEPS, "models": {}}
    for model, spec in MODELS.items():
        runs = {mode: {s: x for s in range(10) if (x := run_summary(model, mode, s)) is not None} for mode in MODES}
        runs = {m: r for m, r in runs.items() if r}
        if not runs:
            continue
        chosen = RUNS / model / "max_stale_kl.json"
        results["models"][model] = {
            "config": spec["config"], "rl_steps": spec["steps"], "command_flags": COMMON + spec["flags"],
            "mode_flags": {m: mode_flags(model, m) for m in runs},
            "max_stale_kl": json.loads(chosen.read_text()) if chosen.exists() else None,
            "runs": {m: {str(s): x for s, x in r.items()} for m, r in runs.items()},
            "vs_sync": compare(model, runs), "kl_match": kl_match(model, runs)}
    (HERE / "async.json").write_text(json.dumps(results, indent=1) + "\n")
    if results["models"]:
        plot(results)
    return results


def _machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return {"cpu": model, "cores": os.cpu_count()}


def table(results: dict[str, Any]) -> str:
    """Markdown: per (model, mode), medians over seeds of the per-run medians, and the paired verdict vs sync."""
    lines = ["| model | mode | seeds | step time (s) | speedup vs sync | rollout wait (s) | held-out before → after"
             " | after − sync (points) | versions behind | predicted stale KL | regenerated | behaviour KL |",
             "|---" * 12 + "|"]
    for model, m in results["models"].items():
        for mode, runs in m["runs"].items():
            rs = list(runs.values())
            med = lambda key, rs=rs: statistics.median(r[key] for r in rs)
            vs = m["vs_sync"].get(mode)
            speed = f"{statistics.median(vs['speedup']):.2f}×" if vs else "–"
            diff = vs["accuracy_after_vs_sync"] if vs else None
            verdict = (f"{diff['mean']:+.1f} [{diff['interval'][0]:+.1f}, {diff['interval'][1]:+.1f}] "
                       f"{diff['verdict']}") if diff else "–"
            lines.append(
                f"| {model} | {mode} | {', '.join(runs)} | {med('step_time_median'):.2f} | {speed} | "
                f"{med('rollout_wait_median'):.2f} | {statistics.fmean(r['accuracy_before'] for r in rs):.3f} → "
                f"{statistics.fmean(r['accuracy_after'] for r in rs):.3f} | {verdict} | "
                f"{statistics.fmean(r['versions_behind_mean'] for r in rs):.2f} | "
                f"{med('stale_kl_predicted_median'):.3g} | {statistics.fmean(r['regenerated_share'] for r in rs):.0%}"
                f" | {med('behaviour_kl_median'):.3g} |")
    return "\n".join(lines)


def plot(results: dict[str, Any]) -> None:
    """Per model: step time per step and mode (median over seeds), and realised excess behaviour KL vs predicted
    stale KL (off1 and klbudget steps one version behind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = results["models"]
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), squeeze=False)
    for row, (model, m) in zip(axes, models.items(), strict=True):
        for i, (mode, runs) in enumerate(m["runs"].items()):
            n = min(len(r["per_step"]["step_time"]) for r in runs.values())
            times = np.median([r["per_step"]["step_time"][:n] for r in runs.values()], axis=0)
            row[0].plot(range(1, n + 1), times, "o-", ms=3, color=f"C{i}", label=f"{mode} (seeds {', '.join(runs)})")
            if mode == "sync":
                continue
            base = {s: m["runs"]["sync"][s]["behaviour_kl_median"] for s in runs if s in m["runs"].get("sync", {})}
            for s, r in runs.items():
                if s not in base:
                    continue
                p = r["per_step"]
                keep = [j for j, v in enumerate(p["versions_behind"]) if v >= 1]
                row[1].plot([p["stale_kl_predicted"][j] for j in keep],
                            [p["behaviour_kl"][j] - base[s] for j in keep], ".", color=f"C{i}", alpha=0.6,
                            label=f"{mode}" if s == next(iter(base)) else None)
        row[0].axvline(SKIP_STEPS + 0.5, color="grey", ls=":", lw=1)
        row[0].set(xlabel="RL step", ylabel="step wall clock (s)", yscale="log",
                   title=f"{model}: step time (median over seeds; steps ≤ {SKIP_STEPS} left out of the medians)")
        lim = row[1].get_xlim()
        row[1].plot(lim, lim, "k--", lw=1, label="realised = predicted")
        budget = (m.get("max_stale_kl") or {}).get("max_stale_kl")
        if budget:
            row[1].axvline(budget, color="C2", ls=":", label=f"max_stale_kl = {budget:g}")
        row[1].set(xlabel="predicted stale KL (controller)", ylabel="behaviour KL − sync mismatch level",
                   title=f"{model}: realised vs predicted staleness (batches 1 version behind)")
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"one-step-off RL, engine on CPU 1, trainer on CPU 0 ({results['machine']['cpu']})")
    fig.tight_layout()
    fig.savefig(HERE / "async.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("warm", "grid"), default="grid")
    parser.add_argument("--model", choices=list(MODELS), default="demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rev", default="5722318", help="the commit whose code the runs use (a snapshot)")
    parser.add_argument("--report", action="store_true", help="start no run; tabulate and plot what has finished")
    args = parser.parse_args()
    if not args.report:
        code = code_dir(args.rev)
        if args.phase == "warm":
            warm(args.seeds, code)
            return
        grid(args.model, args.seeds, args.modes, code)
    results = write_report()
    print(table(results))
    for model, m in results["models"].items():
        print(model, json.dumps({"max_stale_kl": m["max_stale_kl"], "kl_match": m["kl_match"]}, indent=1))


if __name__ == "__main__":
    main()
