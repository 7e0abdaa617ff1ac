"""Run named variants of a config over seeds, side by side, and summarise them (shared by the RL experiments).

Each run is `logra_jax.job.train.train_and_evaluate` in its own worker process (fresh JAX, one CPU device), `jobs` at a
time, in its own workdir (resumed if it already finished: delete `runs/` to start over). For every variant the
summary holds, per seed: held-out greedy accuracy before/after RL, the SFT warm start's final loss (None without
one, or from a run that did not record it), the last rewards, median step time, the process's peak RSS and the
train step's compile-only per-device bytes; and across seeds: mean ± std. A warm start above its config's
`sft.max_final_loss` stops the sweep with that run's `WarmStartError` (naming the seed and the loss).
Output: results.json, a markdown table (printed and returned) and curve plots (reward, held-out accuracy).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import math
import multiprocessing
import os
import runpy
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Overrides = Mapping[str, Mapping[str, Any]]
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.py"


def load_config(path: str | Path, arg: str | None = None) -> dict[str, Any]:
    """A configs/*.py file's config as a plain nested dict."""
    get_config = runpy.run_path(str(path))["get_config"]
    config = get_config() if arg is None else get_config(arg)
    return config.to_dict()


def merged(base: Mapping[str, Any], overrides: Overrides) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for section, values in overrides.items():
        out[section] = {**out.get(section, {}), **values}
    return out


# configs/demo.py runs LoGRA with a first moment and one fixed projection since issue 33's study; the studies here
# start from the demo without them (fresh projections every step, no momentum, the rule they were run with), and a
# contender that wants the momentum says so.
DEMO_WITHOUT_MOMENTUM: Overrides = {"optimizer": {"momentum": 0.0, "refresh": True}}


def demo_base() -> dict[str, Any]:
    """configs/demo.py as the studies' base: DEMO_WITHOUT_MOMENTUM over it."""
    return merged(load_config(DEMO_CONFIG), DEMO_WITHOUT_MOMENTUM)


def _exit_with_parent(poll_s: float = 2.0) -> None:
    """Exit this worker process when the sweep that spawned it is gone (killed or crashed): a pool worker busy in a
    run would otherwise keep training, unseen, on the cores of whatever runs next."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _run_one(config: dict[str, Any], workdir: str, step_memory: bool = True) -> dict[str, Any]:
    """Worker process: one run, then (step_memory) its compile-only step memory; returns the run's summary."""
    _exit_with_parent()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from logra_jax.job.run_config import RunConfig
    from logra_jax.job.train import train_and_evaluate

    summary_path = Path(workdir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else train_and_evaluate(config,
                                                                                                   workdir)
    summary["step_bytes"] = _step_bytes(RunConfig.from_dict(config), workdir) if step_memory else -1
    return summary


def _step_bytes(run: Any, workdir: str) -> int:
    """Per-device bytes (argument + output + temp − alias) of this run's train step, compile-only."""
    import jax

    from logra_jax.job.builders import build_model
    from logra_jax.parallel import sharding as shd
    from logra_jax.planner.memory_analysis import rl_step_memory

    model, _ = build_model(run.model)
    prompt_len = json.loads((Path(workdir) / "summary.json").read_text()).get("prompt_length")
    if prompt_len is None:
        return -1
    rows = run.rollout.prompts_per_step * run.rollout.num_samples
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1), jax.devices()[:1])
    mem = rl_step_memory(model.config, run.optimizer, mesh, seq_len=prompt_len + run.rollout.max_new_tokens,
                         prompt_len=prompt_len, rows_per_device=rows, logprob_chunk=1024)
    return int(mem["total"])


def run_dir(out_dir: Path, name: str, seed: int) -> Path:
    """The workdir of one (variant, seed) run of a sweep written to out_dir."""
    return out_dir / "runs" / f"{name}-seed{seed}"


def run_metrics(out_dir: Path, name: str, seed: int) -> list[dict[str, Any]]:
    """The metrics.jsonl records of one run of a sweep written to out_dir."""
    return _metrics(run_dir(out_dir, name, seed))


def _metrics(workdir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def same_run_key(overrides: Mapping[str, Any]) -> str:
    """The overrides as canonical JSON, without SFT cache paths (where a warm start is stored, not what it is)."""
    plain = json.loads(json.dumps(overrides))
    if isinstance(plain.get("sft"), dict):
        plain["sft"].pop("cache_dir", None)
    return json.dumps(plain, sort_keys=True)


def recorded_points(paths: Sequence[Path]) -> dict[tuple[str, int], dict[str, Any]]:
    """The per-seed points of earlier sweeps' results files (run_sweep's JSON, committed, while their run
    directories are not), keyed by (canonical overrides, seed); a point names the file it came from. The first
    file holding a (configuration, seed) wins. Only for files written from the same base config as the sweep that
    reuses them: the overrides are all that is compared."""
    points: dict[tuple[str, int], dict[str, Any]] = {}
    for path in paths:
        if not Path(path).exists():
            continue
        for v in json.loads(Path(path).read_text())["variants"].values():
            key = same_run_key(v["overrides"])
            for p in v["seeds"]:
                points.setdefault((key, p["seed"]), {**p, "recorded_in": p.get("recorded_in", Path(path).name)})
    return points


def finished_summary(out_dir: Path, name: str, seed: int) -> dict[str, Any] | None:
    """The summary of a (variant, seed) run finished in out_dir; None if it has not finished there."""
    path = run_dir(out_dir, name, seed) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def accuracy_after(out_dir: Path, name: str, overrides: Overrides, seed: int,
                   recorded: Sequence[Path] = ()) -> float | None:
    """A (variant, seed)'s final held-out accuracy: from its run directory, else from the `recorded` results files
    (see recorded_points); None if neither holds it."""
    if (summary := finished_summary(out_dir, name, seed)) is not None:
        return summary["accuracy_after"]
    point = recorded_points(recorded).get((same_run_key(overrides), seed))
    return None if point is None else point["accuracy_after"]


def run_sweep(base: Mapping[str, Any], variants: Mapping[str, Overrides], seeds: Sequence[int], out_dir: Path, *,
              jobs: int = 2, title: str = "", log: Callable[[str], None] = print, step_memory: bool = True,
              name: str = "results", reuse: Sequence[Path] = (),
              worker: Callable[[dict[str, Any], str, bool], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run every (variant, seed) and write out_dir/{<name>.json, <name>_curves.png} (results.json and curves.png
    by default); returns the results. step_memory=False skips each run's compile-only step bytes. worker: a
    module-level function run in the worker process in place of the plain run (same arguments and summary: an
    experiment that measures inside the run). reuse: results
    files of earlier sweeps from the same base config (see recorded_points); a (variant, seed) whose overrides
    and seed one of them holds is taken from there, not run again, and its point says which file it came from.
    Reuse only what the same code computed on the same kind of machine: the warm start and the runs are bitwise
    functions of both. A recorded run whose held-out accuracy before RL differs from that of this sweep's new runs
    of its seed (another warm start) is refused with a ValueError."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recorded = recorded_points(reuse)
    known = {(n, seed): recorded[(same_run_key(variants[n]), seed)] for n in variants for seed in seeds
             if (same_run_key(variants[n]), seed) in recorded
             and finished_summary(out_dir, n, seed) is None}
    cells = [(name, seed) for name in variants for seed in seeds if (name, seed) not in known]
    if known:
        log(f"{len(known)} of {len(known) + len(cells)} runs taken from recorded results: "
            + ", ".join(f"{n} seed {seed} ({p['recorded_in']})" for (n, seed), p in known.items()))
    start = time.perf_counter()
    summaries: dict[tuple[str, int], dict[str, Any]] = {}
    if not step_memory:  # a finished run needs no worker (and its JAX start-up) when nothing is measured
        for n, seed in cells:
            if (summary := finished_summary(out_dir, n, seed)) is not None:
                summaries[(n, seed)] = summary
        cells = [c for c in cells if c not in summaries]
    ctx = multiprocessing.get_context("spawn")
    # One fresh worker process per run: the peak RSS a run reports is its own, not that of earlier runs the same
    # worker held (a reused worker's ru_maxrss never falls), and no JAX state leaks from one run into the next.
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = {}
        for variant, seed in cells:
            config = merged(base, variants[variant])
            config["train"] = {**config["train"], "seed": seed}
            workdir = run_dir(out_dir, variant, seed)
            futures[pool.submit(worker or _run_one, config, str(workdir), step_memory)] = (variant, seed)
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            variant, seed = futures[future]
            summaries[(variant, seed)] = s = future.result()
            elapsed = time.perf_counter() - start
            log(f"[{done}/{len(cells)}] {variant} seed {seed}: held-out {s['accuracy_before']:.3f}"
                f" → {s['accuracy_after']:.3f}  ({elapsed:.0f} s elapsed, ETA "
                f"{elapsed / done * (len(cells) - done):.0f} s)")
    results: dict[str, Any] = {"title": title, "seeds": list(seeds), "variants": {}}
    for variant, overrides in variants.items():
        per_seed = []
        for seed in seeds:
            if (variant, seed) in known:
                per_seed.append(known[(variant, seed)])
                continue
            s = summaries[(variant, seed)]
            rows = run_metrics(out_dir, variant, seed)
            steps = [r for r in rows if "loss" in r]
            tail = steps[-max(len(steps) // 5, 1):]
            per_seed.append({
                "seed": seed, "accuracy_before": s["accuracy_before"], "accuracy_after": s["accuracy_after"],
                "sft_final_loss": (s.get("sft") or {}).get("final_loss"),
                "gain": s["accuracy_after"] - s["accuracy_before"],
                "final_reward": statistics.fmean(r["reward_mean"] for r in tail),
                "step_time_median": statistics.median(r["step_time"] for r in steps),
                "peak_rss_bytes": max(r.get("host_peak_rss_bytes", 0) for r in steps),
                "step_bytes": s.get("step_bytes", -1), "seconds": s["seconds"],
                "kl_realised_median": statistics.median(r["kl_realised"] for r in steps) if "kl_realised" in
                steps[0] else None,
                "largest_drop": largest_drop([r["eval_accuracy"] for r in rows if "eval_accuracy" in r]),
            })
        agg = {key: _mean_std([p[key] for p in per_seed]) for key in
               ("accuracy_before", "accuracy_after", "gain", "final_reward", "step_time_median")}
        results["variants"][variant] = {"overrides": {k: dict(v) for k, v in overrides.items()}, "seeds": per_seed,
                                     "mean_std": agg}
    for (variant, seed), point in known.items():  # a recorded run must share its seed's warm start with new runs
        fresh = {round(summaries[(n, s)]["accuracy_before"], 9) for n, s in summaries if s == seed}
        if fresh and round(point["accuracy_before"], 9) not in fresh:
            raise ValueError(f"{variant} seed {seed} recorded in {point['recorded_in']} started from held-out "
                             f"{point['accuracy_before']:.4f} after its warm start, this sweep's new runs of seed "
                             f"{seed} from {sorted(fresh)}: another warm start (other code or machine), not "
                             "comparable; run it again (leave that file out of `reuse`)")
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    if not known:  # the curves need every run's metrics; recorded points have none here
        plot_curves(out_dir, variants, seeds, title, filename=f"{name.replace('results', 'curves')}.png")
    log(f"sweep done in {time.perf_counter() - start:.0f} s")
    return results


def table(results: Mapping[str, Any]) -> str:
    """Markdown table: held-out accuracy before → after (mean ± std over seeds), gain, final reward, step time,
    compile-only step bytes and peak RSS (medians over seeds)."""
    lines = ["| variant | held-out before | held-out after | gain (points) | final reward | step time (s) | "
             "step bytes (MiB) | peak RSS (MiB) |", "|---" * 8 + "|"]
    for name, v in results["variants"].items():
        ms, seeds = v["mean_std"], v["seeds"]
        fmt = lambda key, scale=1.0, digits=3, ms=ms: (f"{ms[key][0] * scale:.{digits}f} ± "
                                                       f"{ms[key][1] * scale:.{digits}f}")
        step_bytes = statistics.median(p["step_bytes"] for p in seeds)
        step_mib = f"{step_bytes / 2**20:.1f}" if step_bytes >= 0 else "not measured"
        rss_mib = statistics.median(p["peak_rss_bytes"] for p in seeds) / 2**20
        lines.append(f"| {name} | {fmt('accuracy_before')} | {fmt('accuracy_after')} | {fmt('gain', 100, 1)} | "
                     f"{fmt('final_reward')} | {fmt('step_time_median', digits=2)} | {step_mib} | {rss_mib:.0f} |")
    return "\n".join(lines)


def largest_drop(evaluations: Sequence[float]) -> float:
    """The largest fall of held-out accuracy between consecutive evaluations (0 when it never falls)."""
    return max([0.0, *(a - b for a, b in itertools.pairwise(evaluations))])


def paired(diffs: Sequence[float], level: float = 0.95, *, names: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    """Paired per-seed differences A − B (`names`: A's and B's): mean, sample std, the two-sided Student-t interval
    of the mean at `level`, and the verdict it supports: "level" when the interval holds 0, else "<A> higher" or
    "<A> lower" (none from one seed)."""
    import scipy.stats

    n, mean = len(diffs), statistics.fmean(diffs)
    std = statistics.stdev(diffs) if n > 1 else 0.0
    half = float(scipy.stats.t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n) if n > 1 else math.inf
    low, high = mean - half, mean + half
    verdict = ("undecided (one seed)" if n < 2 else "level" if low <= 0 <= high else
               f"{names[0]} higher" if low > 0 else f"{names[0]} lower")
    return {"per_seed": list(diffs), "mean": mean, "std": std, "interval": [low, high], "level": level,
            "names": list(names), "verdict": verdict}


def plot_curves(out_dir: Path, variants: Mapping[str, Overrides], seeds: Sequence[int], title: str, *,
                filename: str = "curves.png") -> None:
    """Reward (running mean over 10 steps) and held-out accuracy vs step; one colour per variant, mean of seeds
    as a thick line and each seed thin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, name in enumerate(variants):
        color = f"C{i % 10}"
        rewards, evals = [], []
        for seed in seeds:
            rows = run_metrics(out_dir, name, seed)
            r = np.array([row["reward_mean"] for row in rows if "reward_mean" in row])
            smooth = np.convolve(r, np.ones(10) / 10, mode="valid") if len(r) >= 10 else r
            ax_r.plot(smooth, color=color, alpha=0.25, linewidth=0.8)
            rewards.append(smooth)
            evals.append([(row["step"], row["eval_accuracy"]) for row in rows if "eval_accuracy" in row])
        n = min(len(x) for x in rewards)
        ax_r.plot(np.mean([x[:n] for x in rewards], axis=0), color=color, linewidth=2, label=name)
        steps = sorted({s for e in evals for s, _ in e})
        mean_eval = [np.mean([dict(e).get(s, np.nan) for e in evals]) for s in steps]
        ax_a.plot(steps, mean_eval, "o-", color=color, label=name)
    ax_r.set(xlabel="RL step", ylabel="reward (running mean of 10)", title="training reward")
    ax_a.set(xlabel="RL step", ylabel="held-out greedy accuracy", title="held-out accuracy")
    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title} ({len(seeds)} seeds)")
    fig.tight_layout()
    fig.savefig(out_dir / filename, dpi=110)


def cli(description: str, variants: Mapping[str, Overrides], *, default_seeds: Sequence[int], out_dir: Path,
        base_config: str | Path = DEMO_CONFIG,
        base_arg: str | None = None, title: str = "",
        extra_table: Callable[[Mapping[str, Any], Path], str] | None = None) -> dict[str, Any]:
    """The experiments' shared command line: --seeds, --jobs, --variants (a subset), --out-dir; runs the sweep,
    prints the table and writes it to out_dir/results.md (followed by `extra_table(results, out_dir)`, if given:
    an experiment's own markdown from the runs' metrics)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(default_seeds))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (worker processes)")
    parser.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
    parser.add_argument("--out-dir", type=Path, default=out_dir)
    args = parser.parse_args()
    chosen = {name: variants[name] for name in args.variants}
    base = demo_base() if Path(base_config) == DEMO_CONFIG and base_arg is None else load_config(base_config,
                                                                                                  base_arg)
    results = run_sweep(base, chosen, args.seeds, args.out_dir, jobs=args.jobs, title=title)
    text = table(results)
    if extra_table is not None:
        text += "\n\n" + extra_table(results, args.out_dir)
    (args.out_dir / "results.md").write_text(text + "\n")
    print(text)
    return results
