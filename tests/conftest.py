"""Test session set-up: 8 fake CPU devices before JAX starts, fp32 matmuls at full precision, and a persistent
compilation cache for the session, off unless a test folder turns it on (tests/train/conftest.py).

The folder is fresh per `pytest` session and shared by its xdist workers (the controlling process sets it before
they start) and by the job subprocesses they launch, through the environment. A cache hit returns the executable
the compiler made for the same HLO, so no test sees a different program; only the CI time changes. It stays off
elsewhere because a program that embeds large constants (a real model's weights closed over) costs more to hash
and write than to compile.
"""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
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

import jax

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if _OWNED_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWNED_CACHE, ignore_errors=True)
