"""The main job as 2 processes × 4 fake CPU devices against 1 process × 8 devices, same mesh (data=2, fsdp=4).

Three runs of the shortened demo config of tests/sharding/test_multihost_main.py (3 RL steps after a 20-step SFT
warm start shared through the SFT cache), launched with that test's own helpers:
  one_inprocess   1 process, no jax.distributed: XLA:CPU's in-process collectives (what a single-host user runs)
  one_gloo        1 process of a jax.distributed run (JAX_NUM_PROCESSES=1): gloo collectives
  two             2 processes over loopback: gloo collectives
and compares every metric and every leaf of the final checkpoint (parameters, optimizer state) of each
one-process run with the two-process run: bitwise equal leaves, and max |a − b| / max |a| per leaf.

  python -m experiments.multihost.compare        # → results.json, compare.png, a table; ~2 min here
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TEST = HERE.parents[1] / "tests" / "sharding" / "test_multihost_main.py"


def _harness():
    spec = importlib.util.spec_from_file_location("test_multihost_main", TEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compare(h, a: Path, b: Path) -> dict:
    metrics_a, metrics_b = h._metrics(a), h._metrics(b)
    pairs = [(k, ra[k], rb[k]) for ra, rb in zip(metrics_a, metrics_b, strict=True) for k in ra if ra[k] != rb[k]]
    worst_metric = {}
    for k, a_value, b_value in pairs:  # {metric: [max |a − b|, max |a − b| / max(|a|, |b|)]}
        diff = abs(a_value - b_value)
        old = worst_metric.get(k, [0.0, 0.0])
        worst_metric[k] = [max(old[0], diff), max(old[1], diff / max(abs(a_value), abs(b_value)))]
    leaves = {}
    for (path, x), (_, y) in zip(h._state(a), h._state(b), strict=True):
        if x.dtype.kind == "f":
            leaves[path] = float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-30))
    return {"metrics_differing": worst_metric, "leaves": leaves,
            "bitwise_leaves": sum(v == 0.0 for v in leaves.values()), "float_leaves": len(leaves),
            "max_relative": max(leaves.values())}


def main() -> None:
    h = _harness()
    root = Path(tempfile.mkdtemp(prefix="multihost_compare_"))
    h._CACHE = root / "jax_cache"
    cache = root / "sft_cache"
    runs = {"one_gloo": (h._env(8, (h._free_port(), 0, 1)),), "one_inprocess": (h._env(8),)}
    for i, (name, (env,)) in enumerate(runs.items()):
        print(f"[{i + 1}/3] {name} ...", flush=True)
        log = root / f"{name}.log"
        assert h._wait([h._start(h._command(root / name, cache), env, log)], [log]) == [0], log.read_text()[-2000:]
    print("[3/3] two processes ...", flush=True)
    h._run_two(root / "two", cache)
    results = {name: _compare(h, root / name, root / "two") for name in runs}
    results["config"] = {"overrides": list(h.OVERRIDES), "steps": h.STEPS}
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    for name in runs:
        r = results[name]
        print(f"{name:>14} vs two: {r['bitwise_leaves']}/{r['float_leaves']} leaves bitwise, max relative "
              f"difference {r['max_relative']:.2e}; metrics differing: "
              + (", ".join(f"{k} (abs {v[0]:.1e}, rel {v[1]:.1e})" for k, v in r["metrics_differing"].items())
                 or "none"))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results["one_inprocess"]["leaves"])
    fig, ax = plt.subplots(figsize=(10, 5))
    for k, name in enumerate(runs):
        values = [max(results[name]["leaves"][n], 1e-12) for n in names]
        ax.bar(np.arange(len(names)) + 0.4 * k, values, width=0.4, label=f"{name} vs two processes")
    ax.set_yscale("log")
    labels = [("opt " if "opt_state" in n else "") + ".".join(part.strip("'") for part in n.replace("]", "").split("[")
                                                     if part.strip("'") not in ("", "0", "value", "params"))[-48:]
              for n in names]
    ax.set_xticks(np.arange(len(names)) + 0.2, labels, rotation=80, fontsize=6)
    ax.set_ylabel("max |a − b| / max |a| (1e-12 = bitwise)")
    ax.set_title(f"Final state after {h.STEPS} RL steps: 1 × 8 devices vs 2 processes × 4")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "compare.png", dpi=120)
    print(f"wrote {HERE / 'results.json'} and {HERE / 'compare.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
