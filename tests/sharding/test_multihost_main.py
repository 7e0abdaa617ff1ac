"""The main job across processes: `python -m logra_jax.main` as 2 processes × 4 fake CPU devices (jax.distributed
over loopback), preempted by SIGTERM to one process, stopped by both at one checkpointed step and resumed, against
1 process × 8 devices with the same (data=2, fsdp=4) mesh; one process failing stops the other.

Like for like: the reference is one process of a `jax.distributed` run (JAX_NUM_PROCESSES=1), so its collectives
are gloo's like those of the 2-process run (XLA:CPU's in-process all-reduce sums in another order; against it the
2-process run differs by Adam-amplified rounding: experiments/multihost/README.md). And the runs share an SFT
cache: XLA:CPU rounds the SFT warm start (on each process's first device) one ulp differently with 4 and with 8
devices per process, so both layouts start RL from the reference's cached weights. From there on the comparison
is of the multi-process loop itself, and it is bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

# every test of the module on one xdist worker (make test's --dist loadgroup), so that its session-scoped fixtures
# are built once
pytestmark = [pytest.mark.xdist_group("multihost_main"), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
# The demo config, shortened: SFT from a shared cache, 2 RL steps of 4 prompts × 4 samples with KL control, a
# checkpoint per step; the format bonus gives the still-weak policy rewards that differ within a group, so every
# step learns. 16 rows and 4 held-out problems: a row per device and two per data shard, the fewest that keep
# every device and both processes busy in every phase (CI time: every run here is a job start).
OVERRIDES = ("--config.train.mesh_data=2", "--config.train.mesh_fsdp=4", f"--config.train.steps={STEPS}",
             "--config.train.checkpoint_every=1", f"--config.train.keep_checkpoints={STEPS}",
             "--config.task.eval_size=4", "--config.rollout.prompts_per_step=4", "--config.rollout.num_samples=4",
             "--config.algorithm.format_weight=0.5", "--config.sft.steps=10", "--config.task.train_size=512",
             "--config.sft.train_size=512",
             # the predicted-KL controller, whose probe responses are gathered from every process's rows
             "--config.optimizer.kl_control=True", "--config.optimizer.kl_budget=0.32",
             "--config.optimizer.ratio_scope=global")
# Metrics that measure the machine, not the run.
MACHINE = ("time", "rss", "bytes_in_use", "peak", "sync_bytes")
TIMEOUT_S = 240
_CACHE = Path("/nonexistent")  # the module's compilation cache directory (set by the `jit_cache` fixture)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(workdir: Path, cache: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "logra_jax.main", "--config=configs/demo.py:runlocal", f"--workdir={workdir}",
            f"--config.sft.cache_dir={cache}", *OVERRIDES, *extra]


def _env(devices: int, process: tuple[int, int, int] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    # every run of this module compiles with the session's flags (the comparisons are between runs that all do)
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {os.environ['LOGRA_TEST_XLA_FLAGS']}",
               JAX_PLATFORMS="cpu",
               # later runs load the executables the first ones compiled (the same programs): CI time
               JAX_COMPILATION_CACHE_DIR=str(_CACHE), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if process is not None:
        port, pid, count = process
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_ID=str(pid),
                   JAX_NUM_PROCESSES=str(count), LOGRA_DISTRIBUTED_TIMEOUT_S="60")
    return env


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = TIMEOUT_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process hung:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    return [p.returncode for p in procs]


def _two_processes(workdir: Path, cache: Path, *, extra: tuple[str, ...] = (), command=None
                   ) -> tuple[list[subprocess.Popen], list[Path]]:
    port = _free_port()
    logs = [workdir.with_name(f"{workdir.name}.process{i}.log") for i in range(2)]
    workdir.parent.mkdir(parents=True, exist_ok=True)
    procs = [_start(command(i) if command else _command(workdir, cache, extra), _env(4, (port, i, 2)), log)
             for i, log in enumerate(logs)]
    return procs, logs


def _run_two(workdir: Path, cache: Path) -> None:
    procs, logs = _two_processes(workdir, cache)
    codes = _wait(procs, logs)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)


def _metrics(workdir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(m in k for m in MACHINE)} for r in lines]


def _state(workdir: Path, step: int = STEPS) -> list[tuple[str, np.ndarray]]:
    """The checkpointed train state as numpy (restored in this single process, whatever wrote it)."""
    checkpointer = ocp.PyTreeCheckpointer()
    path = workdir / "checkpoints" / str(step) / "state"
    meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    tree = checkpointer.restore(path, restore_args=jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta))
    return [(jax.tree_util.keystr(k), np.asarray(v)) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


# Session scope, not module: a module-scoped fixture is torn down whenever the worker's next test is in another
# module, and xdist interleaves other modules' tests between this group's (it was built twice: 82 + 78 s).
@pytest.fixture(scope="session")
def jit_cache(tmp_path_factory):
    """The module's persistent compilation cache: later runs load what the first ones compiled."""
    global _CACHE
    _CACHE = tmp_path_factory.mktemp("multihost_jit_cache")
    return _CACHE


