"""The Qwen2.5-1.5B RL train step on one accelerator: real peak memory and median step time per optimizer.

  python experiments/device/step_check.py --out step.json            # on the GPU (check.sh runs it)
  python experiments/device/step_check.py --out step.json --smoke    # tiny model on CPU (the tests), < 30 s

Contenders (built as the training loop builds them: `experiments.contenders.contender_sections` for the run
config's optimizer section, `build_rl_step` for the step, i.e. `build_optimizer` + `make_train_step` with the
REINFORCE + TIS objective of `logra_jax.rl.objective`), in order of need should time run short:
  logra_sketch_native_kl         sketch-native LoGRA, rank 256, with the predicted-KL probe on 2 sequences
  adamw                          AdamW on every parameter
  adamw_targets                  AdamW on exactly LoGRA's targets, the rest frozen (like for like)
  logra_sketch_native_kl_pallas  (only when named in --contenders) the first with implementation="pallas"
Model: `paper_numerics("qwen2.5-1.5b")` (bf16 compute, fp32 weights, remat per block, chunked attention), random
init on the device; one 4096-token sequence (512 prompt) of random tokens per step; log-probs in chunks of 512.
--smoke: the "tiny" preset at the same numerics (qwen2 layout, bf16, remat, chunked attention), 64 tokens, rank 8.

Each contender runs in its own process (XLA_PYTHON_CLIENT_PREALLOCATE=false, so `memory_stats()` gives that
contender's own peak) under a time limit: the step (jit with shardings, the state donated, as the loop runs it)
is compiled ahead of time from the abstract inputs first — its XLA `memory_analysis()` is recorded, and the peak
after compiling (autotuning scratch) separately — then the state is initialised on the device, one warm-up step
runs (compile + first step = the two together), then `--steps` timed steps, each ended by block_until_ready on
the state and metrics; the median is reported. The child prints its record as it goes ("PROGRESS {json}" lines,
the last one "RESULT {json}"): a contender that fails, runs out of time or is interrupted keeps what it measured,
with its error and the end of its stderr, and the others still run. The parent rewrites --out after every change
(a kill loses nothing already measured), prints one line per contender start/end and phase, then a table with
LoGRA's ratios to AdamW-all and AdamW-targets and the issue's targets (LoGRA peak ≤ 0.5 × AdamW-all's, median
step time ≤ 0.8 ×). Exit status: 0 when every contender measured a median, 1 otherwise, 128 + N on signal N
(SIGTERM from `timeout`: the running contender is stopped and recorded first).

JSON (--out): {"script", "command", "smoke", "model", "seq_len", "prompt_len", "rank", "logprob_chunk",
  "probe_responses", "steps", "timeout_s", "budget_s", "elapsed_s", "finished", "interrupted",
  "contenders": {name: {"status": "ok" | "error" | "timeout" | "interrupted" | "skipped" | "running",
     "error" (only when not ok), "stderr_tail", "wall_s", "phase", "device", "platform", "jax", "flax", "optax",
     "parameters", "param_bytes", "opt_state_bytes", "compile_s", "compiled_from" ("abstract inputs" | "arrays",
     with "abstract_compile_error" / "aot_input_mismatch" saying why), "compiled_bytes": {"argument", "output",
     "temp", "alias", "total"} | null, "peak_bytes_after_compile", "init_s", "bytes_in_use_after_init",
     "first_step_s", "compile_first_step_s", "step_s": [...], "median_step_s", "peak_bytes_in_use",
     "bytes_limit", "memory_stats_available", "loss", "loss_finite", "metrics": {...}}},
  "ratios": {"logra_peak_vs_adamw", "logra_time_vs_adamw", "logra_peak_vs_adamw_targets",
     "logra_time_vs_adamw_targets", "logra_compiled_vs_adamw", "logra_compiled_vs_adamw_targets",
     "pallas_time_vs_xla"} (null where a side is missing, e.g. peaks on CPU),
  "targets": {"logra_peak_vs_adamw": {"limit": 0.5, "value", "pass"}, "logra_time_vs_adamw": {"limit": 0.8, ...}}}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LOGRA = "logra_sketch_native_kl"
CONTENDERS = (LOGRA, "adamw", "adamw_targets")  # the default, in order of need should time run short
CHOICES = (*CONTENDERS, LOGRA + "_pallas")
PROBES = 2  # the paper's KL probe: 2 single-response sequences per device
TARGETS = {"logra_peak_vs_adamw": 0.5, "logra_time_vs_adamw": 0.8}  # issue 20, Qwen2.5-1.5B on one GPU
GIB = float(2 ** 30)
TAIL_LINES = 12


def settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"model": "tiny", "seq_len": 64, "prompt_len": 16, "rank": 8, "logprob_chunk": 16}
    return {"model": "qwen2.5-1.5b", "seq_len": 4096, "prompt_len": 512, "rank": 256, "logprob_chunk": 512}


def model_config(s: dict[str, Any]) -> Any:
    """The paper's numerics (bf16 compute, fp32 weights, full remat, chunked attention); for "tiny" the same
    numerics and Qwen2 layout (q/k/v bias) at unit-test widths, attention chunks shorter than the sequence."""
    from experiments.contenders import paper_numerics
    from logra_jax.models.config import preset

    if s["model"] == "tiny":
        return preset("tiny", architecture="qwen2", qkv_bias=True, dtype="bfloat16", remat="full",
                      attention_impl="chunked", attention_chunk=16, max_seq_len=max(s["seq_len"], 64))
    return paper_numerics(s["model"], s["seq_len"])


def random_batch(abstract: Any, vocab: int, prompt_len: int, seed: int) -> Any:
    """Host arrays for the step's batch: random tokens, every position valid, advantages ~ N(0, 1), rollout
    log-probs near a uniform policy's; the probe's KL mask covers the response positions."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)

    def make(path: Any, sds: Any) -> np.ndarray:
        name = jax.tree_util.keystr(path)
        dtype = np.dtype(sds.dtype)
        if "tokens" in name:
            return rng.integers(0, vocab, sds.shape).astype(dtype)
        if "kl_mask" in name:
            return np.broadcast_to(np.arange(sds.shape[-1]) >= prompt_len, sds.shape).astype(dtype)
        if dtype == np.bool_:
            return np.ones(sds.shape, dtype)
        if "rollout_logprobs" in name:
            return (-math.log(vocab) + 0.1 * rng.normal(size=sds.shape)).astype(dtype)
        return rng.normal(size=sds.shape).astype(dtype)

    return jax.tree_util.tree_map_with_path(make, abstract)


