"""What a run reports: metrics to JSONL and TensorBoard, a non-finite guard, progress, logs, memory, plots.

  writer = MetricsWriter(workdir)                 # workdir/metrics.jsonl + workdir/tensorboard/
  writer.truncate_after(resumed_step)             # on resume: the file continues as the uninterrupted run's
  check_finite(step, metrics, ("loss", "kl"))     # NonFiniteMetricError naming the step and the metric
  writer.write(step, metrics)
  progress.update(step, metrics)                  # tqdm on a terminal, one status line now and then elsewhere

A JSONL record is {"step": n, name: value, ...} on one line; a record is complete once its newline is written,
so a line cut short by a killed process is ignored by `read_metrics` and dropped, with a one-line notice naming
the file, when a MetricsWriter opens it again.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

JSONL_NAME = "metrics.jsonl"
_log = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"


class NonFiniteMetricError(ValueError):
    """A guarded metric is NaN or ±inf; `step` and `metrics` (name → offending value) say where and which."""

    def __init__(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.step = step
        self.metrics = dict(metrics)
        listed = ", ".join(f"{name}={value}" for name, value in self.metrics.items())
        super().__init__(f"non-finite metric at step {step}: {listed}")


def _numeric(value: Any) -> np.ndarray | None:
    """`value` as a numpy array with real floats widened to float64 (so bfloat16 and friends work), or None."""
    array = np.asarray(value)
    if jnp.issubdtype(array.dtype, jnp.floating):
        return array.astype(np.float64)
    if jnp.issubdtype(array.dtype, jnp.number) or array.dtype == np.bool_:
        return array
    return None


def _scalar(name: str, value: Any) -> int | float:
    """A Python number from a Python/numpy/jax scalar or size-1 array (bools become 0/1)."""
    if isinstance(value, (bool, int, float)):
        return int(value) if isinstance(value, bool) else value
    array = _numeric(value)
    if array is None or jnp.issubdtype(array.dtype, jnp.complexfloating):
        raise TypeError(f"metric {name!r} must be a real number, got {type(value).__name__} of dtype "
                        f"{np.asarray(value).dtype}")
    if array.size != 1:
        raise ValueError(f"metric {name!r} must be a scalar, got shape {array.shape}")
    item = array.reshape(()).item()
    return int(item) if isinstance(item, bool) else item


def _check_step(step: Any, where: str, low: int = 0) -> int:
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < low:
        raise ValueError(f"{where}: step must be an integer >= {low}, got {step!r}")
    return int(step)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in file order (an unterminated last line is an unfinished write).

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: a complete line that is not a JSON object with an integer "step" (names the file and line).

    Example:
      >>> import tempfile, pathlib
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
      >>> _ = path.write_text('{"step": 1, "loss": 0.5}\\n{"step": 2, "lo')
      >>> read_metrics(path)
      [{'step': 1, 'loss': 0.5}]
    """
    path = Path(path)
    records = []
    lines = path.read_text().split("\n")
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1] is "" or an unfinished write
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{number}: a metrics record needs an integer 'step', got {line[:80]!r}")
        records.append(record)
    return records


def _drop_unfinished_line(path: Path) -> str | None:
    """Cut a killed writer's unterminated last line, so that the next record starts on a line of its own; returns
    the one-line notice saying what was cut (None: nothing was)."""
    if not path.exists():
        return None
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return None
    keep = data.rfind(b"\n") + 1
    os.truncate(path, keep)
    cut = data[keep:].decode(errors="replace")
    return (f"{path}: dropped its unfinished last line ({len(data) - keep} bytes, from a run stopped while writing "
            f"it): {cut[:60]!r}{' ...' if len(cut) > 60 else ''}")


class NullWriter:
    """What the non-primary processes of a multi-process run write metrics with: nothing (MetricsWriter's calls)."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        del step, metrics

    def truncate_after(self, step: int) -> None:
        del step

    def close(self) -> None:
        pass


def _import_tensorboardx() -> Any:
    """tensorboardX, imported on first use (it pulls in protobuf), without the torch it imports when installed.

    tensorboardX's writer imports torch only to recognise torch tensors, which this module never passes (it
    writes Python floats); where torch is installed (the dev requirements) that import costs every job process
    seconds. A process that has already imported torch keeps it.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


