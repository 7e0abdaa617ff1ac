"""Faults beyond kills at the checkpoint and metrics layer (issue 63): a full disk during a save, a flipped bit in
any file of the newest checkpoint, what interrupted writers leave behind, a failed log or metrics write.

The whole-run counterparts (non-finite rewards and gradients, a half-written metrics line, another config's
checkpoint) are in tests/train/test_faults.py.
"""

import builtins
import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.job.checkpoint import CheckpointError, CheckpointManager
from logra_jax.job.lifecycle import check_resume, write_json_atomic
from logra_jax.job.metrics import Logger, MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def tree_of(step: int) -> dict:
    """A small train-state-like tree whose every leaf depends on `step`."""
    rng = np.random.default_rng(step)
    return {"w": jnp.asarray(rng.normal(size=(64,)), jnp.float32), "step": jnp.int32(step),
            "key": jax.random.key(step), "half": jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16)}


ABSTRACT = jax.eval_shape(lambda: tree_of(0))
DATA = {"next_index": 37, "shuffle": {"seed": 3, "epoch": 1}}
EXTRA = {"accuracy_before": 0.125, "sft": {"steps": 20, "final_loss": 0.4375}}


def bits(tree) -> list:
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            .tobytes() for x in jax.tree.leaves(tree)]


# ---------------------------------------------------------------- a full disk during a save


@contextlib.contextmanager
def disk_fills(directory: Path, room: int):
    """Python-level writes under `directory` see a disk with `room` bytes left: the write that would go past it,
    and every later one, raises OSError(ENOSPC) as write(2) does on a full disk. This is what orbax's JSON items,
    its metadata files and our write probe meet on a full disk (TensorStore writes the arrays from C++, which a
    real small filesystem reaches: test_a_real_full_filesystem_...)."""
    real_open, left = builtins.open, [room]

    class FillingFile:
        def __init__(self, file):
            self._file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._file.close()

        def write(self, data):
            if len(data) > left[0]:
                left[0] = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            left[0] -= len(data)
            return self._file.write(data)

        def __getattr__(self, name):
            return getattr(self._file, name)

        def close(self):
            self._file.close()

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        inside = isinstance(file, (str, os.PathLike)) and Path(file).resolve().is_relative_to(directory.resolve())
        return FillingFile(f) if inside and any(c in mode for c in "wax+") else f

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtins, "open", fake_open)
        patch.setattr(io, "open", fake_open)  # pathlib's Path.open calls io.open
        yield


def settle(directory: Path, quiet: float = 1.0, timeout: float = 30.0) -> None:
    """Wait until nothing under `directory` changes for `quiet` seconds: the failed save's TensorStore writes,
    which the injected fault does not fail, may still be in flight (a real run's process exits after the
    failure; this test's goes on, as the next run, in the same process)."""
    def snapshot():
        sizes = []
        for path in directory.rglob("*"):
            with contextlib.suppress(FileNotFoundError):  # removed since it was listed
                sizes.append((str(path), path.stat().st_size))
        return sorted(sizes)

    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        now = snapshot()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.1)
    raise AssertionError(f"{directory} still changing after {timeout} s")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("room", [0, 600], ids=["full-before-the-save", "fills-during-the-save"])
def test_a_full_disk_names_itself_keeps_the_last_checkpoint_and_the_same_command_resumes(tmp_path, room):
    directory = tmp_path / "checkpoints"
    ckpt = CheckpointManager(directory, keep=1)
    ckpt.save(1, tree_of(1), data_state=DATA, extra=EXTRA)
    ckpt.wait_until_finished()
    with disk_fills(directory, room), pytest.raises(CheckpointError) as info:
        ckpt.save(2, tree_of(2), data_state=DATA, extra=EXTRA)
        ckpt.wait_until_finished()
    with contextlib.suppress(CheckpointError):  # the failed save, reported again
        ckpt.close()
    settle(directory)
    message = str(info.value)
    assert "\n" not in message and len(message) < 1000
    assert f"saving checkpoint 2 in {directory} failed: the disk is full (No space left on device); checkpoint 1 " \
        f"({directory / '1'}) is intact. Free space there and run the same command again" in message, message
    # Space is back: the same command (a new manager on the directory) resumes from checkpoint 1 and saves on.
    notices = []
    with CheckpointManager(directory, keep=1, log=notices.append) as ckpt:
        assert ckpt.all_steps() == [1]
        restored, data_state, extra = ckpt.restore(abstract=ABSTRACT)
        assert bits(restored) == bits(tree_of(1)) and data_state == DATA and extra == EXTRA
        ckpt.save(2, tree_of(2), data_state=DATA, extra=EXTRA)
        assert ckpt.all_steps() == [2]
        assert bits(ckpt.restore(abstract=ABSTRACT)[0]) == bits(tree_of(2))
    partial = [n for n in notices if "partial checkpoint of an interrupted save" in n]
    assert len(partial) == (1 if room else 0), notices


