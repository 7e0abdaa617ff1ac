"""Checkpoints of a training run with orbax: atomic, keep-N, exact resume, corruption found and named.

One checkpoint per step, `<directory>/<step>/`, holding four orbax items:
  state   the pytree of arrays (params, optimizer state, step, PRNG keys, ...), orbax StandardSave;
  data    the data-iterator state (a JSON dict, e.g. a grain iterator's `get_state()`);
  extra   any other JSON dict (config, seeds, numbers to carry over);
  layout  our own record of every state leaf (path, shape, dtype, PRNG implementation and a fingerprint), the
          SHA-256 of the data and extra items, and the SHA-256 of the record itself.
Orbax writes each step into a temporary directory and renames it when complete, so an interrupted save never
shows up as a step (and its leftover is removed when the next manager opens the directory); it keeps the `keep`
newest steps.

Orbax does not notice every corruption: a flipped byte inside an array chunk restores silently wrong numbers. So
every saved leaf carries a fingerprint of its bits (`logra_jax.core.fingerprint`), computed on device where the
leaf lies
and checked after restore:
  words w_i = the leaf's bits as uint32 in row-major order (8/16-bit types zero-extended, 64-bit types split),
  c_i = (i · 0x9E3779B1 + 0x7F4A7C15) | 1,   fingerprint = Σ_i c_i w_i  mod 2³².
Every c_i is odd, hence invertible mod 2³²: a change of any single word always changes the fingerprint. The values
are stored in the layout item, so that definition is fixed for good (tests/ckpt/test_ckpt_fingerprint.py pins it).
The JSON items are checked too: a flipped bit in a digit of the data-iterator state still parses, as another
position in the data. Orbax's own metadata files either fail to parse (named in the error) or, where orbax does
not use them to read the arrays (commit markers, timestamps), change nothing that is restored.

A full disk (ENOSPC, or a quota: EDQUOT) during a save is reported as such, naming the directory and the checkpoint
that stays intact; the interrupted save's partial directory is removed when the next manager opens the directory
(before it checks the directory is writable), and so are stale write probes; each removal is reported through
`log`.

Typed PRNG keys (`jax.random.key`) are stored as their key data (uint32) and re-wrapped with the implementation
of the restore target; raw key data (`jax.random.key_data`) round-trips as any uint32 array.

Example:
  >>> import tempfile, jax, jax.numpy as jnp
  >>> ckpt = CheckpointManager(tempfile.mkdtemp(), keep=2)
  >>> tree = {"w": jnp.arange(4.0), "step": jnp.int32(7), "key": jax.random.key(0)}
  >>> ckpt.save(7, tree, data_state={"next_index": 3}, extra={"seed": 0})
  True
  >>> restored, data_state, extra = ckpt.restore(abstract=jax.eval_shape(lambda: tree))
  >>> int(restored["step"]), data_state, extra
  (7, {'next_index': 3}, {'seed': 0})
  >>> ckpt.close()
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from logra_jax.core.fingerprint import leaf_fingerprints
from logra_jax.parallel import multihost

LAYOUT_FORMAT = "logra_jax.job.checkpoint/2"
OLD_LAYOUT_FORMATS = ("logra_jax.job.checkpoint/1",)  # without the checksums: read, not checked
_ITEMS = ("state", "data", "extra", "layout")
_JSON_ITEMS = ("data", "extra")  # their SHA-256 in the layout record
# What an interrupted save leaves: orbax's temporary step directory, and our write probe.
_LEFTOVER = re.compile(r"^(\d+\.orbax-checkpoint-tmp.*|\.write-probe-\d+-\d+)$")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota
_FULL_TEXTS = {code: os.strerror(code) for code in _FULL_ERRNOS}  # errno → "No space left on device", ...
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint on disk is unreadable, corrupted, or does not fit the tree it is restored into."""


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(dtype: Any) -> str:
    """The PRNG implementation name ("threefry2x32", "rbg", ...) of a typed-key dtype."""
    names: list[str] = []
    jax.eval_shape(lambda k: names.append(str(jax.random.key_impl(k))), jax.ShapeDtypeStruct((), dtype))
    return names[0]