# ----------------------------------------------------------------------------------------------- the child


def _memory(device: Any) -> dict[str, Any]:
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    return dict(stats) if stats else {}


def _nbytes(tree: Any) -> int:
    import jax
    import numpy as np

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _compiled_bytes(compiled: Any) -> dict[str, int] | None:
    try:
        m = compiled.memory_analysis()
        if m is None:
            return None
        out = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
               "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes)}
    except Exception:  # an analysis the backend lacks is not a failure of the step
        return None
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def _scalars(metrics: Any) -> dict[str, float]:
    import jax
    import numpy as np

    out = {}
    for key, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        if value.size == 1:
            out[str(key)] = float(value.reshape(()))
    return out


def child(name: str, smoke: bool, steps: int, emit: Any) -> dict[str, Any]:
    """One contender in this process: compile, init, warm up, time. `emit(record)` after every phase."""
    import dataclasses

    import flax
    import jax
    import optax

    from experiments.contenders import contender_sections
    from logra_jax.job.train_step import step_shardings
    from logra_jax.parallel import sharding as shd
    from logra_jax.planner.memory_analysis import build_rl_step

    s = settings(smoke)
    device = jax.local_devices()[0]
    record: dict[str, Any] = {"phase": "start", "device": device.device_kind, "platform": device.platform,
                              "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}
    emit(record)
    config = model_config(s)
    section = contender_sections(s["rank"])[name.removesuffix("_pallas")]
    if name.endswith("_pallas"):
        section = dataclasses.replace(section, implementation="pallas", interpret=device.platform == "cpu")
    if section.kl_control:
        section = dataclasses.replace(section, probe_responses=PROBES)

    # the step as the loop jits it: shardings on a one-device mesh, the train state donated
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1), [device])
    init, step, abstract_batch = build_rl_step(config, section, 1, seq_len=s["seq_len"], prompt_len=s["prompt_len"],
                                               logprob_chunk=s["logprob_chunk"])
    abstract_state, abstract_rest = jax.eval_shape(init)
    state_sh, rest_sh = step_shardings(abstract_state, abstract_rest, mesh)
    batch_sh = shd.batch_shardings(abstract_batch, mesh)
    jitted = shd.jit_train_step(step, mesh, in_shardings=(state_sh, rest_sh, batch_sh),
                                out_shardings=(state_sh, shd.replicated(mesh)))
    record.update(parameters=int(sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state.params))),
                  param_bytes=_nbytes(abstract_state.params), opt_state_bytes=_nbytes(abstract_state.opt_state))

    # Compile first, from abstract inputs: the peak so far is the compiler's own (autotuning) scratch. Should that
    # fail (an API this jax lacks) or the real inputs not match what was compiled, compile from the real arrays.
    def sharded(tree: Any, shardings: Any) -> Any:
        def one(a: Any, sh: Any) -> Any:
            try:
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh, weak_type=bool(getattr(a, "weak_type",
                                                                                                   False)))
            except TypeError:
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
        return jax.tree.map(one, tree, shardings)

    def compile_from(*inputs: Any) -> Any:
        t0 = time.perf_counter()
        compiled = jitted.lower(*inputs).compile()
        record["compile_s"] = time.perf_counter() - t0
        record["compiled_bytes"] = _compiled_bytes(compiled)
        return compiled

    record["phase"] = "compile"
    emit(record)
    try:
        compiled = compile_from(sharded(abstract_state, state_sh), sharded(abstract_rest, rest_sh),
                                sharded(abstract_batch, batch_sh))
        record["compiled_from"] = "abstract inputs"
    except Exception as err:  # not fatal yet: compiled from the arrays below
        compiled = None
        record["abstract_compile_error"] = f"{type(err).__name__}: {str(err)[:500]}"
    stats = _memory(device)
    record["memory_stats_available"] = bool(stats)
    record["peak_bytes_after_compile"] = stats.get("peak_bytes_in_use")
    record["bytes_limit"] = stats.get("bytes_limit")
    record["phase"] = "init"
    emit(record)

    t0 = time.perf_counter()
    state, rest = jax.jit(init, out_shardings=(state_sh, rest_sh))()
    batch = jax.device_put(random_batch(abstract_batch, config.vocab_size, s["prompt_len"], seed=0), batch_sh)
    jax.block_until_ready((state, rest, batch))
    record["init_s"] = time.perf_counter() - t0
    record["bytes_in_use_after_init"] = _memory(device).get("bytes_in_use")
    if compiled is None:
        record["phase"] = "compile (from the arrays)"
        emit(record)
        compiled = compile_from(state, rest, batch)
        record["compiled_from"] = "arrays"
    record["phase"] = "first step"
    emit(record)

    t0 = time.perf_counter()
    try:
        state, metrics = compiled(state, rest, batch)
    except (TypeError, ValueError) as err:  # checked before running: nothing was donated yet
        record["aot_input_mismatch"] = f"{type(err).__name__}: {str(err)[:500]}"
        record["phase"] = "compile (from the arrays)"
        emit(record)
        record["abstract_compile_s"] = record["compile_s"]
        compiled = compile_from(state, rest, batch)
        record["compiled_from"] = "arrays"
        record["phase"] = "first step"
        emit(record)
        t0 = time.perf_counter()
        state, metrics = compiled(state, rest, batch)
    jax.block_until_ready((state, metrics))
    record["first_step_s"] = time.perf_counter() - t0
    record["compile_first_step_s"] = record["compile_s"] + record["first_step_s"]
    record["phase"] = "timed steps"
    emit(record)

    times: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, rest, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
        record["step_s"] = times
    record["median_step_s"] = statistics.median(times) if times else None
    record["metrics"] = _scalars(metrics)
    record["loss"] = record["metrics"].get("loss")
    record["loss_finite"] = record["loss"] is not None and math.isfinite(record["loss"])
    stats = _memory(device)
    record["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    record["bytes_limit"] = stats.get("bytes_limit", record["bytes_limit"])
    record["phase"] = "done"
    return record


def _watchdog(parent_pid: int, limit_s: float) -> None:
    """Exit when the parent is gone (killed past its own handler) or the time limit is well past: an orphaned
    contender must not keep the device busy under the next one."""
    start = time.monotonic()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid or time.monotonic() - start > limit_s + 15:
            os._exit(3)


def child_main(name: str, smoke: bool, steps: int) -> int:
    record: dict[str, Any] = {}

    def emit(r: dict[str, Any], tag: str = "PROGRESS") -> None:
        snapshot = dict(r)
        record.clear()
        record.update(snapshot)
        print(f"{tag} {json.dumps(snapshot, default=str)}", flush=True)

    try:
        emit(child(name, smoke, steps, emit), "RESULT")
        return 0
    except BaseException as err:  # report what was measured, then fail
        try:  # the device's peak at the failure (an out-of-memory shows here)
            import jax

            record["peak_bytes_in_use"] = _memory(jax.local_devices()[0]).get("peak_bytes_in_use")
        except Exception:
            pass
        record["error"] = f"{record.get('phase', '?')}: {type(err).__name__}: {str(err)[:2000]}"
        emit(record)
        traceback.print_exc()
        return 1


# ---------------------------------------------------------------------------------------------- the parent


class Interrupted(BaseException):
    """The parent got SIGTERM/SIGINT/SIGHUP: stop the running contender, write what there is, exit 128 + N."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum
        self.record: dict[str, Any] | None = None


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _on_signal(signum: int, _frame: Any) -> None:
    for sig in _SIGNALS:  # once: finishing the report is not to be cut short by a second signal
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def _write(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        tag, _, body = line.partition(" ")
        if tag in ("PROGRESS", "RESULT"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(body))
    return out


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, SIGKILL after 5 s; wait for it (its device memory is freed)."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)


def _phase_line(r: dict[str, Any]) -> str:
    done = {"init": ("compiled", "compile_s"), "first step": ("initialised", "init_s"),
            "timed steps": ("first step", "first_step_s")}.get(r.get("phase"))
    if done and isinstance(r.get(done[1]), int | float):
        return f"{r['phase']} ({done[0]} in {r[done[1]]:.1f} s)"
    return str(r.get("phase"))


def _collect(proc: subprocess.Popen, out_path: Path, err_path: Path, status: str, error: str | None,
             start: float) -> dict[str, Any]:
    """The contender's record: the child's last report, its status, error and the end of its stderr."""
    records = _records(out_path)
    record = dict(records[-1]) if records else {}
    stderr = err_path.read_text(errors="replace").strip().splitlines()
    if error is None and (proc.returncode != 0 or record.get("median_step_s") is None):
        error = record.get("error") or f"exit {proc.returncode} without a result"
    elif error is not None:
        error += f" ({record['error']})" if record.get("error") else f" (in phase {record.get('phase', 'start-up')})"
    record["status"] = "ok" if error is None else status
    if error is not None:
        record["error"] = error + (" | " + " | ".join(stderr[-4:]) if stderr else "")
    record["stderr_tail"] = "\n".join(stderr[-TAIL_LINES:])
    record["exit_code"] = proc.returncode
    record["wall_s"] = time.perf_counter() - start
    return record


def run_contender(name: str, args: argparse.Namespace, limit: float, say: Any) -> dict[str, Any]:
    """Run one contender's child under `limit` seconds; its record, with status and any error.

    Raises:
      Interrupted: a signal came; the child is stopped and the exception carries its record.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--steps", str(args.steps),
           "--parent-pid", str(os.getpid()), "--timeout", str(limit)] + (["--smoke"] if args.smoke else [])
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="step_check_") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True)
        status, error = "error", None
        try:
            seen = 0
            while proc.poll() is None:
                if time.perf_counter() - start > limit:
                    _stop(proc)
                    status, error = "timeout", f"timed out after {limit:.0f} s"
                    break
                time.sleep(0.2)
                records = _records(out_path)
                for r in records[seen:]:
                    if r.get("phase") not in (None, "start", "done") and "error" not in r:
                        say(f"{name}: {_phase_line(r)}")
                seen = len(records)
        except Interrupted as sig:
            _stop(proc)
            sig.record = _collect(proc, out_path, err_path, "interrupted", f"interrupted by signal {sig.signum}",
                                  start)
            raise
        finally:
            _stop(proc)
        return _collect(proc, out_path, err_path, status, error, start)


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and a > 0 and b > 0 else None


