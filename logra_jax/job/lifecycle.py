"""How a run starts, resumes and stops: signals, the saved config and its history, and why a run ended.

  with StopRequests() as stop:          # SIGTERM / SIGINT → stop.signum, checked at step boundaries
      ...
      if stop.signum: raise RunPreempted(stop.signum, step)

Preemption. Schedulers (TPU VMs, SLURM, Kubernetes, cloud spot VMs) preempt with SIGTERM; a user stops with
Ctrl-C (SIGINT). The first signal only records the request: the loop finishes its step, writes a checkpoint and
raises RunPreempted; `python -m logra_jax.main` then exits with 128 + the signal number (143 for SIGTERM, 130
for SIGINT). No exception is raised inside a running XLA compilation or a collective (a KeyboardInterrupt there
used to end in a segfault traceback). A second SIGINT exits at once (status 130) without a checkpoint.

Resume. A workdir keeps `config.json` (the config of its latest start) and `config_history.jsonl` (one record per
start: time, start step, the full config on the first start and the changed fields on later ones). Fields that
change what a checkpoint means (RESUME_FIXED: the model, the task, the optimizer's kind, rank and rank rules, seed,
projection and trained set, the prompts per step that the data iterator's state counts) refuse a resume with an
error that lists them; every other change (steps, learning rate, evaluation/checkpoint/log cadence, mesh, ...)
resumes and is logged.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

# Config fields (section, or section.field) that a resumed run must share with its checkpoint.
RESUME_FIXED = (
    "model",                      # the architecture and the weights the checkpoint's arrays belong to
    "task",                       # the problems, the split and the data iterator's dataset
    "rollout.prompts_per_step",   # the data iterator's state counts batches of this size
    "optimizer.name",             # the optimizer state's structure
    "optimizer.targets_only",
    "optimizer.non_targets",
    "optimizer.rank",             # sketch / factor shapes
    "optimizer.rank_rules",       # each target's rank: its sketch, factor and momentum shapes
    "optimizer.base_seed",        # the projections A the factors were taken in
    "optimizer.distribution",
    "optimizer.refresh",
    "optimizer.refresh_every",
    "optimizer.momentum",         # the sketch-space first moment's state (none at 0)
    "optimizer.weight_dtype",     # the checkpointed weights' dtype
    "optimizer.variant",          # which moments RowAdam keeps
    "optimizer.sketch_native",
    "optimizer.kl_control",       # the controller's state
    "algorithm.estimator",        # the advantage estimator's state
)

# Fixed fields added after configs were first saved: what a saved config without the field meant (it predates
# the field, so it ran with this value), so that those runs still resume.
RESUME_DEFAULTS = {
    "optimizer.rank_rules": "",   # no rank rules: every target at optimizer.rank
}

_EXIT_BASE = 128
_log = logging.getLogger(__name__)


class RunPreempted(RuntimeError):
    """The run stopped on a signal after checkpointing `step` (None: stopped before any RL step was saved)."""

    def __init__(self, signum: int, step: int | None, detail: str = "") -> None:
        self.signum = signum
        self.step = step
        name = signal.Signals(signum).name
        where = f"after step {step} (checkpoint {step} written)" if step is not None else "before any checkpoint"
        super().__init__(f"stopped by {name} {where}{detail}")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by that signal."""
        return _EXIT_BASE + self.signum


class StopRequests:
    """Turns SIGTERM and SIGINT into a request (`signum`) that the training loop honours at its next step boundary.

    A context manager; the previous handlers come back on exit. Outside the main thread (where Python cannot
    install handlers) it does nothing and `signum` stays None.

    Example:
      >>> import os, signal
      >>> with StopRequests() as stop:
      ...     os.kill(os.getpid(), signal.SIGTERM)
      ...     stop.signum == signal.SIGTERM
      True
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, *, on_request: Any = None) -> None:
        self.signum: int | None = None
        self._on_request = on_request
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            sys.stderr.write("\nsecond interrupt: exiting now, without a checkpoint\n")
            sys.stderr.flush()
            os._exit(_EXIT_BASE + signal.SIGINT)
        if self.signum is None:
            self.signum = signum
            if self._on_request is not None:
                self._on_request(signum)

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and prefix == "":  # sections; mappings inside a section are one value
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields ("section.field") whose value differs between two RunConfig.to_dict() dicts: name → (saved, now).

    A field missing on one side (a config written by an older version) counts as changed, with None there.
    """
    old, new = _flatten(saved), _flatten(current)
    return {name: (old.get(name), new.get(name)) for name in sorted(set(old) | set(new))
            if old.get(name) != new.get(name)}


def is_fixed(name: str) -> bool:
    """Whether field `name` ("section.field") must not change between a checkpoint and the run resuming it."""
    return any(name == fixed or name.startswith(fixed + ".") for fixed in RESUME_FIXED)


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any], where: str
                 ) -> dict[str, tuple[Any, Any]]:
    """The changes between the checkpointed run's config and this one; an error when a RESUME_FIXED field changed.

    A fixed field the saved config lacks (written before the field existed) takes its RESUME_DEFAULTS value.

    Raises:
      ValueError: lists every fixed field that changed with both values, names `where` and says how to proceed.
    """
    changes = config_changes(saved, current)
    changes = {name: (RESUME_DEFAULTS[name] if old is None and name in RESUME_DEFAULTS else old, new)
               for name, (old, new) in changes.items()}
    changes = {name: values for name, values in changes.items() if values[0] != values[1]}
    refused = {name: values for name, values in changes.items() if is_fixed(name)}
    if refused:
        listed = "; ".join(f"{name}: {old!r} in the checkpointed run, {new!r} now"
                           for name, (old, new) in refused.items())
        raise ValueError(f"cannot resume the run in {where} with a changed config: {listed}. These fields change "
                         "what its checkpoints mean; use the run's own values (its config.json) or a new workdir")
    return changes


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{name} {old!r} → {new!r}" for name, (old, new) in changes.items())


def write_json_atomic(path: Path, value: Any) -> None:
    """Write `value` as indented JSON through a temporary file and a rename (never a half-written file).

    The temporary files of earlier writers of `path` that were stopped before their rename are removed, each
    named in a warning of this module's `logging` logger.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    for stale in sorted(path.parent.glob(f".{path.name}.*.tmp")):
        if stale != tmp:
            stale.unlink(missing_ok=True)
            _log.warning(f"removed {stale}, the temporary file of a writer of {path.name} stopped before its rename")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True))
    os.replace(tmp, path)


def record_config(workdir: Path, config: Mapping[str, Any], *, start_step: int,
                  changes: Mapping[str, tuple[Any, Any]] | None) -> None:
    """Save this start's config as config.json and append a record to config_history.jsonl.

    changes: None on a fresh start (the record holds the whole config), else the fields changed since the
    checkpointed run (possibly none).
    """
    record: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "start_step": start_step}
    if changes is None:
        record["config"] = dict(config)
    else:
        record["changes"] = {name: list(values) for name, values in changes.items()}
    with (workdir / "config_history.jsonl").open("a") as f:
        f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
    write_json_atomic(workdir / "config.json", dict(config))


def read_json(path: Path, what: str) -> Any:
    """A JSON file of the run directory, or an error naming it (and the line and column) when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
