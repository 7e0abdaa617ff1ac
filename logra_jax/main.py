"""Entry point: python -m logra_jax.main --config=configs/<name>.py --workdir=DIR [--config.train.steps=10 ...]."""

from absl import app, flags, logging
from ml_collections import config_flags

from logra_jax import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots (resumed if present).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every checkpoint step at INFO; --verbosity=0 shows it
        logging.set_verbosity(logging.WARNING)
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
