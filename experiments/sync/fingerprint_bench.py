"""Time the one fingerprint (logra_jax.core.fingerprint.tree_fingerprint) against the two it replaced, interleaved.

The old implementations (transport/sync.py's weight_fingerprint, checkpoint.py's _leaf_fingerprints) are loaded
from commit dce1b86 with `git show`; the new values are checked equal to the old checkpoint's (the persisted
definition). Trees: SmolLM2-135M's parameter shapes (stacked layers, 134.5M fp32) and 30 × [576, 1536] + [49152, 576].

Run: python experiments/sync/fingerprint_bench.py [reps]      (prints medians in ms; ~1 min here)
"""

import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from logra_jax.core.fingerprint import tree_fingerprint  # noqa: E402

OLD = "dce1b86"


def _old_module(name: str, path: str, tmp: Path):
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD}:{path}"], check=True, capture_output=True,
                            text=True).stdout
    file = tmp / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    with tempfile.TemporaryDirectory() as tmp:
        old_sync = _old_module("old_sync", "logra_jax/rollout/sync.py", Path(tmp))
        old_ckpt = _old_module("old_checkpoint", "logra_jax/job/checkpoint.py", Path(tmp))
    fns = {"old sync weight_fingerprint": old_sync.weight_fingerprint,
           "old checkpoint _leaf_fingerprints": lambda t: old_ckpt._leaf_fingerprints(jax.tree.leaves(t)),
           "tree_fingerprint": tree_fingerprint}
    rng = np.random.default_rng(0)
    shapes = {"attn.k": (30, 576, 192), "attn.o": (30, 576, 576), "attn.q": (30, 576, 576), "attn.v": (30, 576, 192),
              "attn_norm": (30, 576), "mlp.down": (30, 1536, 576), "mlp.gate": (30, 576, 1536),
              "mlp.up": (30, 576, 1536), "mlp_norm": (30, 576), "embed": (49152, 576), "final_norm": (576,)}
    trees = {"SmolLM2-135M shapes": {k: jnp.asarray(rng.standard_normal(s, dtype=np.float32))
                                     for k, s in shapes.items()},
             "30 x [576,1536] + [49152,576]": {**{f"layer{i}": jnp.asarray(rng.standard_normal((576, 1536), np.float32))
                                                 for i in range(30)},
                                              "embed": jnp.asarray(rng.standard_normal((49152, 576), np.float32))}}
    for tree_name, tree in trees.items():
        assert list(tree_fingerprint(tree).values()) == old_ckpt._leaf_fingerprints(jax.tree.leaves(tree))
        for f in fns.values():
            f(tree)  # compile
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(reps):
            for name, f in fns.items():
                start = time.perf_counter()
                f(tree)
                times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            print(f"{tree_name} | {name}: median {1e3 * statistics.median(ts):.0f} ms ({reps} reps)")


if __name__ == "__main__":
    main()