def ratios_and_targets(contenders: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    logra = contenders.get(LOGRA, {})
    compiled = {n: (c.get("compiled_bytes") or {}).get("total") for n, c in contenders.items()}
    ratios: dict[str, Any] = {}
    for base, suffix in (("adamw", ""), ("adamw_targets", "_targets")):
        other = contenders.get(base, {})
        ratios[f"logra_peak_vs_adamw{suffix}"] = _ratio(logra.get("peak_bytes_in_use"),
                                                       other.get("peak_bytes_in_use"))
        ratios[f"logra_time_vs_adamw{suffix}"] = _ratio(logra.get("median_step_s"), other.get("median_step_s"))
        ratios[f"logra_compiled_vs_adamw{suffix}"] = _ratio(compiled.get(LOGRA), compiled.get(base))
    ratios["pallas_time_vs_xla"] = _ratio(contenders.get(LOGRA + "_pallas", {}).get("median_step_s"),
                                          logra.get("median_step_s"))
    targets = {key: {"limit": limit, "value": ratios[key], "pass": None if ratios[key] is None else
                     ratios[key] <= limit} for key, limit in TARGETS.items()}
    return ratios, targets


def _fmt(value: Any, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if not isinstance(value, int | float) else format(value * scale, spec)


def table(report: dict[str, Any]) -> str:
    c = report["contenders"]
    first = next((r for r in c.values() if r.get("device")), {})
    lines = [f"train step {report['model']}: {report['seq_len']} tokens ({report['prompt_len']} prompt), rank "
             f"{report['rank']}, {first.get('device', '?')} ({first.get('platform', '?')}), jax "
             f"{first.get('jax', '?')}",
             f"{'contender':<30} {'status':<11} {'compile+1st s':>13} {'median ms':>10} {'peak GiB':>9} "
             f"{'compiled GiB':>12}"]
    for name, r in c.items():
        lines.append(f"{name:<30} {r.get('status', '?'):<11} {_fmt(r.get('compile_first_step_s'), 1, '.1f'):>13} "
                     f"{_fmt(r.get('median_step_s'), 1e3, '.1f'):>10} "
                     f"{_fmt(r.get('peak_bytes_in_use'), 1 / GIB):>9} "
                     f"{_fmt((r.get('compiled_bytes') or {}).get('total'), 1 / GIB):>12}"
                     + (f"  {r['error'][:160]}" if r.get("error") else ""))
    ratios = report["ratios"]
    for base, suffix in (("adamw", ""), ("adamw_targets", "_targets")):
        line = (f"LoGRA / {base:<14} peak {_fmt(ratios[f'logra_peak_vs_adamw{suffix}'], 1, '.3f')}, "
                f"median step time {_fmt(ratios[f'logra_time_vs_adamw{suffix}'], 1, '.3f')}, "
                f"compiled bytes {_fmt(ratios[f'logra_compiled_vs_adamw{suffix}'], 1, '.3f')}")
        lines.append(line)
    if ratios.get("pallas_time_vs_xla") is not None:
        lines.append(f"LoGRA step time, Pallas kernels / XLA: {ratios['pallas_time_vs_xla']:.3f}")
    for key, t in report["targets"].items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a (not measured)"}[t["pass"]]
        lines.append(f"target {key.replace('_', ' ')} <= {t['limit']}: {_fmt(t['value'], 1, '.3f')} {verdict}")
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    s = settings(args.smoke)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"script": "step_check", "command": " ".join(sys.argv), "smoke": args.smoke, **s,
                              "probe_responses": PROBES, "steps": args.steps, "timeout_s": args.timeout,
                              "budget_s": args.budget_s if math.isfinite(args.budget_s) else None,
                              "contenders": {}, "finished": False, "interrupted": None}
    began = time.perf_counter()

    def say(text: str) -> None:
        print(f"[step_check {time.perf_counter() - began:5.0f}s] {text}", flush=True)

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - began
        report["ratios"], report["targets"] = ratios_and_targets(report["contenders"])
        _write(out, report)

    for sig in _SIGNALS:
        signal.signal(sig, _on_signal)
    code = 0
    try:
        for name in args.contenders:
            left = args.budget_s - (time.perf_counter() - began)
            limit = min(args.timeout, left)
            if left < min(args.timeout, 5 if args.smoke else 20):  # too little left to start a process
                report["contenders"][name] = {"status": "skipped", "error": f"skipped: the budget of "
                                              f"{args.budget_s:.0f} s was spent"}
                say(f"{name}: skipped (budget spent)")
                save()
                continue
            report["contenders"][name] = {"status": "running", "phase": "start-up"}
            save()
            say(f"{name}: start (limit {limit:.0f} s)")
            try:
                r = report["contenders"][name] = run_contender(name, args, limit, say)
            except Interrupted as sig:
                report["contenders"][name] = sig.record or {"status": "interrupted", "error": str(sig)}
                raise
            say(f"{name}: {r['status']} after {r['wall_s']:.0f} s; compile+first step "
                f"{_fmt(r.get('compile_first_step_s'), 1, '.1f')} s; median step "
                f"{_fmt(r.get('median_step_s'), 1e3, '.1f')} ms; peak {_fmt(r.get('peak_bytes_in_use'), 1 / GIB)} "
                f"GiB" + (f"; ERROR {r['error'][:300]}" if r.get("error") else ""))
            save()
        report["finished"] = True
    except Interrupted as sig:
        report["interrupted"] = f"signal {sig.signum}"
        code = 128 + sig.signum
        say(f"interrupted by signal {sig.signum}: writing what was measured")
    for sig in _SIGNALS:  # writing the report is not to be cut short
        signal.signal(sig, signal.SIG_IGN)
    save()
    print(table(report), flush=True)
    if code == 0 and any(r.get("median_step_s") is None for r in report["contenders"].values()):
        code = 1
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="step.json", help="JSON report (rewritten after every contender)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 64 tokens, rank 8 (CPU, the tests)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 5; 2 smoke)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per contender, start-up included (default 150; 60 smoke)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no contender after this many seconds; cap each one's limit by what is left")
    parser.add_argument("--contenders", nargs="+", choices=CHOICES, default=list(CONTENDERS),
                        help=f"in this order (default: {' '.join(CONTENDERS)})")
    parser.add_argument("--child", choices=CHOICES, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 5)
    if args.child:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        if args.parent_pid is not None:
            threading.Thread(target=_watchdog, args=(args.parent_pid, args.timeout or 150.0), daemon=True).start()
        sys.exit(child_main(args.child, args.smoke, args.steps))
    args.timeout = args.timeout if args.timeout is not None else (60.0 if args.smoke else 150.0)
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