class MetricsWriter:
    """Appends {"step": n, **metrics} lines to workdir/metrics.jsonl and scalars to TensorBoard event files.

    Each `write` is flushed to the JSONL file at once (a killed run loses at most the line being written).
    TensorBoard events go through tensorboardX (no TensorFlow) to workdir/tensorboard/.

    Args:
      workdir: the run directory (created).
      tensorboard: also write TensorBoard event files.
      flush_secs: how often tensorboardX flushes its event file.
      log: where the one-line notices go when an unfinished last line is dropped or a stopped rewrite's
        temporary copy removed (None: the `logging` logger of this module, at WARNING).

    Example:
      >>> import tempfile
      >>> workdir = tempfile.mkdtemp()
      >>> with MetricsWriter(workdir, tensorboard=False) as writer:
      ...     writer.write(1, {"loss": 0.5}); writer.write(2, {"loss": 0.25})
      ...     writer.truncate_after(1)
      >>> read_metrics(f"{workdir}/metrics.jsonl")
      [{'step': 1, 'loss': 0.5}]
    """

    def __init__(self, workdir: str | Path, *, tensorboard: bool = True, flush_secs: int = 30,
                 log: Callable[[str], None] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / JSONL_NAME
        self.tensorboard = tensorboard
        self._flush_secs = flush_secs
        self._tmp = self.path.with_name(self.path.name + ".tmp")  # truncate_after's copy before its rename
        say = log if log is not None else _log.warning
        if self._tmp.exists():
            self._tmp.unlink()
            say(f"removed {self._tmp}, the copy of {JSONL_NAME} a resume was rewriting when it stopped")
        notice = _drop_unfinished_line(self.path)
        if notice is not None:
            say(notice)
        self._file: TextIO | None = self.path.open("a")
        self._tb: Any = None
        self._purge_step: int | None = None
        self._opened = 0

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_file(self) -> TextIO:
        if self._file is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        return self._file

    def _summary_writer(self) -> Any:
        if self._tb is None:
            tensorboardX = _import_tensorboardx()
            # Event files are named by the second they were opened in and opened with "wb": a suffix unique to
            # this writer keeps a reopened writer (after truncate_after) from overwriting the previous file.
            self._opened += 1
            self._tb = tensorboardX.SummaryWriter(str(self.workdir / TENSORBOARD_DIR), purge_step=self._purge_step,
                                                  flush_secs=self._flush_secs,
                                                  filename_suffix=f".{os.getpid()}.{self._opened}")
            self._purge_step = None
        return self._tb

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one record (values: Python/numpy/jax scalars or size-1 arrays, converted to numbers).

        Raises:
          ValueError: negative step, a metric named "step", a metric with more than one element, or a closed
            writer.
          TypeError: a non-numeric metric (names it).
          OSError: the file cannot be written (names it and the step; e.g. a full disk).
        """
        step = _check_step(step, "MetricsWriter.write")
        file = self._open_file()
        if "step" in metrics:
            raise ValueError("MetricsWriter.write: 'step' is reserved for the record's step, not a metric name")
        values = {name: _scalar(name, value) for name, value in metrics.items()}
        try:
            file.write(json.dumps({"step": step, **values}) + "\n")
            file.flush()
        except OSError as e:  # the bare OSError names no file ("[Errno 28] No space left on device")
            raise OSError(e.errno, f"appending step {step} to {self.path} failed: {e.strerror or e}") from e
        if self.tensorboard:
            tb = self._summary_writer()
            for name, value in values.items():
                tb.add_scalar(name, value, global_step=step)

    def truncate_after(self, step: int) -> None:
        """Drop the records with a step > `step`: call when resuming from checkpoint `step`.

        `step=-1` drops every record (a fresh start in a used workdir). The file is rewritten atomically
        (temporary file + rename). TensorBoard's next event file starts with a purge marker at step + 1, so
        TensorBoard hides the old run's events after `step` too.

        Raises:
          ValueError: step is not an integer ≥ -1, or the writer is closed.
        """
        step = _check_step(step, "MetricsWriter.truncate_after", low=-1)
        self._open_file().close()
        kept = [r for r in read_metrics(self.path) if r["step"] <= step]
        self._tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(self._tmp, self.path)
        self._file = self.path.open("a")
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._purge_step = step + 1

    def close(self) -> None:
        """Flush and close the JSONL and TensorBoard files (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def check_finite(step: int, metrics: Mapping[str, Any], keys: Iterable[str] | None = None) -> None:
    """Stop a run on NaN/inf: raise NonFiniteMetricError naming the step and every offending metric.

    Args:
      step: the step the metrics belong to (named in the error).
      metrics: name → scalar or array (an array offends when any element is non-finite).
      keys: the metrics to check; None checks all. Names absent from `metrics` are skipped, so one guard list
        serves runs that report different metrics. Non-numeric values are ignored.

    Raises:
      NonFiniteMetricError: some checked metric holds NaN or ±inf.

    Example:
      >>> check_finite(3, {"loss": 0.1, "kl": float("nan")}, keys=("loss", "kl", "reward"))
      Traceback (most recent call last):
      ...
      logra_jax.job.metrics.NonFiniteMetricError: non-finite metric at step 3: kl=nan
    """
    names = list(metrics) if keys is None else [k for k in keys if k in metrics]
    offending: dict[str, Any] = {}
    for name in names:
        array = _numeric(metrics[name])
        if array is None:
            continue
        finite = np.isfinite(array)
        if not finite.all():
            offending[name] = (array.item() if array.size == 1 else
                               f"{int((~finite).sum())} of {array.size} elements non-finite")
    if offending:
        raise NonFiniteMetricError(step, offending)


def _number(x: float) -> str:
    """0.41, 1.2e-04, 3.5e+04: three significant digits in plain or exponent form, whichever reads better."""
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:.3g}"
    return f"{x:.1e}"


def _duration(seconds: float) -> str:
    """45s, 1m15s, 2h03m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Progress of a run: a tqdm bar on a terminal, else a status line every `every_steps` steps or `every_s` s.

    The line reads "RL step 12/100 | reward 0.41 | kl 1.2e-04 | 0.85 s/step | ETA 1m15s"; seconds per step are
    the wall-clock mean since this Progress started, and the ETA is that mean times the remaining steps.

    Args:
      total: the last step.
      initial: the step the run starts from (a resumed run's checkpoint step).
      desc: a label in front of the bar or line.
      fields: label → metric name of the metrics shown (absent ones are left out).
      every_steps: status-line period in steps (None: total / 20, at least 1).
      every_s: status-line period in seconds.
      stream: where to write (default sys.stderr).
      tty: draw a tqdm bar (True) or status lines (False); None asks `stream.isatty()`.
      clock: the time source (seconds).

    Example:
      >>> import io
      >>> out, now = io.StringIO(), iter([0.0, 2.0])
      >>> progress = Progress(4, desc="RL", stream=out, tty=False, clock=lambda: next(now))
      >>> progress.update(1, {"reward_mean": 0.41, "kl_realised": 1.2e-4})
      >>> out.getvalue()
      'RL step 1/4 | reward 0.41 | kl 1.2e-04 | 2 s/step | ETA 6s\\n'
    """

    def __init__(self, total: int, *, initial: int = 0, desc: str = "train",
                 fields: Mapping[str, str] | None = None, every_steps: int | None = None, every_s: float = 60.0,
                 stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"Progress: total must be a non-negative integer, got {total!r}")
        if not isinstance(initial, int) or not 0 <= initial <= total:
            raise ValueError(f"Progress: initial must be an integer in [0, total={total}], got {initial!r}")
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"Progress: every_steps must be a positive integer or None, got {every_steps!r}")
        self.total, self.initial, self.desc = total, initial, desc
        self.fields = dict(fields) if fields is not None else {"reward": "reward_mean", "kl": "kl_realised"}
        self.every_steps = every_steps or max(1, total // 20)
        self.every_s = every_s
        self.stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._start = clock()
        self._last: tuple[int, float] | None = None
        use_tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = (tqdm.tqdm(total=total, initial=initial, desc=desc, file=self.stream, dynamic_ncols=True,
                               unit="step") if use_tty else None)

    def _shown(self, metrics: Mapping[str, Any]) -> list[str]:
        return [f"{label} {_number(float(np.asarray(metrics[name])))}" for label, name in self.fields.items()
                if name in metrics]

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Report that `step` is done, with its metrics (the shown fields are read from them)."""
        metrics = metrics or {}
        if self._bar is not None:
            self._bar.set_postfix_str(" | ".join(self._shown(metrics)), refresh=False)
            self._bar.update(step - self._bar.n)
            return
        now = self._clock()
        due = (self._last is None or step >= self.total or step - self._last[0] >= self.every_steps
               or now - self._last[1] >= self.every_s)
        if not due:
            return
        self._last = (step, now)
        per_step = (now - self._start) / max(step - self.initial, 1)
        parts = [f"{self.desc} step {step}/{self.total}", *self._shown(metrics), f"{_number(per_step)} s/step",
                 f"ETA {_duration(per_step * (self.total - step))}"]
        self.stream.write(" | ".join(parts) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Close the bar (no-op for status lines)."""
        if self._bar is not None:
            self._bar.close()


class Logger:
    """Timestamped run log: each message goes to `stream` (around a live tqdm bar) and to workdir/log.txt.

    Example:
      >>> import io, tempfile
      >>> out = io.StringIO()
      >>> log = Logger(tempfile.mkdtemp(), stream=out)
      >>> log("resumed from step 10")
      >>> out.getvalue().endswith(" resumed from step 10\\n")
      True
    """

    def __init__(self, workdir: str | Path, *, filename: str = "log.txt", stream: TextIO | None = None,
                 primary: bool = True, label: str = "") -> None:
        """primary: False on the other processes of a multi-process run, which write only messages logged with
        everywhere=True (errors), to `stream` alone, prefixed with `label` (e.g. "process 1")."""
        self.path = Path(workdir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stream = stream
        self.primary = primary
        self.label = label

    def __call__(self, message: str, *, everywhere: bool = False) -> None:
        """Write `message` with the local time in front (on a non-primary process only when `everywhere`).

        A log file that cannot be written (a full disk) is said on the stream instead of raising: the message
        may be the error that stops the run, which must not be replaced by the log's own.
        """
        if not (self.primary or everywhere):
            return
        label = f"[{self.label}] " if self.label else ""
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {label}{message}"
        stream = self.stream if self.stream is not None else sys.stderr
        tqdm.tqdm.write(line, file=stream)
        if self.primary:
            try:
                with self.path.open("a") as f:
                    f.write(line + "\n")
            except OSError as e:  # a full disk: the message is on the stream; the run's own error stays the one raised
                tqdm.tqdm.write(f"(not written to {self.path}: {e.strerror or e})", file=stream)


def _proc_status_bytes(path: str = "/proc/self/status") -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes (Linux); {} where /proc is absent."""
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    names = {"VmRSS": "host_rss_bytes", "VmHWM": "host_peak_rss_bytes"}
    out = {}
    for line in text.splitlines():
        field, _, rest = line.partition(":")
        if field in names:
            value, unit = rest.split()
            if unit != "kB":
                raise ValueError(f"{path}: unexpected unit {unit!r} for {field}")
            out[names[field]] = int(value) * 1024
    return out


def live_bytes_per_device() -> dict[Any, int]:
    """Bytes of every live jax.Array's shards, per local device (what a sharded job keeps where: a whole weight
    on one device shows as that device's excess). Each device buffer counts once: the arrays `shard.data` makes
    of another's shards (JAX keeps them alive beside it) share its buffers.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones(1024, jnp.float32)
      >>> live_bytes_per_device()[x.devices().pop()] >= 4096
      True
    """
    return _live_bytes()[0]


def _live_bytes() -> tuple[dict[Any, int], int]:
    """(bytes per local device, bytes of the live arrays whole), every device buffer counted once.

    Arrays spanning more devices come first, so that a single-device view of one of their shards is found to
    hold only buffers already counted and is skipped.
    """
    per = dict.fromkeys(jax.local_devices(), 0)
    seen: set[tuple[Any, int]] = set()
    whole = 0
    for array in sorted(jax.live_arrays(), key=lambda a: len(a.sharding.device_set), reverse=True):
        shards = [(shard.device, shard.data) for shard in array.addressable_shards]
        keys = [(device, data.unsafe_buffer_pointer()) for device, data in shards]
        if keys and all(key in seen for key in keys):
            continue
        whole += array.nbytes
        for key, (device, data) in zip(keys, shards):
            if key not in seen:
                seen.add(key)
                per[device] = per.get(device, 0) + data.nbytes
    return per, whole


def describe_device_balance(phase: str) -> str:
    """One line on the live arrays per local device after `phase` (the job logs it after each of its phases;
    garbage awaiting the cycle collector is collected first, so that only arrays the job holds are counted), and
    their bytes whole (what each device would hold were every array replicated: a sharded job's devices hold
    about that / the device count)."""
    gc.collect()
    per, whole = _live_bytes()
    first = jax.local_devices()[0]
    fullest = max(per, key=per.get)
    return (f"live arrays after {phase}: device {first.id} {per[first] / 2**20:.2f} MiB, fullest device "
            f"{fullest.id} {per[fullest] / 2**20:.2f} MiB, emptiest {min(per.values()) / 2**20:.2f} MiB "
            f"({len(per)} local devices; {whole / 2**20:.2f} MiB whole)")


def memory_stats(devices: Sequence[Any] | None = None) -> dict[str, int]:
    """Host RSS (now and peak) and device memory (the most loaded local device), in bytes.

    Host numbers come from /proc/self/status (VmRSS, VmHWM); device numbers from `device.memory_stats()`
    (bytes_in_use, peak_bytes_in_use, bytes_limit; max over `devices`), left out where a backend has none (CPU).

    Args:
      devices: the devices to ask (default: jax.local_devices()).

    Returns:
      A dict with host_rss_bytes, host_peak_rss_bytes and, where available, device_bytes_in_use,
      device_peak_bytes_in_use, device_bytes_limit.

    Example:
      >>> memory_stats()["host_rss_bytes"] > 0
      True
    """
    out = _proc_status_bytes()
    names = {"bytes_in_use": "device_bytes_in_use", "peak_bytes_in_use": "device_peak_bytes_in_use",
             "bytes_limit": "device_bytes_limit"}
    for device in jax.local_devices() if devices is None else devices:
        stats = device.memory_stats()
        for source, name in names.items():
            if stats and source in stats:
                out[name] = max(out.get(name, 0), int(stats[source]))
    return out


def plot_curves(jsonl_path: str | Path, keys: Sequence[str], out_png: str | Path, *,
                title: str | None = None) -> Any:
    """Plot metrics against step (one panel per key, shared step axis) from a metrics JSONL file into a PNG.

    Uses matplotlib's Agg canvas directly, so no global backend is switched (safe inside notebooks).

    Args:
      jsonl_path: a file written by MetricsWriter.
      keys: metric names; records without a key (or with a non-finite value) are skipped for that panel.
      out_png: the image to write (parent directories created).
      title: the figure title.

    Returns:
      The matplotlib Figure (its lines hold the plotted data).

    Raises:
      ValueError: no keys, or a key that no record holds (names the key and the available ones).

    Example:
      >>> import tempfile
      >>> workdir = tempfile.mkdtemp()
      >>> with MetricsWriter(workdir, tensorboard=False) as w:
      ...     w.write(1, {"reward": 0.1}); w.write(2, {"reward": 0.3})
      >>> fig = plot_curves(f"{workdir}/metrics.jsonl", ["reward"], f"{workdir}/reward.png", title="reward")
      >>> fig.axes[0].lines[0].get_ydata().tolist()
      [0.1, 0.3]
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = [keys] if isinstance(keys, str) else list(keys)
    if not keys:
        raise ValueError("plot_curves: keys is empty")
    records = read_metrics(jsonl_path)
    series = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in records
                  if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if not points:
            available = sorted({k for r in records for k in r} - {"step"})
            raise ValueError(f"plot_curves: no record of {jsonl_path} holds {key!r} (available: {available})")
        series[key] = points
    fig = Figure(figsize=(7.0, 1.0 + 2.2 * len(keys)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, points) in zip(axes, series.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="." if len(points) <= 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    return fig