def _check_json(value: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"CheckpointManager.save: {name} must be a dict, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"CheckpointManager.save: {name} is not JSON-serialisable: {e}") from e
    return dict(value)


def _abstract_leaf(leaf: Any, path: str) -> jax.ShapeDtypeStruct:
    """A restore-target leaf as a ShapeDtypeStruct (with its sharding when it has one)."""
    if isinstance(leaf, (bool, int, float, np.ndarray, np.generic)):  # as save stores them: jnp.asarray(leaf)
        return jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf))
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise TypeError(f"CheckpointManager.restore: abstract leaf {path} must be an array or jax.ShapeDtypeStruct, "
                        f"got {type(leaf).__name__}")
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))


def _stored(leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """What is on disk for a target leaf: typed PRNG keys as their uint32 key data, in the same sharding."""
    if not _is_key(leaf.dtype):
        return leaf
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=leaf.sharding)


def _describe(leaf: Any) -> dict[str, Any]:
    key = _is_key(leaf.dtype)
    return {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "key_impl": _key_impl(leaf.dtype) if key else None}


class CheckpointManager:
    """Saves and restores (state pytree, data-iterator state, extra JSON) per step under `directory`.

    Args:
      directory: the run's checkpoint directory (created unless `create=False`); a local path or a URL that
        etils.epath understands (gs://...). Multi-host runs need one directory that every host sees.
      keep: number of newest checkpoints kept (None: all).
      save_every: `save(step, ...)` writes when step % save_every == 0, when `force=True`, or when JAX reports a
        preemption (multi-host runs with the preemption service); otherwise it returns False.
      async_save: write in a background thread after copying the arrays to host (`wait_until_finished` joins it).
      create: create `directory` when missing and check that it can be written (a read-only or full location
        fails here, not at the first save, whose failure orbax reports only from its background threads); with
        False a missing directory raises FileNotFoundError and nothing is checked (restore-only use).
      log: where the one-line notices go (a leftover of an interrupted save removed); None: this module's
        `logging` logger, at WARNING.

    Raises:
      ValueError: keep or save_every not a positive integer.
      FileNotFoundError: `directory` is missing and create=False.
      CheckpointError: create=True and `directory` cannot be created or written (names it and the OS error; a
        full disk is named as such).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> with CheckpointManager(tempfile.mkdtemp(), keep=1, save_every=10) as ckpt:
      ...     [ckpt.save(s, {"w": jnp.full(2, s)}) for s in (5, 10, 20)]
      ...     ckpt.wait_until_finished()
      ...     ckpt.all_steps()
      [False, True, True]
      [20]
    """

    def __init__(self, directory: str | Path, *, keep: int | None = 3, save_every: int = 1,
                 async_save: bool = True, create: bool = True, log: Callable[[str], None] | None = None) -> None:
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"CheckpointManager: keep must be a positive integer or None, got {keep!r}")
        if not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 1:
            raise ValueError(f"CheckpointManager: save_every must be a positive integer, got {save_every!r}")
        # Remote paths (gs://...) go through etils.epath, orbax's own path type; local ones are made absolute.
        self.directory = epath.Path(directory) if "://" in str(directory) else epath.Path(Path(directory).absolute())
        if not create and not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
        self._log = log if log is not None else _log.warning
        self._pending: int | None = None  # the step of the save in flight (named when it fails)
        if create:  # before orbax starts its background threads, whose own errors would follow ours
            self._remove_leftovers()  # first: on a disk the interrupted save filled, they hold the space
            _check_writable(self.directory)
        self.keep = keep
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_for_errors(self) -> None:
        """Raise the error of a finished background save, without waiting for one in progress.

        Raises:
          CheckpointError: a background save failed (names the directory and the error).
        """
        try:
            self._manager.check_for_errors()
        except Exception as e:
            raise self._save_failed(e) from e

    def set_aside(self, step: int, destination: str | Path) -> Path:
        """Move checkpoint `step` out of the manager's directory into `destination`/<step>-<time> (kept, not
        deleted) so that the run can resume from an older step and later write `step` again.

        Returns:
          Where the checkpoint now is.
        """
        self.wait_until_finished()
        target = Path(destination) / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:  # one directory that every process sees: process 0 moves it (and logs)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(str(self.step_dir(step)), target)
        multihost.barrier(f"set_aside {step}")
        self._manager.reload()
        return target

    def step_dir(self, step: int) -> epath.Path:
        """The directory of checkpoint `step` (whether or not it exists)."""
        return self.directory / str(step)

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending; waits for a pending save first.

        Interrupted saves (orbax's temporary directories) are not steps.
        """
        self.wait_until_finished()
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True when `save(step, ...)` without force would write: step % save_every == 0 or a preemption."""
        return step % self.save_every == 0 or self._manager.reached_preemption(step)

    def save(self, step: int, state_tree: Any, *, data_state: Mapping[str, Any] | None = None,
             extra: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Write checkpoint `step` (asynchronously unless async_save=False) when `should_save(step)` or force.

        Call on every process of a multi-host run with the same arguments. The arrays are copied to host before
        this returns, so the caller may donate or overwrite them right after.

        Args:
          step: the step number (≥ 0), usually the number of completed updates.
          state_tree: any pytree of arrays: nnx.State, optax states (NamedTuples), typed PRNG keys or key data,
            scalar steps; numpy arrays and Python scalars are stored as `jnp.asarray(leaf)`.
          data_state: the data-iterator state (a JSON dict; None: {}).
          extra: other JSON-able values to carry over (None: {}).
          force: save even when `should_save(step)` is False.

        Returns:
          Whether a checkpoint was written.

        Raises:
          ValueError: negative step, or a checkpoint for `step` exists already.
          TypeError: data_state / extra not JSON-serialisable, or a state leaf of an unsupported dtype.
          CheckpointError: an earlier background save failed, the directory cannot be written now, or orbax
            failed to start the save (names the directory or the step directory).
        """
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be a non-negative integer, got {step!r}")
        step = int(step)
        data_state = _check_json(data_state, "data_state")
        extra = _check_json(extra, "extra")
        if not force and not self.should_save(step):
            return False
        data_state = _gather_data_states(data_state)  # every process decides alike whether to save
        if step in self.all_steps():
            raise ValueError(f"CheckpointManager.save: checkpoint {self.step_dir(step)} exists already")
        # A save orbax cannot write fails in its background threads and is reported one save late (or never,
        # by a last save): surface an earlier save's failure, and probe the directory now, so that a read-only
        # or full location stops the run at this save.
        self.check_for_errors()
        self._pending = step
        try:
            _check_writable(self.directory)
        except CheckpointError as e:  # a disk already full: say which checkpoint is intact and how to go on
            raise (self._save_failed(e) if _disk_full(e) else e) from e.__cause__
        keyed, treedef = jax.tree_util.tree_flatten_with_path(state_tree)
        paths = [jax.tree_util.keystr(p) for p, _ in keyed]
        leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in keyed]
        layout = [{"path": path, **_describe(x)} for path, x in zip(paths, leaves)]
        leaves = [jax.random.key_data(x) if _is_key(x.dtype) else x for x in leaves]
        for entry, value in zip(layout, leaf_fingerprints(leaves, paths)):
            entry["fingerprint"] = value
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(jax.tree_util.tree_unflatten(treedef, leaves)),
            data=ocp.args.JsonSave(data_state), extra=ocp.args.JsonSave(extra),
            layout=ocp.args.JsonSave(_sealed({"format": LAYOUT_FORMAT, "leaves": layout, "items": {
                "data": _json_digest(data_state), "extra": _json_digest(extra)}})))
        try:
            self._manager.save(step, args=args, force=True)
        except Exception as e:
            raise self._save_failed(e) from e
        return True

    def _save_failed(self, e: BaseException) -> CheckpointError:
        """The error to raise for a failed save: names the directory, the step and the cause; for a full disk,
        which checkpoint is intact and how to resume."""
        step = "a checkpoint" if self._pending is None else f"checkpoint {self._pending}"
        full = _disk_full(e)
        if full is None:
            return CheckpointError(f"saving {step} in {self.directory} failed: {type(e).__name__}: {_first_line(e)}")
        done = [s for s in _committed_steps(self.directory) if s != self._pending]
        intact = f"checkpoint {done[-1]} ({self.step_dir(done[-1])}) is intact" if done else "no checkpoint is intact"
        return CheckpointError(f"saving {step} in {self.directory} failed: the disk is full ({full}); {intact}. Free "
                               "space there and run the same command again to resume (the partial save is removed "
                               f"then). The error: {type(e).__name__}: {_first_line(e)}")

    def _remove_leftovers(self) -> None:
        """Remove what interrupted saves left in the directory (orbax's temporary step directories: process 0;
        this process index's write probes of an earlier process), each named through `log`.

        Raises:
          CheckpointError: a leftover cannot be removed (names it).
        """
        mine = f".write-probe-{jax.process_index()}-"
        found = sorted(self.directory.iterdir(), key=lambda p: p.name) if self.directory.is_dir() else []
        for path in found:
            if not _LEFTOVER.match(path.name):
                continue
            if path.name.startswith(".write-probe-"):
                if not path.name.startswith(mine) or path.name == f"{mine}{os.getpid()}":
                    continue
                path.unlink(missing_ok=True)
                self._log(f"removed a stale write probe of an earlier run: {path}")
            elif jax.process_index() == 0:
                try:
                    path.rmtree(missing_ok=True)
                except OSError as e:  # files appearing while it is removed: a save still writing into it
                    raise CheckpointError(f"cannot remove {path}, the partial checkpoint of an interrupted save "
                                          f"({type(e).__name__}: {e}); is another run saving into "
                                          f"{self.directory}?") from e
                self._log(f"removed the partial checkpoint of an interrupted save: {path}")
        multihost.barrier("checkpoint leftovers removed")  # every process, whether or not the directory exists

    def restore(self, step: int | None = None, *, abstract: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Read checkpoint `step` (None: the latest) into the structure, dtypes and shardings of `abstract`.

        Args:
          step: the step to restore; None for the newest complete one.
          abstract: the target tree: jax.ShapeDtypeStruct leaves (with shardings, e.g. from eval_shape plus
            `logra_jax.parallel.sharding`) or arrays like the ones saved (their shape, dtype and sharding are used).
            A leaf without a sharding comes back with the sharding it was saved with (same topology only).
            Typed PRNG key leaves are re-wrapped with their dtype's implementation.

        Returns:
          (state_tree, data_state, extra): the restored tree (the structure of `abstract`) and the JSON dicts.

        Raises:
          FileNotFoundError: no checkpoint at all, or none for `step` (names the path and the available steps).
          CheckpointError: an unreadable item (naming the JSON files that no longer parse), a leaf whose bits
            differ from what was saved, a JSON item or layout record that differs from its SHA-256 (naming the
            file), or a tree that does not match the checkpoint (names the step directory and the first
            mismatching leaf path).
        """
        keyed, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        paths = [jax.tree_util.keystr(p) for p, _ in keyed]
        wanted = [_abstract_leaf(x, path) for path, (_, x) in zip(paths, keyed)]
        expected = [{"path": path, **_describe(x)} for path, x in zip(paths, wanted)]
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory} (available steps: none)")
            step = steps[-1]
        step_dir = self.step_dir(step)
        if step not in steps or not step_dir.is_dir():
            raise FileNotFoundError(f"checkpoint {step_dir} not found (available steps: {steps or 'none'})")
        where = f"checkpoint {step_dir}"
        others = [s for s in steps if s != step]
        hint = f" (other steps on disk: {others})" if others else ""
        layout = self._read(step, where, hint, layout=ocp.args.JsonRestore())["layout"]
        saved = _check_layout(layout, step_dir, hint)
        _match_layout(saved, expected, where)
        items = self._read(step, where, hint, state=ocp.args.StandardRestore(jax.tree_util.tree_unflatten(
            treedef, [_stored(x) for x in wanted])), data=ocp.args.JsonRestore(), extra=ocp.args.JsonRestore())
        leaves = jax.tree_util.tree_leaves(items["state"])
        if len(leaves) != len(saved):
            raise CheckpointError(f"{where}: restored {len(leaves)} leaves, the layout lists {len(saved)}{hint}")
        for entry, value in zip(saved, leaf_fingerprints(leaves, [e["path"] for e in saved])):
            if value != entry["fingerprint"]:
                raise CheckpointError(f"{where} is corrupted: leaf {entry['path']} does not match its saved "
                                      f"fingerprint ({value} != {entry['fingerprint']}){hint}")
        leaves = [jax.random.wrap_key_data(x, impl=e["key_impl"]) if e["key_impl"] else x
                  for x, e in zip(leaves, expected)]
        _check_items(layout, items, step_dir, hint)
        data = _own_data_state(dict(items["data"]), where)
        return jax.tree_util.tree_unflatten(treedef, leaves), data, dict(items["extra"])

    def read_extra(self, step: int) -> dict[str, Any]:
        """The extra JSON of checkpoint `step` alone (what decides the structure to `restore` it into), checked
        against the layout record's checksum.

        Raises:
          CheckpointError: the item is unreadable or corrupted (names the step directory or the file).
        """
        step_dir = self.step_dir(step)
        items = self._read(step, f"checkpoint {step_dir}", "", extra=ocp.args.JsonRestore(),
                           layout=ocp.args.JsonRestore())
        _check_layout(items["layout"], step_dir, "")
        _check_items(items["layout"], items, step_dir, "")
        return dict(items["extra"])

    def _read(self, step: int, where: str, hint: str, **items: Any) -> Any:
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            names = ", ".join(items)
            bad = _unparsable_json(self.step_dir(step))
            which = f" (not valid JSON: {', '.join(bad)})" if bad else ""
            raise CheckpointError(f"{where} is unreadable ({names}){which}: {type(e).__name__}: {_first_line(e)}"
                                  f"{hint}") from e

    def wait_until_finished(self) -> None:
        """Block until the pending asynchronous save has been written (and old checkpoints removed).

        Raises:
          CheckpointError: the background save failed (names the directory).
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(e) from e
        self._pending = None

    def close(self) -> None:
        """Finish pending saves and release orbax's resources."""
        self.wait_until_finished()
        self._manager.close()


PER_PROCESS = "per_process"


def _gather_data_states(state: dict[str, Any]) -> dict[str, Any]:
    """A multi-process run's data-iterator states, one per process: {"per_process": [state_0, ...]} (every
    process reads its own data shard, so each has its own iterator). Single-process: `state` unchanged."""
    if jax.process_count() == 1:
        return state
    raw = np.frombuffer(json.dumps(state, sort_keys=True).encode(), np.uint8)
    padded = np.zeros(int(multihost.gather(np.int32(raw.size)).max()), np.uint8)
    padded[:raw.size] = raw
    return {PER_PROCESS: [json.loads(bytes(r).rstrip(b"\0").decode()) for r in multihost.gather(padded)]}


def _own_data_state(data: dict[str, Any], where: str) -> dict[str, Any]:
    """This process's data-iterator state from a checkpoint's data item (see `_gather_data_states`)."""
    saved = data.get(PER_PROCESS)
    count = jax.process_count()
    if saved is None and count == 1:
        return data
    saved_count = 1 if saved is None else len(saved)
    if saved_count != count:
        raise CheckpointError(f"{where} holds the data-iterator state of {saved_count} process(es); this run has "
                              f"{count} (resume with the number of processes that wrote it)")
    return dict(saved[jax.process_index()])


def _check_writable(directory: epath.Path) -> None:
    """Create `directory` and a probe file in it (then remove the file); CheckpointError naming it otherwise."""
    probe = directory / f".write-probe-{jax.process_index()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:
        full = "" if _disk_full(e) is None else "the disk is full, "
        raise CheckpointError(f"checkpoint directory {directory} is not writable ({full}{type(e).__name__}: "
                              f"{e})") from e


def _disk_full(e: BaseException | None) -> str | None:
    """The OS's words when `e` (or an error it was raised from) is a full disk or quota, else None: Python's
    OSError, or TensorStore's message (its C++ writes report the OS error in the text)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return os.strerror(e.errno)
        for code, words in _FULL_TEXTS.items():
            if words in str(e) or f"os_error_code='{code}'" in str(e):
                return words
        e = e.__cause__ or e.__context__
    return None


def _committed_steps(directory: epath.Path) -> list[int]:
    """The step directories present (an interrupted save's temporary directory is not one), ascending."""
    try:
        return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    except OSError:
        return []


def _first_line(e: BaseException) -> str:
    """Orbax/TensorStore messages carry kilobytes of JSON spec after the first line; keep the readable part."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    return text if len(text) <= 400 else text[:400] + " ..."


def _json_digest(value: Any) -> str:
    """SHA-256 of `value`'s canonical JSON text (sorted keys, no spaces): equal for equal JSON values, whatever
    the spacing or key order orbax wrote them in."""
    plain = json.loads(json.dumps(value, allow_nan=False))  # as it reads back: int keys as strings, tuples as lists
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _sealed(layout: dict[str, Any]) -> dict[str, Any]:
    """The layout record with the digest of its other fields, so that a flipped bit in it is found as such."""
    return {**layout, "sha256": _json_digest(layout)}


def _check_layout(layout: Any, step_dir: epath.Path, hint: str) -> list[dict[str, Any]]:
    """The leaf records of checkpoint `step_dir`'s layout item, after checking its format, fields and own digest."""
    where = f"checkpoint {step_dir} is corrupted: its layout item ({step_dir / 'layout' / 'metadata'})"
    if not isinstance(layout, Mapping) or layout.get("format") not in (LAYOUT_FORMAT, *OLD_LAYOUT_FORMATS):
        raise CheckpointError(f"{where} is not a {LAYOUT_FORMAT} record{hint}")
    if layout["format"] == LAYOUT_FORMAT:
        fields = {k: v for k, v in layout.items() if k != "sha256"}
        if layout.get("sha256") != _json_digest(fields) or not isinstance(layout.get("items"), Mapping):
            raise CheckpointError(f"{where} does not match its own SHA-256{hint}")
    leaves = layout.get("leaves")
    keys = {"path", "shape", "dtype", "key_impl", "fingerprint"}
    if not isinstance(leaves, list) or not all(isinstance(e, Mapping) and keys <= set(e) for e in leaves):
        raise CheckpointError(f"{where} lacks leaf records with fields {sorted(keys)}{hint}")
    return leaves


def _check_items(layout: Mapping[str, Any], items: Mapping[str, Any], step_dir: epath.Path, hint: str) -> None:
    """Raise CheckpointError naming the file of a JSON item whose contents differ from the digest in the layout
    (a layout of an older format holds none: nothing to check)."""
    digests = layout.get("items", {})
    for name in _JSON_ITEMS:
        if name in items and name in digests and _json_digest(items[name]) != digests[name]:
            raise CheckpointError(f"checkpoint {step_dir} is corrupted: its {name} item "
                                  f"({step_dir / name / 'metadata'}) does not match the SHA-256 in its layout{hint}")


# Orbax's JSON files in a step directory (the others are TensorStore's binary files).
_JSON_FILES = ("_CHECKPOINT_METADATA", "*/metadata", "*/_METADATA", "*/_sharding", "*/array_metadatas/*")


def _unparsable_json(step_dir: epath.Path) -> list[str]:
    """The JSON files of `step_dir` that do not parse (paths relative to its parent), to name in an error."""
    bad = []
    for pattern in _JSON_FILES:
        for path in sorted(step_dir.glob(pattern), key=str):
            try:
                json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                bad.append(f"{step_dir.name}/{path.relative_to(step_dir)}")
    return bad


def _match_layout(saved: list[dict[str, Any]], expected: list[dict[str, Any]], where: str) -> None:
    """Raise CheckpointError naming the first leaf where the checkpoint and the restore target disagree."""
    saved_paths = [e["path"] for e in saved]
    expected_paths = [e["path"] for e in expected]
    if saved_paths != expected_paths:
        saved_set, expected_set = set(saved_paths), set(expected_paths)
        for i in range(max(len(saved_paths), len(expected_paths))):
            want = expected_paths[i] if i < len(expected_paths) else None
            have = saved_paths[i] if i < len(saved_paths) else None
            if want is not None and want not in saved_set:
                raise CheckpointError(f"{where} does not match the restore target: leaf {want} is not in the "
                                      f"checkpoint")
            if have is not None and have not in expected_set:
                raise CheckpointError(f"{where} does not match the restore target: checkpoint leaf {have} is not "
                                      f"in the target")
            if want != have:
                raise CheckpointError(f"{where} does not match the restore target: leaf order differs at {want}")
    for have, want in zip(saved, expected):
        for field in ("shape", "dtype", "key_impl"):
            if have[field] != want[field]:
                raise CheckpointError(f"{where} does not match the restore target: leaf {want['path']} has "
                                      f"{field} {have[field]} in the checkpoint, {want[field]} in the target")
