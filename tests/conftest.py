"""Test session set-up: 8 fake CPU devices before JAX starts, fp32 matmuls at full precision, the CPU backend's
code generation at LLVM -O0 without threads of its own (`SERIAL_CPU`), and a persistent compilation cache for the
session, off unless a test folder turns it on (tests/train/conftest.py).

The cheap code generation is `logra_jax.parallel.sharding.FAST_CPU_COMPILE` as XLA_FLAGS (each flag unless XLA_FLAGS
already sets it): XLA's HLO passes (fusion, layout, scheduling) run as always; LLVM does not optimise the generated
kernels and, up to jaxlib 0.11.0 (`sharding.CPU_LOOP_EMITTERS`), the classic loop emitters replace the fusion
emitters. The tests' programs are small and each is compiled once, so compiling dominates their time: a tiny RL
step with microbatches and a 3-step job, 28 s with the default pipeline (13.7 + 14.4 s), 24 s at -O0 alone, 16 s
with all three; a SmolLM2 step, where running dominates, 25 → 24 s (jax 0.10.2).

The folder is fresh per `pytest` session and shared by its xdist workers (the controlling process sets it before
they start) and by the job subprocesses they launch, through the environment. A cache hit returns the executable
the compiler made for the same HLO, so no test sees a different program; only the CI time changes. It stays off
elsewhere because a program that embeds large constants (a real model's weights closed over) costs more to hash
and write than to compile.
"""