FULL_DISK_SCRIPT = """
import json, subprocess, sys
import jax, jax.numpy as jnp, numpy as np
from logra_jax.job.checkpoint import CheckpointError, CheckpointManager

directory, mount = sys.argv[1], sys.argv[2]
small, big = {"w": jnp.zeros(16)}, {"w": jnp.asarray(np.random.default_rng(0).normal(size=200_000), jnp.float32)}
out = {}
ckpt = CheckpointManager(directory, keep=1)
ckpt.save(1, small)
ckpt.wait_until_finished()
try:
    ckpt.save(2, big)  # 800 kB on a 512 kB filesystem
    ckpt.wait_until_finished()
except CheckpointError as e:
    out["error"] = str(e)
try:
    ckpt.close()
except CheckpointError:
    pass
subprocess.run(["mount", "-o", "remount,size=8m", mount], check=True)  # space is back
notices = []
with CheckpointManager(directory, keep=1, log=notices.append) as ckpt:
    out["steps_after"] = ckpt.all_steps()
    out["restored"] = ckpt.restore(abstract={"w": jax.ShapeDtypeStruct((16,), jnp.float32)})[0]["w"].tolist()
    ckpt.save(2, big)
    ckpt.wait_until_finished()
    out["steps_resumed"] = ckpt.all_steps()
out["notices"] = notices
print("RESULT " + json.dumps(out))
"""


def test_a_real_full_filesystem_during_a_save(tmp_path, tmpfs_refusal):
    """A 512 kB tmpfs that the second save overflows from TensorStore's C++ writes: a real ENOSPC."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    reason = tmpfs_refusal(mount)
    if reason:
        pytest.skip(f"no small filesystem to fill: {reason}")
    script = tmp_path / "fill.py"
    script.write_text(FULL_DISK_SCRIPT)
    directory = mount / "checkpoints"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["LOGRA_TEST_XLA_FLAGS"]}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=512k tmpfs {mount} && exec "
                           f"{sys.executable} {script} {directory} {mount}"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert f"saving checkpoint 2 in {directory} failed: the disk is full" in out["error"]
    assert "No space left on device" in out["error"] and "\n" not in out["error"]
    assert f"checkpoint 1 ({directory / '1'}) is intact" in out["error"]
    assert out["steps_after"] == [1] and out["restored"] == [0.0] * 16
    assert out["steps_resumed"] == [2]
    assert [n for n in out["notices"] if "partial checkpoint of an interrupted save" in n], out["notices"]


def test_a_full_disk_under_the_log_and_the_metrics_names_the_file_and_keeps_the_error(tmp_path):
    """The run's own error (e.g. the failed save) must reach the user: the log line announcing it cannot raise
    the log file's ENOSPC instead; a metrics write names its file and step."""
    stream = io.StringIO()
    log = Logger(tmp_path, stream=stream)
    with disk_fills(tmp_path, room=30):  # one metrics line
        writer = MetricsWriter(tmp_path, tensorboard=False)
        writer.write(1, {"loss": 0.5})
        with pytest.raises(OSError, match=rf"appending step 2 to {tmp_path / 'metrics.jsonl'} failed: No space"):
            writer.write(2, {"loss": 0.25})
        log("stopped: error: CheckpointError: the disk is full")
    writer.close()
    assert "stopped: error: CheckpointError: the disk is full" in stream.getvalue()
    assert f"(not written to {tmp_path / 'log.txt'}: No space left on device)" in stream.getvalue()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


# ---------------------------------------------------------------- a flipped bit in any file of the checkpoint


# Every file of a checkpoint, by kind; test_the_flip_cases_cover_every_file_of_a_checkpoint keeps this complete.
FILES = ["_CHECKPOINT_METADATA", "commit_success.txt", "data/metadata", "data/commit_success.txt", "extra/metadata",
         "extra/commit_success.txt", "layout/metadata", "layout/commit_success.txt", "state/_METADATA",
         "state/_sharding", "state/array_metadatas/process_0", "state/commit_success.txt", "state/manifest.ocdbt",
         "state/d/*", "state/ocdbt.process_0/manifest.ocdbt", "state/ocdbt.process_0/d/*"]


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """Checkpoints 1 and 2 of `tree_of`, written once per module (each case flips a copy)."""
    directory = tmp_path_factory.mktemp("pair") / "checkpoints"
    with CheckpointManager(directory) as ckpt:
        for step in (1, 2):
            ckpt.save(step, tree_of(step), data_state={**DATA, "next_index": 37 + step}, extra=EXTRA)
    return directory