@pytest.fixture(scope="session")
def runs(tmp_path_factory, jit_cache):
    """(reference 1 × 8 workdir, 2 × 4 workdir, shared SFT cache, what the preemption left behind).

    The 2-process run is preempted: once RL has started, process 1 gets SIGTERM; both stop at one checkpointed
    step, and the same command run again resumes and finishes. That resumed run is the one compared bitwise with
    the reference, so one job run checks both properties (a multi-process loop or a resume that changed anything
    breaks the equality; an uninterrupted 2-process run to compare against as well would be a third job start).
    """
    root = tmp_path_factory.mktemp("multihost_main")
    cache, one, two = root / "sft_cache", root / "one_process", root / "two_processes"
    reference = _start(_command(one, cache), _env(8, (_free_port(), 0, 1)), root / "one_process.log")
    assert _wait([reference], [root / "one_process.log"]) == [0], (root / "one_process.log").read_text()[-3000:]
    procs, logs = _two_processes(two, cache)
    deadline = time.monotonic() + TIMEOUT_S
    log_file = two / "log.txt"
    while not (log_file.exists() and "held-out accuracy before RL" in log_file.read_text()):  # RL has started
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            "\n".join(log.read_text()[-3000:] for log in logs)
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    stopped = {"codes": _wait(procs, logs), "log": log_file.read_text(),
               "checkpoints": sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()),
               "summary": (two / "summary.json").exists(),
               "process_logs": "\n".join(log.read_text()[-3000:] for log in logs)}
    if stopped["codes"] == [143, 143]:  # otherwise test_sigterm_... says what happened
        _run_two(two, cache)
    return one, two, cache, stopped


def test_two_processes_equal_one_process_with_the_same_mesh(runs):
    one, two, _, stopped = runs
    assert stopped["codes"] == [143, 143], stopped["process_logs"]  # the run was preempted, then resumed
    reference, multi = _metrics(one), _metrics(two)
    steps = [r for r in reference if "loss" in r]
    assert len(steps) == STEPS and any(abs(r["loss"]) > 0 for r in steps)  # it learned something to compare
    assert multi == reference  # loss, reward, KL, held-out accuracy, ...: bitwise equal
    assert all(r["sync_resyncs"] == 0 for r in steps)  # each process's engine shards stayed bitwise the trainer's
    assert all(r["kl_realised"] > 0 and r["kl_predicted"] > 0 for r in steps)  # the KL probe ran every step
    summaries = [json.loads((d / "summary.json").read_text()) for d in (one, two)]
    assert [{k: s[k] for k in ("accuracy_before", "accuracy_after", "steps")} for s in summaries] == \
        [{k: summaries[0][k] for k in ("accuracy_before", "accuracy_after", "steps")}] * 2
    for (path, a), (_, b) in zip(_state(one), _state(two), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)  # parameters, optimizer state, step: bit for bit
    # the checkpoint holds each process's own data-iterator state; process 0 alone wrote the run's files
    data = "".join(f.read_text() for f in (two / "checkpoints" / str(STEPS) / "data").rglob("*") if f.is_file())
    assert '"per_process"' in data and data.count("next_index") == 2, data
    assert (two / "reward_curve.png").stat().st_size > 0
    assert "[process 0]" in (two / "log.txt").read_text() and "[process 1]" not in (two / "log.txt").read_text()


FAILING = """
import sys
from absl import app
from logra_jax import main
from logra_jax.job import train
calls = []
def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
        raise RuntimeError("reward server unreachable (injected)")
    return score(*args, **kwargs)
score, train.score_responses = train.score_responses, failing
sys.argv = ["logra_jax.main", *sys.argv[1:]]
app.run(main.main)
"""


def test_one_process_failing_stops_the_other_naming_it(jit_cache, tmp_path):
    # no SFT warm start (what fails is the first RL step's scoring), and not the `runs` fixture: on another xdist
    # worker that fixture would be rebuilt
    cache = tmp_path / "sft_cache"
    workdir = tmp_path / "failing"

    def command(process_id: int) -> list[str]:
        argv = [*_command(workdir, cache), "--config.sft.steps=0"]
        return argv if process_id == 0 else [sys.executable, "-c", FAILING, *argv[3:]]

    procs, logs = _two_processes(workdir, cache, command=command)
    codes = _wait(procs, logs, timeout_s=120)  # bounded: not the collective's own 5-minute timeout
    text = [log.read_text() for log in logs]
    assert codes == [1, 1], text
    assert "process 1: RuntimeError: reward server unreachable (injected)" in text[1], text[1][-2000:]
    assert "stopping process 0 because process 1: RuntimeError: reward server unreachable" in text[0], \
        text[0][-2000:]


def test_sigterm_to_one_process_stops_both_at_the_same_checkpointed_step_and_the_run_resumes_identical(runs):
    """A scheduler preempting one host: the stop request is agreed on at the next step boundary, every process
    writes its share of that step's checkpoint and exits 143 (128 + SIGTERM); the same command run again resumes
    from it, each process from its own data-iterator state, and ends bitwise equal to the 1-process reference (the
    `runs` fixture preempts and resumes the 2-process run)."""
    one, two, _, stopped = runs
    assert stopped["codes"] == [143, 143], stopped["process_logs"]
    assert "stopped: preempted" in stopped["log"] and "run the same command again to resume" in stopped["log"]
    assert stopped["checkpoints"] == [1] and not stopped["summary"]
    assert "resumed from checkpoint step 1" in (two / "log.txt").read_text()
    assert _metrics(two) == _metrics(one)
    for (path, a), (_, b) in zip(_state(two), _state(one), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)
