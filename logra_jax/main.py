"""Entry point: python -m logra_jax.main --config=configs/<name>.py --workdir=DIR [--config.train.steps=10 ...].

Exit status: 0 finished (or already finished); 1 an error, whose one-line description is the last thing printed
(after the traceback for unexpected errors; expected ones — bad config, unreadable or unwritable checkpoints,
non-finite metrics, KL refusals — print only the line); 128 + N when signal N stopped the run after a checkpoint
(143 SIGTERM, 130 SIGINT). The process ends with os._exit after flushing its output, so background threads of a
failed checkpoint save (orbax waits up to 20 minutes for signals that never come) cannot hold a batch job's
machines, and no interpreter-shutdown noise follows the error.
"""

import os
import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from logra_jax import train
from logra_jax.checkpoint import CheckpointError
from logra_jax.lifecycle import RunPreempted
from logra_jax.metrics import NonFiniteMetricError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots (resumed if present).")
flags.mark_flags_as_required(["config", "workdir"])

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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every checkpoint step at INFO; --verbosity=0 shows it
        logging.set_verbosity(logging.WARNING)
    try:
        train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except RunPreempted as e:
        _exit(e.exit_code, f"{e}; run the same command again to resume")
    except Exception as e:  # every error ends the process here, described last
        if not _expected(e):
            traceback.print_exc()
        _exit(1, f"error: {type(e).__name__}: {e}")
    _exit(0)


if __name__ == "__main__":
    app.run(main)
