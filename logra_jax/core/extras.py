"""Optional dependencies: an import that needs an extra names the extra to install.

`pip install logra_jax` brings the core (jax, jaxlib, numpy, optax): all that `logra_jax.optim` and
`logra_jax.kernels` import. The RL job and the modules around it (models, sketch-native probes, rl, checkpoints,
metrics) need the `rl` extra: `pip install 'logra_jax[rl]'`. The public entry points that need it —
`logra_jax.main`, `logra_jax.job.train`, `logra_jax.models`, `logra_jax.native` — import under `requires_extra`, so
that without the extra they raise a ModuleNotFoundError that names it, instead of only the first missing package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

EXTRAS = ("rl", "vllm")  # pyproject.toml's extras that library modules need (the others: accelerators, docs, dev tools)


@contextlib.contextmanager
def requires_extra(extra: str, importer: str) -> Iterator[None]:
    """Re-raise a missing third-party package inside the block as a ModuleNotFoundError naming `extra`.

    A missing logra_jax module is a bug, not a missing extra: it propagates unchanged, as does every other error.

    Args:
      extra: the extra whose packages the block imports (one of EXTRAS).
      importer: the module doing the imports, named in the message.

    Raises:
      ValueError: `extra` is not one of EXTRAS.
      ModuleNotFoundError: a package imported (directly or through other modules) inside the block is missing;
        the message names the package, `importer` and the `pip install` command; `name` is the missing module's.

    Example:
      >>> with requires_extra("rl", "my_module"):  # doctest: +ELLIPSIS
      ...     import a_package_not_installed
      Traceback (most recent call last):
      ModuleNotFoundError: my_module needs ... logra_jax[rl] (no module named 'a_package_not_installed'): pip ...
    """
    if extra not in EXTRAS:
        raise ValueError(f"requires_extra: extra must be one of {EXTRAS}, got {extra!r}")
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] == "logra_jax":
            raise
        raise ModuleNotFoundError(
            f"{importer} needs the optional dependencies of logra_jax[{extra}] (no module named {e.name!r}): "
            f"pip install 'logra_jax[{extra}]'", name=e.name) from e
