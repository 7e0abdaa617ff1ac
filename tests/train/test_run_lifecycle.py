"""Runs that fail loudly, resume honestly and never hang (issue 17): the main job as a user and a scheduler see it.

The subprocess tests run `python -m logra_jax.main` (or a driver around its `main`) on a 6-step tiny config and
bound every wait, so a hang fails the test instead of holding CI.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import pytest

import logra_jax.job.train as train_mod
from logra_jax.job.checkpoint import CheckpointError
from logra_jax.job.lifecycle import RESUME_FIXED, RunPreempted, config_changes, is_fixed
from logra_jax.job.train import train_and_evaluate

# every test of the module on one xdist worker (make test's --dist loadgroup), so that its session-scoped fixture is
# built once (session, not module: xdist interleaves other modules' tests, which tears a module fixture down)
pytestmark = [pytest.mark.xdist_group("run_lifecycle"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def write_config(tiny_config, path: Path, **sections) -> Path:
    config = tiny_config(**{"train": {"steps": STEPS, "checkpoint_every": 2}, **sections})
    path.write_text(textwrap.dedent(f"""
        import ml_collections

        def get_config():
            return ml_collections.ConfigDict({config!r})
    """))
    return path


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # one device, the session's code generation
    out.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=os.environ["LOGRA_TEST_XLA_FLAGS"])
    return out


def cli(config: Path, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "logra_jax.main", f"--config={config}", f"--workdir={workdir}", *extra]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def stop_lines(workdir: Path) -> list[str]:
    return [line for line in (workdir / "log.txt").read_text().splitlines() if " stopped: " in line]


# ---------------------------------------------------------------- checkpoint directory that cannot be written


def test_unwritable_checkpoint_directory_fails_at_start_naming_it(tmp_path, tiny_config, read_metrics):
    config = write_config(tiny_config, tmp_path / "c.py", sft={"steps": 100_000})  # an SFT that would run for hours
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("a file where the checkpoint directory should be")
    start = time.monotonic()
    proc = subprocess.run(cli(config, workdir), capture_output=True, text=True, env=env(), timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert time.monotonic() - start < 60  # before the SFT warm start, not after it
    assert "checkpoints" in last_line(proc.stderr) and "CheckpointError" in last_line(proc.stderr)
    assert "SFT warm start" not in (workdir / "log.txt").read_text()
    assert "stopped: error: CheckpointError" in stop_lines(workdir)[-1]


def _can_remount_read_only(path: Path) -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {path} {path} && "
                            f"mount -o remount,bind,ro {path}"], capture_output=True)
    return probe.returncode == 0


DRIVER = """
import subprocess, sys, time
from absl import app
import logra_jax.job.train as train
from logra_jax import main

real, calls = train.score_responses, [0]

def score_then_break_the_disk(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 3:  # RL step 3: checkpoint 2 was saved; the disk turns read-only under the run
        for _ in range(300):  # a remount is refused (busy) while the background save still has files open
            done = subprocess.run(["mount", "-o", "remount,bind,ro", {ckpt!r}], capture_output=True, text=True)
            if done.returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("could not remount read-only: " + done.stderr)
    return real(*args, **kwargs)

train.score_responses = score_then_break_the_disk
app.run(main.main, argv=["main", "--config={config}", "--workdir={workdir}"])
"""


def test_a_save_failing_mid_run_stops_the_run_within_seconds(tmp_path, tiny_config, read_metrics):
    """orbax's save threads wait up to 20 min for signals after a failed directory creation; the job must not."""
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    if not _can_remount_read_only(ckpt):
        pytest.skip("no unprivileged mount namespace here (unshare -rm) to make a directory read-only mid-run")
    driver = tmp_path / "driver.py"
    config = write_config(tiny_config, tmp_path / "c.py")
    driver.write_text(DRIVER.format(ckpt=str(ckpt), config=config, workdir=ckpt.parent))
    start = time.monotonic()
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {ckpt} {ckpt} && exec {sys.executable} "
                           f"{driver}"], capture_output=True, text=True, env=env(), timeout=240, cwd=ROOT)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert elapsed < 180
    assert "CheckpointError" in last_line(proc.stderr) and str(ckpt) in last_line(proc.stderr)
    assert "Read-only file system" in last_line(proc.stderr)
    steps = [r["step"] for r in read_metrics(ckpt.parent) if "loss" in r]
    assert steps and max(steps) <= 5  # it stopped at the failed save, not at the end of the run
    assert "stopped: error: CheckpointError" in stop_lines(ckpt.parent)[-1]