import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "LOGRA_TEST_COMPILATION_CACHE" not in os.environ:  # the controlling process: a fresh folder for the session
    os.environ["LOGRA_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="logra_jax_test_jit_cache_")
    _OWNED_CACHE = os.environ["LOGRA_TEST_COMPILATION_CACHE"]
else:
    _OWNED_CACHE = None
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["LOGRA_TEST_COMPILATION_CACHE"]
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # after the JAX_* variables, which jax reads at import
import pytest

from logra_jax.parallel.sharding import FAST_CPU_COMPILE, xla_flags

# XLA:CPU without threads of its own: make test runs three workers on two cores, so a compile's parallel code
# generation (the module split in parts, compiled on a thread pool) and Eigen's intra-op thread pool only add
# hand-offs and duplicated work. One compile of the tiny model's gradient: 0.400 → 0.292 s of CPU (codegen split).
SERIAL_CPU = {"xla_cpu_parallel_codegen_split_count": 1, "xla_cpu_multi_thread_eigen": False}
_TEST_OPTIONS = {**FAST_CPU_COMPILE, **SERIAL_CPU}
# Every process of the session compiles with these (tests compare programs across processes bit for bit): the
# tests that start a job with its own XLA_FLAGS (a device count of its own) pass LOGRA_TEST_XLA_FLAGS on.
os.environ["LOGRA_TEST_XLA_FLAGS"] = xla_flags(_TEST_OPTIONS)

# XLA reads XLA_FLAGS when the first backend starts, after this. xdist workers and job subprocesses inherit the
# controller's flags; a flag XLA_FLAGS already sets is kept.
_flags = os.environ.get("XLA_FLAGS", "")
_test = {name: value for name, value in _TEST_OPTIONS.items() if f"--{name}=" not in _flags}
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8 {xla_flags(_test)}".strip()

jax.config.update("jax_default_matmul_precision", "highest")


# Skips that are failures here: a space-separated list of the environments this run must have (`venv-tpu`,
# `venv-cuda`, `venv-vllm`), set by `make test-aot`, `make test-vllm` and CI. A test or module that skips for want of
# one of them says so by naming its make command ("make venv-tpu"); where the environment is required, that skip is
# a broken build, not a pass, and is reported as a failure.
REQUIRE = "LOGRA_TEST_REQUIRE"


def _required_skip(report) -> str | None:
    """The required environment a skipped report names, or None."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    reason = report.longrepr[2]
    return next((env for env in os.environ.get(REQUIRE, "").split() if f"make {env}" in reason), None)


def _fail_required_skip(report) -> None:
    env = _required_skip(report)
    if env is not None:
        report.outcome = "failed"
        report.longrepr = (f"skipped for want of {env}, which this run requires ({REQUIRE}={os.environ[REQUIRE]!r}): "
                           f"{report.longrepr[2]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_required_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_required_skip(report)
    return report


def pytest_collection_modifyitems(config, items):
    """The tests marked `slow` first (a stable sort, the same on every xdist worker): the workers take tests in
    collection order (after the xdist groups, which go first), so the long ones start early and the short ones even
    out the end, instead of one long test finishing the run alone. `-m "not slow"` leaves them out (a quick check;
    `make test` runs them all)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_collection_finish(session):
    """Move everything collection made (the modules of jax, flax, transformers' package and the tests: about
    317,000 objects per worker, alive until the end) out of the cycle collector's reach, so that each full
    collection the tests' tracing triggers, and each `gc.collect()` (the job's per-phase device balance, pytest's
    own), scans only what the tests allocate. A tiny train job: 0.99–1.07 → 0.25–0.28 s of collection."""
    gc.collect()
    gc.freeze()


SWEEP_EVERY = 200  # tests between full collections of everything (pytest_runtest_teardown)
_tests_since_sweep = 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The same after each test, once its fixtures are torn down: its garbage collected, what survives (session
    fixtures, jax's caches of traced and compiled programs) frozen. Otherwise the heap the tests leave grows
    through the session and every full collection rescans it: 150 of them cost 74 s across the three workers.
    Every `SWEEP_EVERY` tests one collection over everything (unfrozen first) frees cycles that became garbage
    after they were frozen; each takes longer as the heap grows (about 0.4 s to 1.3 s, 0.9–1.3 million objects
    frozen by the end). The collector's time across the workers, full runs: 39 s with a sweep every 50 tests, 22 s
    with one every 200."""
    global _tests_since_sweep
    result = yield
    _tests_since_sweep += 1
    if _tests_since_sweep >= SWEEP_EVERY:
        _tests_since_sweep = 0
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    return result


def pytest_unconfigure(config):
    if _OWNED_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWNED_CACHE, ignore_errors=True)


def _random_moe_layer(config):
    """(layer, rng): one MoE layer of `config` with O(1) random weights drawn by rng = default_rng(0) (router, gate,
    up, down in that order); rng goes on to draw the test's inputs."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from logra_jax.models import moe

    layer = moe.MoE(config, rngs=nnx.Rngs(params=0))
    rng = np.random.default_rng(0)
    for module in (layer.router, layer.gate_proj, layer.up_proj, layer.down_proj):
        shape = module.kernel.shape
        module.kernel.set_value(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32))
    return layer, rng


@pytest.fixture(scope="session")
def random_moe_layer():
    """`_random_moe_layer`: config → (an MoE layer with O(1) random weights, the numpy rng that drew them)."""
    return _random_moe_layer


@pytest.fixture
def moe_layer_without_expert():
    """A factory (config, unused, *, tokens=(2, 7), center_router=False) → (layer, x, cotangent): `random_moe_layer`
    with positive inputs x [*tokens, D] and a router column of −1 for expert `unused`, so its logit is −Σx, far
    below the others and no token chooses it; `center_router` first removes each router row's mean over the
    experts (no expert favoured by the positive inputs' mean). x and the cotangent are float32 numpy arrays."""
    import jax.numpy as jnp
    import numpy as np

    def make(config, unused, *, tokens=(2, 7), center_router=False):
        layer, rng = _random_moe_layer(config)
        router = np.asarray(layer.router.kernel[...]).copy()
        if center_router:
            router -= router.mean(axis=0)
        router[:, unused] = -1.0
        layer.router.kernel.set_value(jnp.asarray(router))
        x = np.abs(rng.standard_normal((*tokens, config.hidden_size))).astype(np.float32)
        return layer, x, rng.standard_normal(x.shape).astype(np.float32)

    return make


@pytest.fixture(scope="session")
def tmpfs_refusal():
    """refused(path) -> None when an unprivileged mount namespace (`unshare -rm`) can mount a tmpfs on `path`
    here, else why not (the full-disk tests' skip reason)."""
    import shutil
    import subprocess

    def refused(path) -> str | None:
        if shutil.which("unshare") is None:
            return "no unshare(1) here"
        probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {path}"],
                               capture_output=True, text=True)
        return None if probe.returncode == 0 else f"unshare -rm cannot mount a tmpfs: {probe.stderr.strip()[:200]}"

    return refused
