"""logra_jax.job.metrics: JSONL + TensorBoard records, resume truncation, the non-finite guard, progress, memory,
plots."""

import gc
import io
import json
import re
import resource
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.job.metrics import (
    Logger,
    MetricsWriter,
    NonFiniteMetricError,
    Progress,
    _import_tensorboardx,
    _proc_status_bytes,
    check_finite,
    describe_device_balance,
    live_bytes_per_device,
    memory_stats,
    plot_curves,
    read_metrics,
)


def read_events(logdir):
    """Every Event of every event file under `logdir`: TFRecord framing (length, masked CRC-32C, data, CRC)."""
    _import_tensorboardx()  # tensorboardX without the torch its __init__ imports (not at collection: CI time)
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            header = data[offset:offset + 8]
            (length,) = struct.unpack("<Q", header)
            (header_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
            assert header_crc == masked_crc32c(header)
            payload = data[offset + 12:offset + 12 + length]
            (payload_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
            assert payload_crc == masked_crc32c(payload)
            event = event_pb2.Event()
            event.ParseFromString(payload)
            events.append(event)
            offset += 16 + length
    return events


def scalars(events):
    return [(e.step, v.tag, v.simple_value) for e in events if e.HasField("summary") for v in e.summary.value]


def test_write_converts_every_scalar_kind_exactly(tmp_path):
    metrics = {"py_float": 0.1, "py_int": 3, "flag": True, "np32": np.float32(0.1), "jax32": jnp.float32(0.3),
               "jax_int": jnp.int32(-4), "one_elem": np.array([[2.5]]), "bf16": jnp.bfloat16(1.5)}
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(7, metrics)
    [record] = read_metrics(tmp_path / "metrics.jsonl")
    assert record == {"step": 7, "py_float": 0.1, "py_int": 3, "flag": 1, "np32": float(np.float32(0.1)),
                      "jax32": float(np.float32(0.3)), "jax_int": -4, "one_elem": 2.5, "bf16": 1.5}
    assert isinstance(record["py_int"], int) and isinstance(record["jax_int"], int)


def test_write_rejects_bad_metrics(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="'loss' must be a scalar, got shape \\(3,\\)"):
        writer.write(1, {"loss": np.ones(3)})
    with pytest.raises(TypeError, match="'name' must be a real number"):
        writer.write(1, {"name": "abc"})
    with pytest.raises(ValueError, match="'step' is reserved"):
        writer.write(1, {"step": 2})
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        writer.write(-1, {"loss": 1.0})
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write(1, {"loss": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_truncate_after_gives_the_uninterrupted_file(tmp_path):
    """Killed after step 5 (mid-write of step 6), resumed from the step-4 checkpoint: same file as one run."""
    records = [(s, {"loss": 1.0 / s, "reward": 0.1 * s}) for s in range(1, 9)]
    with MetricsWriter(tmp_path / "straight", tensorboard=False) as writer:
        for step, m in records:
            writer.write(step, m)
    killed = MetricsWriter(tmp_path / "resumed", tensorboard=False)
    for step, m in records[:5]:
        killed.write(step, m)
    killed.close()
    with (tmp_path / "resumed" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "loss": 0.16')
    with MetricsWriter(tmp_path / "resumed", tensorboard=False) as writer:
        writer.truncate_after(4)
        assert [r["step"] for r in read_metrics(writer.path)] == [1, 2, 3, 4]
        for step, m in records[4:]:
            writer.write(step, m)
    straight = (tmp_path / "straight" / "metrics.jsonl").read_text()
    assert (tmp_path / "resumed" / "metrics.jsonl").read_text() == straight
    assert [json.loads(line)["step"] for line in straight.splitlines()] == list(range(1, 9))


def test_fresh_start_in_a_used_workdir(tmp_path):
    """Killed mid-write before any checkpoint: a new writer continues on a fresh line; -1 drops every record."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(2, {"loss": 1.0})
        assert read_metrics(writer.path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]
        writer.truncate_after(-1)
        writer.write(0, {"loss": 3.0})
        with pytest.raises(ValueError, match=">= -1"):
            writer.truncate_after(-2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "loss": 3.0}\n'


def test_read_metrics_reports_bad_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: not a JSON line"):
        read_metrics(path)
    path.write_text('{"step": 1}\n{"a": 1}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: a metrics record needs an integer 'step'"):
        read_metrics(path)
    path.write_text('{"step": 1, "a": NaN}\n\n{"step": 2, "a": Infinity}\n')
    got = read_metrics(path)
    assert np.isnan(got[0]["a"]) and got[1] == {"step": 2, "a": float("inf")}


def test_tensorboard_events_and_purge_on_resume(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": 0.5 * step, "reward": np.float32(0.25)})
        writer.truncate_after(1)
        writer.write(2, {"loss": 9.0})
    events = read_events(tmp_path / "tensorboard")
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert scalars(events) == [(1, "loss", 0.5), (1, "reward", 0.25), (2, "loss", 1.0), (2, "reward", 0.25),
                               (3, "loss", 1.5), (3, "reward", 0.25), (2, "loss", 9.0)]
    # TensorBoard drops earlier events at step >= 2 when it meets a SessionLog START at step 2.
    starts = [e.step for e in events if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert starts == [2]


def test_check_finite_names_step_and_metrics():
    check_finite(1, {"loss": 0.5, "count": 3, "grads": np.ones(4), "name": "ok", "half": jnp.bfloat16(2.0)})
    check_finite(1, {"loss": 0.5, "kl": float("nan")}, keys=("loss", "reward"))
    with pytest.raises(NonFiniteMetricError, match=r"at step 12: kl=nan, reward=-inf") as info:
        check_finite(12, {"loss": 1.0, "kl": jnp.bfloat16(np.nan), "reward": -np.inf, "other": np.inf},
                     keys=("loss", "kl", "reward", "absent"))
    assert isinstance(info.value, ValueError)
    assert info.value.step == 12 and set(info.value.metrics) == {"kl", "reward"}
    with pytest.raises(NonFiniteMetricError, match=r"grads=2 of 5 elements non-finite"):
        check_finite(3, {"grads": np.array([1.0, np.inf, 2.0, np.nan, 0.0])})


class FakeClock:
    def __init__(self, seconds_per_call):
        self.now, self.step = 0.0, seconds_per_call

    def __call__(self):
        value = self.now
        self.now += self.step
        return value


def test_progress_status_lines_without_a_terminal():
    out = io.StringIO()
    progress = Progress(100, initial=10, desc="RL", every_steps=30, every_s=1e9, stream=out, tty=False,
                        clock=FakeClock(0.4))
    for step in range(11, 101):
        progress.update(step, {"reward_mean": 0.41, "kl_realised": 1.2e-4, "loss": 3.0})
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["RL step 11/100", "RL step 41/100", "RL step 71/100",
                                                        "RL step 100/100"]
    # The clock advances 0.4 s per call (one per update): 0.4 s/step, ETA = 0.4 s × remaining steps.
    assert lines[0] == "RL step 11/100 | reward 0.41 | kl 1.2e-04 | 0.4 s/step | ETA 36s"
    assert lines[1].endswith("| 0.4 s/step | ETA 24s")
    assert lines[-1].endswith("| ETA 0s")


def test_progress_time_period_and_eta_format():
    out = io.StringIO()
    progress = Progress(10_000, every_steps=10_000, every_s=60.0, stream=out, tty=False, clock=FakeClock(25.0),
                        fields={"loss": "loss"})
    for step in range(1, 6):
        progress.update(step, {"loss": 12345.0})
    lines = out.getvalue().splitlines()
    # Printed at step 1 (first) and when 60 s have passed since the last line: steps 4 (75 s after step 1).
    assert [line.split(" | ")[0] for line in lines] == ["train step 1/10000", "train step 4/10000"]
    assert lines[0] == "train step 1/10000 | loss 1.2e+04 | 25 s/step | ETA 69h26m"  # 25 s × 9999


def test_progress_bar_on_a_terminal_shows_the_fields():
    out = io.StringIO()
    progress = Progress(4, initial=1, desc="RL", stream=out, tty=True)
    progress.update(2, {"reward_mean": 0.5})
    progress.update(3, {"reward_mean": 0.41, "kl_realised": 1.2e-4})
    progress.close()  # tqdm may skip redraws within 0.1 s; closing draws the final state
    final = out.getvalue().rstrip("\n").split("\r")[-1]
    assert final.startswith("RL:  75%") and "3/4" in final and final.endswith("reward 0.41 | kl 1.2e-04]")


def test_logger_writes_stream_and_file(tmp_path):
    out = io.StringIO()
    log = Logger(tmp_path, stream=out)
    log("first")
    log("second")
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == ["first", "second"]
    assert out.getvalue().splitlines() == lines


def test_proc_status_parsing(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1000 kB\nThreads:\t4\n")
    assert _proc_status_bytes(str(status)) == {"host_peak_rss_bytes": 2048 * 1024, "host_rss_bytes": 1000 * 1024}
    assert _proc_status_bytes(str(tmp_path / "absent")) == {}


def test_memory_stats_follow_allocations_and_getrusage():
    before = memory_stats()
    block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
    during = memory_stats()
    assert during["host_rss_bytes"] - before["host_rss_bytes"] >= 60 * 2**20
    assert during["host_peak_rss_bytes"] >= during["host_rss_bytes"]
    # getrusage's ru_maxrss (KiB on Linux) is the kernel's other view of the peak; its per-thread counters are
    # folded in lazily, so the two agree up to a few pages.
    assert abs(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - during["host_peak_rss_bytes"]) < 8 * 2**20
    del block


def test_memory_stats_devices():
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    got = memory_stats([Device({"bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 100}),
                        Device({"bytes_in_use": 7, "peak_bytes_in_use": 8, "bytes_limit": 100}), Device(None)])
    assert {k: v for k, v in got.items() if k.startswith("device")} == {
        "device_bytes_in_use": 7, "device_peak_bytes_in_use": 9, "device_bytes_limit": 100}
    assert not any(k.startswith("device") for k in memory_stats([Device(None)]))


def test_plot_curves_plots_the_recorded_values(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(0, {"eval_accuracy": 0.1})
        for step in range(1, 6):
            writer.write(step, {"reward_mean": 0.1 * step, "accuracy": 1.0 / step})
        writer.write(5, {"eval_accuracy": 0.4})
    out = tmp_path / "plots" / "reward.png"
    fig = plot_curves(tmp_path / "metrics.jsonl", ["reward_mean", "eval_accuracy"], out, title="demo")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reward, accuracy = (ax.lines[0].get_xydata().tolist() for ax in fig.axes)
    assert reward == [[s, 0.1 * s] for s in range(1, 6)]
    assert accuracy == [[0, 0.1], [5, 0.4]]
    assert fig.get_suptitle() == "demo"
    with pytest.raises(ValueError, match=r"holds 'kl' \(available: \['accuracy', 'eval_accuracy', 'reward_mean'\]"):
        plot_curves(tmp_path / "metrics.jsonl", ["kl"], out)


def test_live_bytes_count_each_device_buffer_once():
    """A sharded array's shards made into arrays (`shard.data`, which JAX keeps alive beside it) hold its own
    buffers: each device counts its 1/8 once, and the arrays whole count the array once."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    whole = lambda: float(re.search(r"([\d.]+) MiB whole\)", describe_device_balance("a test"))[1])
    gc.collect()
    before, whole_before = live_bytes_per_device(), whole()
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    x = jax.device_put(jnp.ones((64, 1024), jnp.float32), rows)
    views = [shard.data for shard in x.addressable_shards]
    after = live_bytes_per_device()
    assert {d: after[d] - before[d] for d in after} == dict.fromkeys(jax.local_devices(), 64 * 1024 * 4 // 8)
    assert whole() - whole_before == pytest.approx(0.25, abs=0.011)  # MiB, as the line rounds them
    del views