DRIVER_SWAP = """
import os, time
from absl import app
import logra_jax.job.train as train
from logra_jax import main

real, calls = train.score_responses, [0]

def score_then_swap_the_directory(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 3:  # RL step 3: once checkpoint 2 is committed, the directory is replaced by a file
        for _ in range(600):
            if os.path.isdir(os.path.join({ckpt!r}, "2")):
                break
            time.sleep(0.1)
        os.replace({ckpt!r}, {ckpt!r} + ".moved")
        with open({ckpt!r}, "w") as f:
            f.write("not a directory")
    return real(*args, **kwargs)

train.score_responses = score_then_swap_the_directory
app.run(main.main, argv=["main", "--config={config}", "--workdir={workdir}"])
"""


def test_a_checkpoint_directory_gone_mid_run_stops_the_run_at_the_next_save(tmp_path, tiny_config, read_metrics):
    """The unprivileged counterpart of the read-only remount: the next save's probe fails and names the path."""
    ckpt = tmp_path / "run" / "checkpoints"
    driver = tmp_path / "driver.py"
    config = write_config(tiny_config, tmp_path / "c.py")
    driver.write_text(DRIVER_SWAP.format(ckpt=str(ckpt), config=config, workdir=ckpt.parent))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, env=env(), timeout=240,
                          cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - start < 180
    assert "CheckpointError" in last_line(proc.stderr) and f"{ckpt} is not writable" in last_line(proc.stderr)
    steps = [r["step"] for r in read_metrics(ckpt.parent) if "loss" in r]
    assert max(steps) == 4  # the save after step 4 failed: no step 5
    assert "stopped: error: CheckpointError" in stop_lines(ckpt.parent)[-1]
    assert (tmp_path / "run" / "checkpoints.moved" / "2").is_dir()  # what was saved before is intact


# ---------------------------------------------------------------- preemption


