"""Entry point: python -m logra_jax.main --config=configs/<name>.py --workdir=DIR [--config.train.steps=10 ...].

Several processes (hosts) form one run when each is started with the same command and its identity, taken in
this order from: --coordinator_address/--num_processes/--process_id; the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; JAX's own cluster detection (TPU pod slices, SLURM,
Open MPI); else the run is a single process. The processes meet at the coordinator (a missing one is a
DistributedInitError within LOGRA_DISTRIBUTED_TIMEOUT_S, default 300 s), the mesh spans all their devices, and
an error on any process stops every process, each naming the one that failed (docs/scaling.md, "Several hosts").

Exit status: 0 finished (or already finished); 1 an error, whose one-line description is the last thing printed
(after the traceback for unexpected errors; expected ones — bad config, unreadable or unwritable checkpoints,
non-finite metrics, KL refusals — print only the line); 128 + N when signal N stopped the run after a checkpoint
(143 SIGTERM, 130 SIGINT). The process ends with os._exit after flushing its output, so background threads of a
failed checkpoint save (orbax waits up to 20 minutes for signals that never come) cannot hold a batch job's
machines, and no interpreter-shutdown noise follows the error.
"""

import gc
import os
import sys
import time
import traceback

import jax

from logra_jax.core.extras import requires_extra

with requires_extra("rl", "logra_jax.main"):
    from absl import app, flags, logging
    from ml_collections import config_flags

    from logra_jax.job import train
    from logra_jax.job.checkpoint import CheckpointError
    from logra_jax.job.lifecycle import RunPreempted
    from logra_jax.job.metrics import NonFiniteMetricError
    from logra_jax.parallel import multihost

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots (resumed if present).")
flags.mark_flags_as_required(["config", "workdir"])
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run (multi-process runs).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")

# Errors that describe bad input or a run's state completely: their message is enough, a traceback only buries it.
EXPECTED = (CheckpointError, FileNotFoundError, NonFiniteMetricError, train.KLRefusalError)


def _expected(e: BaseException) -> bool:
    """Errors about the run's input (config fields, checkpoints, resume rules), not bugs."""
    return isinstance(e, EXPECTED) or (isinstance(e, ValueError) and str(e).startswith(("config", "cannot resume")))


def _exit(code: int, message: str = "") -> None:
    if message:
        sys.stderr.write(f"logra_jax.main: {message}\n")
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _peer_failed(text: str) -> None:
    """Another process of the run failed (the failure watch's callback): stop this one at once, naming it."""
    if jax.process_index() == 0:  # it hosts the coordination service: give the others time to read the news
        time.sleep(multihost.LINGER_S)
    _exit(1, f"error: stopping process {jax.process_index()} because {text}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # What exists now (the modules of jax, flax, orbax: about 214,000 objects) lives as long as the process: out
    # of the cycle collector's reach, so that its collections, and the one before each phase's device balance
    # (metrics.describe_device_balance), scan only what the job allocates. A 2-step RL job on the tiny model:
    # 11–12 full collections, 1.44–1.58 → 0.55–0.66 s (two runs each).
    gc.collect()
    gc.freeze()
    if not flags.FLAGS["verbosity"].present:  # orbax logs every checkpoint step at INFO; --verbosity=0 shows it
        logging.set_verbosity(logging.WARNING)
    try:
        identity = multihost.resolve(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        if identity is not None:
            multihost.initialize(identity)
            multihost.watch_failures(_peer_failed)
    except (ValueError, multihost.DistributedInitError) as e:
        _exit(1, f"error: {type(e).__name__}: {e}")
    try:
        train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except RunPreempted as e:
        if e.step is None:  # a stop before RL (during SFT) is this process's alone: the others must hear of it
            multihost.announce_failure(str(e))
        else:  # every process agreed on the stop and raises it at the same step: leave together
            multihost.stop_watching()
            if identity is not None:
                multihost.shutdown()
        _exit(e.exit_code, f"{e}; run the same command again to resume")
    except Exception as e:  # every error ends the process here, described last
        if not _expected(e):
            traceback.print_exc()
        message = f"{type(e).__name__}: {e}"
        multihost.announce_failure(message)  # the other processes stop now instead of waiting in a collective
        _exit(1, f"error: {message}" if identity is None else f"error: process {jax.process_index()}: {message}")
    if identity is not None:
        multihost.stop_watching()
        multihost.shutdown()
    _exit(0)


if __name__ == "__main__":
    app.run(main)