def _files(step_dir: Path, pattern: str) -> list[Path]:
    return sorted(step_dir.glob(pattern))


def _flips(data: bytes) -> list[int]:
    """Where to flip the lowest bit: the middle byte, and the last digit (a digit stays a digit: JSON text that
    still parses, with another number in it)."""
    digits = [i for i, b in enumerate(data) if 0x30 <= b <= 0x39]
    return sorted({len(data) // 2, *digits[-1:]})


def test_the_flip_cases_cover_every_file_of_a_checkpoint(saved_pair):
    step_dir = saved_pair / "2"
    every = {p.relative_to(step_dir) for p in step_dir.rglob("*") if p.is_file()}
    covered = [{p.relative_to(step_dir) for p in _files(step_dir, pattern)} for pattern in FILES]
    assert all(covered), [pattern for pattern, files in zip(FILES, covered) if not files]
    assert set().union(*covered) == every


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("pattern", FILES)
def test_a_flipped_bit_in_any_file_is_found_or_changes_nothing(saved_pair, tmp_path, pattern):
    """Restoring checkpoint 2 after one bit of `pattern`'s file(s) flipped either raises one line naming the step
    directory (and the file, where one is at fault: a JSON item or a file that no longer parses), or restores
    exactly what was saved: never other numbers, another data position or other extras, and never a checkpoint
    that silently stops being a step (the run would resume from an older one without a word)."""
    originals = _files(saved_pair / "2", pattern)
    for original in originals:
        data = original.read_bytes()
        for position in _flips(data):
            directory = tmp_path / f"{original.name}-{position}"
            shutil.copytree(saved_pair, directory)
            target = directory / "2" / original.relative_to(saved_pair / "2")
            flipped = bytearray(data)
            flipped[position] ^= 0x01
            target.write_bytes(bytes(flipped))
            with CheckpointManager(directory) as ckpt:
                assert ckpt.all_steps() == [1, 2]
                try:
                    restored, data_state, extra = ckpt.restore(abstract=ABSTRACT)
                except CheckpointError as e:
                    message = str(e)
                    assert str(directory / "2") in message and "\n" not in message, message
                    relative = target.relative_to(directory)
                    if not pattern.startswith("state/"):  # our JSON items: the file itself is named
                        assert str(target) in message or f"not valid JSON: {relative}" in message, message
                    assert "other steps on disk: [1]" in message
                    continue
            assert bits(restored) == bits(tree_of(2)), (target, position)
            assert data_state == {**DATA, "next_index": 39} and extra == EXTRA, (target, position)


def test_a_checkpoint_of_the_previous_layout_format_still_restores(saved_pair, tmp_path):
    """Checkpoints written before the layout carried checksums (format /1) restore, unchecked."""
    shutil.copytree(saved_pair, tmp_path / "c")
    path = tmp_path / "c" / "2" / "layout" / "metadata"
    layout = json.loads(path.read_text())
    path.write_text(json.dumps({"format": "logra_jax.job.checkpoint/1", "leaves": layout["leaves"]}))
    with CheckpointManager(tmp_path / "c") as ckpt:
        assert bits(ckpt.restore(abstract=ABSTRACT)[0]) == bits(tree_of(2))
        assert ckpt.read_extra(2) == EXTRA


# ---------------------------------------------------------------- what interrupted writers leave behind


def test_leftovers_of_interrupted_saves_are_removed_and_named_one_line_each(saved_pair, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(saved_pair, directory)
    partial = directory / "3.orbax-checkpoint-tmp-1700000000000000"  # a save killed before its rename
    shutil.copytree(directory / "2", partial)
    (partial / "state" / "manifest.ocdbt.__lock").write_bytes(b"")  # TensorStore's lock of a write in flight
    stale_probe = directory / ".write-probe-0-999999999"  # a process killed between the probe's write and unlink
    stale_probe.write_text("ok")
    other_process = directory / ".write-probe-1-999999999"  # process 1 of a multi-host run may be probing now
    other_process.write_text("ok")
    notices = []
    with CheckpointManager(directory, log=notices.append) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        assert bits(ckpt.restore(abstract=ABSTRACT)[0]) == bits(tree_of(2))
    assert sorted(notices) == [f"removed a stale write probe of an earlier run: {stale_probe}",
                               f"removed the partial checkpoint of an interrupted save: {partial}"]
    assert not partial.exists() and not stale_probe.exists() and other_process.exists()


def test_a_stale_temporary_config_file_is_removed_and_named(tmp_path, caplog):
    stale = tmp_path / ".config.json.4242.tmp"  # a start killed between writing config.json and its rename
    stale.write_text('{"model": ')
    with caplog.at_level(logging.WARNING, logger="logra_jax.job.lifecycle"):
        write_json_atomic(tmp_path / "config.json", {"train": {"steps": 3}})
    assert [r.getMessage() for r in caplog.records] == [
        f"removed {stale}, the temporary file of a writer of config.json stopped before its rename"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert json.loads((tmp_path / "config.json").read_text()) == {"train": {"steps": 3}}


def test_a_half_written_metrics_line_is_dropped_and_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n{"step": 3, "lo')  # killed mid-write
    notices = []
    with MetricsWriter(tmp_path, tensorboard=False, log=notices.append) as writer:
        writer.write(3, {"loss": 0.125})  # on a line of its own
    assert notices == [f"{path}: dropped its unfinished last line (15 bytes, from a run stopped while writing it): "
                       "'{\"step\": 3, \"lo'"]
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n{"step": 3, "loss": 0.125}\n'
    with MetricsWriter(tmp_path, tensorboard=False, log=notices.append):
        pass
    assert len(notices) == 1  # a complete file: nothing to say


def test_a_stopped_rewrite_of_the_metrics_leaves_a_copy_that_is_removed_and_named(tmp_path):
    """truncate_after writes metrics.jsonl.tmp, then renames it: a run stopped in between leaves the copy."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (tmp_path / "metrics.jsonl.tmp").write_text('{"step": 1, "lo')
    notices = []
    with MetricsWriter(tmp_path, tensorboard=False, log=notices.append):
        pass
    assert notices == [f"removed {tmp_path / 'metrics.jsonl.tmp'}, the copy of metrics.jsonl a resume was rewriting "
                       "when it stopped"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# ---------------------------------------------------------------- a checkpoint of another config


def test_another_configs_checkpoint_is_refused_in_one_line_naming_every_differing_field():
    saved = {"model": {"preset": "tiny", "init_seed": 0}, "optimizer": {"rank": 4, "base_seed": 0, "lr": 0.1},
             "train": {"steps": 4}}
    current = {"model": {"preset": "tiny", "init_seed": 3}, "optimizer": {"rank": 2, "base_seed": 0, "lr": 0.2},
               "train": {"steps": 8}}
    with pytest.raises(ValueError) as info:
        check_resume(saved, current, "/runs/a")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot resume the run in /runs/a with a changed config: model.init_seed: 0 in the "
                              "checkpointed run, 3 now; optimizer.rank: 4 in the checkpointed run, 2 now. ")
    assert "optimizer.lr" not in message and "train.steps" not in message  # changes a resume may take
    assert check_resume(saved, {**saved, "train": {"steps": 8}}, "/runs/a") == {"train.steps": (4, 8)}


def test_the_json_checksums_are_of_the_values_not_of_their_spelling(tmp_path):
    """A data state with integer keys or tuples reads back with string keys and lists (JSON): the same value."""
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, tree_of(1), data_state={"order": (3, 1, 2), "by_epoch": {"1": 4}}, extra={"x": [1.5, None]})
        _, data_state, extra = ckpt.restore(abstract=ABSTRACT)
    assert data_state == {"order": [3, 1, 2], "by_epoch": {"1": 4}} and extra == {"x": [1.5, None]}


def test_the_layout_says_what_it_guards(saved_pair):
    layout = json.loads((saved_pair / "2" / "layout" / "metadata").read_text())
    assert layout["format"] == "logra_jax.job.checkpoint/2"
    assert set(layout["items"]) == {"data", "extra"} and len(layout["sha256"]) == 64
    fields = {k: v for k, v in layout.items() if k != "sha256"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert layout["sha256"] == hashlib.sha256(canonical.encode()).hexdigest()
    extra = json.dumps(EXTRA, sort_keys=True, separators=(",", ":"))
    assert layout["items"]["extra"] == hashlib.sha256(extra.encode()).hexdigest()