def _wait_for_log(workdir: Path, text: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ((workdir / "log.txt").exists() and text in (workdir / "log.txt").read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{text!r} never logged: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)


def test_sigterm_checkpoints_stops_and_resumes_exactly(tmp_path, tiny_config, read_metrics, finished_run):
    """Preempted while its first RL step compiles, the run checkpoints the step it finishes, stops with SIGTERM's
    status and resumes to the uninterrupted run's metrics: `finished_run`'s, the same 4 steps (checkpointing
    changes no metric)."""
    straight, straight_config = finished_run
    steps = straight_config["train"]["steps"]
    config = write_config(tiny_config, tmp_path / "c.py", train={"steps": steps, "checkpoint_every": 100})
    workdir = tmp_path / "preempted"
    proc = subprocess.Popen(cli(config, workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=ROOT)
    _wait_for_log(workdir, "held-out accuracy before RL", proc)  # the first RL step is compiling now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM" in last_line(err) and "resume" in last_line(err)
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 1 <= saved[0] < steps  # the step it stopped after; checkpoint_every would not
    assert "stopped: preempted" in stop_lines(workdir)[-1] and "SIGTERM" in stop_lines(workdir)[-1]
    assert not (workdir / "summary.json").exists()

    resumed = subprocess.run(cli(config, workdir), capture_output=True, text=True, env=env(), timeout=240, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_metrics(workdir) == read_metrics(straight)
    assert f"resumed from checkpoint step {saved[0]}" in (workdir / "log.txt").read_text()
    assert f"stopped: finished {steps} steps" in stop_lines(workdir)[-1]


def test_ctrl_c_while_compiling_with_a_rollout_worker_stops_cleanly(tmp_path, tiny_config, read_metrics):
    """Ctrl-C reaches the whole process group (trainer and rollout worker) while the first step compiles: a
    checkpoint, status 130, no segfault, traceback or interpreter noise, and the worker did not die under it."""
    config = write_config(tiny_config, tmp_path / "c.py", rollout={"workers": 1})
    workdir = tmp_path / "run"
    proc = subprocess.Popen(cli(config, workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=ROOT, start_new_session=True)
    _wait_for_log(workdir, "held-out accuracy before RL", proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "SIGINT" in last_line(err)
    for noise in ("Segmentation fault", "Fatal Python error", "KeyboardInterrupt", "Traceback", "WorkerError"):
        assert noise not in err
    assert "stopped: preempted" in stop_lines(workdir)[-1]
    assert [p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()] == ["1"]


def test_a_stop_request_during_sft_stops_it_at_the_next_sft_step(tmp_path, tiny_config, monkeypatch):
    real = train_mod.supervised_warm_start

    def preempted_at_start(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the run's handler records it; the SFT loop honours it
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "supervised_warm_start", preempted_at_start)
    with pytest.raises(RunPreempted, match=r"SIGTERM before any checkpoint during the SFT warm start \(at SFT step 1"):
        train_and_evaluate(tiny_config(sft={"steps": 100_000}), tmp_path)
    assert "stopped: preempted" in stop_lines(tmp_path)[-1]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handlers are gone with it


# ---------------------------------------------------------------- resume rules


@pytest.fixture(scope="session")
def finished_run(finish_tiny_run):
    """A finished 4-step run with checkpoints at 2 and 4."""
    return finish_tiny_run("finished", steps=4, checkpoint_every=2)


def copy_run(finished_run, tmp_path):
    workdir, config = finished_run
    shutil.copytree(workdir, tmp_path / "run")
    return tmp_path / "run", json.loads(json.dumps(config))


def test_rerunning_a_finished_run_does_nothing(finished_run, tmp_path):
    workdir, config = copy_run(finished_run, tmp_path)
    before = {p: p.read_bytes() for p in (workdir / "metrics.jsonl", workdir / "summary.json")}
    summary = train_and_evaluate(config, workdir)
    assert summary == json.loads(before[workdir / "summary.json"])
    assert {p: p.read_bytes() for p in before} == before  # no second evaluation line, no new run time
    assert "already finished 4 steps" in stop_lines(workdir)[-1] and "pass another --workdir" in stop_lines(workdir)[-1]
    assert "held-out accuracy after RL" in (workdir / "log.txt").read_text().splitlines()[-2]  # the result, again


def test_fewer_steps_than_the_checkpoint_is_a_clear_error(finished_run, tmp_path):
    workdir, config = copy_run(finished_run, tmp_path)
    config["train"]["steps"] = 3
    with pytest.raises(ValueError, match=r"config\.train\.steps = 3 is below .*checkpoints/4"):
        train_and_evaluate(config, workdir)


@pytest.mark.parametrize(("section", "field", "value"), [("optimizer", "rank", 2), ("optimizer", "base_seed", 7),
                                                         ("optimizer", "rank_rules", "q_proj=2"),
                                                         ("model", "init_seed", 3), ("task", "train_size", 32)])
def test_resume_refuses_a_config_that_changes_what_the_checkpoint_means(finished_run, tmp_path, section, field,
                                                                         value):
    workdir, config = copy_run(finished_run, tmp_path)
    config["train"]["steps"] = 6
    old = json.loads((workdir / "config.json").read_text())[section][field]
    config[section][field] = value
    with pytest.raises(ValueError, match=rf"cannot resume .*{section}\.{field}: {old!r} in the checkpointed run, "
                                         rf"{value!r} now"):
        train_and_evaluate(config, workdir)
    assert json.loads((workdir / "config.json").read_text())[section][field] == old  # not overwritten


def test_resume_with_harmless_changes_continues_logs_them_and_keeps_history(finished_run, tmp_path, read_metrics):
    workdir, config = copy_run(finished_run, tmp_path)
    config["train"].update(steps=6, eval_every=3)
    config["optimizer"]["update_ratio"] = 5e-3
    summary = train_and_evaluate(config, workdir)
    assert summary["steps"] == 6
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r] == list(range(1, 7))
    log = (workdir / "log.txt").read_text()
    assert "resuming with a changed config" in log and "optimizer.update_ratio 0.01 → 0.005" in log
    assert "train.steps 4 → 6" in log
    history = [json.loads(line) for line in (workdir / "config_history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and history[0]["config"]["train"]["steps"] == 4 and history[0]["start_step"] == 0
    assert history[1]["start_step"] == 4 and history[1]["changes"]["train.steps"] == [4, 6]
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 6


def test_fixed_fields_cover_the_sections_and_fields_named():
    assert {"model", "task", "optimizer.rank", "optimizer.base_seed", "optimizer.name"} <= set(RESUME_FIXED)
    assert is_fixed("model.preset") and is_fixed("optimizer.rank") and not is_fixed("optimizer.learning_rate")
    assert config_changes({"a": {"x": 1, "y": {"k": 1}}}, {"a": {"x": 1, "y": {"k": 2}, "z": 0}}) == {
        "a.y": ({"k": 1}, {"k": 2}), "a.z": (None, 0)}


def _corrupt(step_dir: Path) -> None:
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "d" in f.parent.name:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def test_corrupted_newest_checkpoint_names_it_and_the_way_out(finished_run, tmp_path):
    workdir, config = copy_run(finished_run, tmp_path)
    config["train"]["steps"] = 6
    _corrupt(workdir / "checkpoints" / "4")
    with pytest.raises(CheckpointError, match=r"checkpoints/4.*resume_step to one of \[2\]"):
        train_and_evaluate(config, workdir)
    assert "stopped: error: CheckpointError" in stop_lines(workdir)[-1]


def test_resume_fallback_moves_the_corrupted_checkpoint_aside_and_resumes_from_older(finished_run, tmp_path,
                                                                                     read_metrics):
    workdir, config = copy_run(finished_run, tmp_path)
    config["train"].update(steps=4, resume_fallback=True)
    _corrupt(workdir / "checkpoints" / "4")
    (workdir / "summary.json").unlink()
    train_and_evaluate(config, workdir)
    log = (workdir / "log.txt").read_text()
    assert "WARNING" in log and "falling back to checkpoint 2" in log
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints_set_aside").iterdir()] == ["4"]
    assert read_metrics(workdir) == read_metrics(finished_run[0])  # the same run, redone from step 2


def test_resume_step_picks_an_older_checkpoint_and_keeps_the_newer(finished_run, tmp_path, read_metrics):
    workdir, config = copy_run(finished_run, tmp_path)
    config["train"].update(steps=4, resume_step=2)
    (workdir / "summary.json").unlink()
    train_and_evaluate(config, workdir)
    assert "resumed from checkpoint step 2" in (workdir / "log.txt").read_text()
    assert len(list((workdir / "checkpoints_set_aside").iterdir())) == 1
    assert read_metrics(workdir) == read_metrics(finished_run[0])
    config["train"]["resume_step"] = 3
    with pytest.raises(ValueError, match=r"config\.train\.resume_step = 3: no checkpoint"):
        train_and_evaluate({**config, "train": {**config["train"], "steps": 8}}, workdir)


# ---------------------------------------------------------------- validate before spending time


def test_a_mesh_larger_than_the_devices_fails_before_any_work(tmp_path, tiny_config):
    config = tiny_config(train={"mesh_fsdp": 2 * jax.device_count()}, sft={"steps": 100_000})
    with pytest.raises(ValueError, match=rf"config\.train\.mesh_data × mesh_fsdp × mesh_tensor = 1 × "
                                         rf"{2 * jax.device_count()} × 1"):
        train_and_evaluate(config, tmp_path)


def test_a_rank_wider_than_a_layer_fails_before_sft_naming_the_layer(tmp_path, tiny_config):
    config = tiny_config(optimizer={"rank": 10_000}, sft={"steps": 100_000})
    with pytest.raises(ValueError, match=r"config\.optimizer\.rank = 10000: .*(q_proj|k_proj|v_proj|o_proj|"
                                         r"gate_proj|up_proj|down_proj)"):
        train_and_evaluate(config, tmp_path)
    assert "SFT warm start" not in (tmp_path / "log.txt").read_text()
