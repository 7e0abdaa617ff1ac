"""Entry point: python -m logra_jax.plan --config=configs/<name>.py[:variant] --target=<chip:topology> [...].

  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=v5e:2x4
  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=cpu:8 --hbm_gib=16 \
      --config.rollout.slots=64 --phases=rollout --phases="train step"
  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=v5e:2x4 \
      --config.rollout.engine_devices=4 --config.rollout.max_staleness=1
  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=h100:8 --suggest_split

Plans the whole job, phase by phase, compile-only for the target (logra_jax.planner.plan says how). Config fields
are overridden as for logra_jax.main: `--config.<section>.<field>=<value>`. With rollout.engine_devices = k the
trainer is planned on n − k devices and the engine on the last k, and the RL step is given sequential and
pipelined (`planner.plan.rl_step_time`); --compare_colocated (on by default) then also plans the same config
colocated (engine_devices = 0, max_staleness = 0) and prints its step and the speedup. --suggest_split plans the
colocated placement and k = n/4, n/2, 3n/4 (those that are whole numbers and give valid meshes), each pipelined
(max_staleness ≥ 1), and prints a table naming the fastest that fits. Every split's engine holds what the job's
`DeviceEngine` holds: float32 masters and a compute-dtype copy it decodes from (--noengine_decode_copy: decoding
from the masters, the worker transport's way). Exit status: 0 every
phase (of the config's own placement) fits, 3 one does not (naming it and what to change), 2 bad flags, 1 other
errors.
"""

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import jax

from logra_jax.core.extras import requires_extra
from logra_jax.planner import aot
from logra_jax.planner.plan import (
    GIB,
    PHASES,
    best_split,
    job_prompt_length,
    placement_meshes,
    plan_phases,
    planning_config,
    report,
    rl_step_time,
)

with requires_extra("rl", "logra_jax.plan"):
    from absl import flags
    from ml_collections import config_flags

PROG = "python -m logra_jax.plan"
_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")


def _usage_error(message: str) -> NoReturn:
    """Bad flags: the message on stderr and exit status 2."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


def _define_flags(argv: list[str]) -> flags.FlagValues:
    """The command's flags, in a FlagValues of their own (a process may also hold logra_jax.main's); the config
    flag reads its `--config.x.y` overrides from `argv`."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "configs/<name>.py[:variant]", flag_values=fv,
                                    lock_config=True, sys_argv=[PROG, *argv])
    flags.DEFINE_string("target", None, "v5e:2x4, v5p:2x2x1, v6e:2x4, v4:2x2x1, h100:8, ..., cpu:8", flag_values=fv)
    flags.DEFINE_float("hbm_gib", None, "per-device memory to fit (default: the target's HBM; needed for cpu:N)",
                       flag_values=fv)
    flags.DEFINE_integer("prompt_len", None, "prompt tokens per sequence (default: measured from the task's "
                         "problems as the job does; 512 for a JSONL task whose files are not given)", flag_values=fv)
    flags.DEFINE_multi_enum("phases", None, PHASES, "compile only these phases, one flag each (default all)",
                            flag_values=fv)
    flags.DEFINE_string("json", "", "also write the phases as JSON to this file", flag_values=fv)
    flags.DEFINE_bool("compare_colocated", True, "with rollout.engine_devices > 0, also plan the colocated "
                      "placement (engine_devices = 0) and print its RL step beside the split one's", flag_values=fv)
    flags.DEFINE_bool("suggest_split", False, "plan the colocated placement and the engine on k = n/4, n/2, 3n/4 "
                      "of the n devices (pipelined), and print a table naming the fastest that fits",
                      flag_values=fv)
    flags.DEFINE_bool("engine_decode_copy", True, "an engine on devices of its own keeps a compute-dtype copy of "
                      "its masters and decodes from it, as the job's DeviceEngine does (False: it decodes from the "
                      "masters)", flag_values=fv)
    flags.mark_flags_as_required(["config", "target"], flag_values=fv)
    return fv


def _missing_field(config: Any, argv: list[str]) -> str | None:
    """The first `--config.x.y` override in `argv` that names no field of `config`."""
    for arg in argv:
        found = _OVERRIDE.match(arg)
        if found is None:
            continue
        node = config
        for key in found[1].split("."):
            if not hasattr(node, "keys") or key not in node:
                return found[1]
            node = node[key]
    return None


def parse_flags(argv: list[str]) -> flags.FlagValues:
    """The parsed flags (their config loaded and overridden); a bad flag, config file or field exits 2."""
    fv = _define_flags(argv)
    try:
        rest = fv([PROG, *argv])
    except flags.Error as err:
        _usage_error(str(err))
    except (AttributeError, KeyError) as err:  # config_flags' report of an override naming no field
        field = _missing_field(parse_flags([a for a in argv if not _OVERRIDE.match(a)]).config, argv)
        _usage_error(f"config has no field {field}" if field else f"bad config override ({err})")
    if rest[1:]:
        _usage_error(f"unexpected arguments {rest[1:]}")
    try:
        fv.config.keys()
    except OSError as err:  # config_flags defers a config file it could not load to its first use
        _usage_error(f"--config={fv['config'].config_filename}: {err}")
    return fv


def _target(fv: flags.FlagValues) -> tuple[aot.TargetInfo, int]:
    """The target's figures and the per-device bytes to fit; on a CPU target, that many fake devices."""
    try:
        info = aot.target_info(fv.target)
    except ValueError as err:
        _usage_error(str(err))
    hbm = info.hbm_bytes if fv.hbm_gib is None else int(fv.hbm_gib * GIB)
    if hbm is None:
        _usage_error(f"--target={fv.target} has no HBM size of its own: pass --hbm_gib")
    if info.platform == "cpu" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={info.num_devices}").strip()
    return info, hbm


@dataclasses.dataclass
class _Placement:
    """One planned placement: its config, meshes, phases, report and exit status."""

    run: Any
    mesh: Any
    engine_mesh: Any
    phases: list[Any]
    text: str
    status: int

    @property
    def step(self) -> dict[str, Any] | None:
        return rl_step_time(self.phases, self.run)

    @property
    def peak(self) -> int:
        return max(p.total for p in self.phases)


def with_placement(run: Any, engine_devices: int, max_staleness: int) -> Any:
    """`run` with the engine on `engine_devices` devices of its own (0: colocated) and `max_staleness` (the
    KL-budgeted admission, which needs staleness, dropped with it)."""
    from logra_jax.job.run_config import RunConfig

    d = run.to_dict()
    d["rollout"].update(engine_devices=engine_devices, max_staleness=max_staleness,
                        **({} if max_staleness else {"max_stale_kl": 0.0}))
    return RunConfig.from_dict(d)


def _plan(fv: flags.FlagValues, info: aot.TargetInfo, hbm: int, run: Any, prompt_len: int) -> _Placement:
    """Plan `run` on the target's devices, printing its header, progress and report."""
    from logra_jax.parallel.sharding import FAST_CPU_COMPILE

    mesh, engine_mesh = placement_meshes(run, aot.devices(fv.target))
    k = run.rollout.engine_devices
    where = (f"mesh data×fsdp×tensor {'×'.join(map(str, mesh.devices.shape))}" if not k else
             f"trainer mesh data×fsdp×tensor {'×'.join(map(str, mesh.devices.shape))} on the first "
             f"{mesh.devices.size} devices, engine on the last {k}, rollout.max_staleness = "
             f"{run.rollout.max_staleness}"
             + (", a compute-dtype decode copy beside the engine's masters" if fv.engine_decode_copy else ""))
    print(f"plan: {fv['config'].config_filename} on {fv.target} ({info.device_kind}, {where}; "
          f"{run.model.checkpoint or run.model.preset}, {run.optimizer.name}; jax {jax.__version__})", flush=True)
    phases = plan_phases(run, mesh, prompt_len, engine_mesh=engine_mesh,
                         engine_decode_copy=fv.engine_decode_copy and bool(k),
                         compiler_options=FAST_CPU_COMPILE if info.platform == "cpu" else None, only=fv.phases,
                         info=info, progress=lambda name: print(f"  compiling {name} ...", flush=True))
    text, status = report(phases, hbm, run)
    print(text, flush=True)
    return _Placement(run, mesh, engine_mesh, phases, text, status)


def _speedup(colocated: _Placement, split: _Placement) -> float | None:
    """The colocated step's seconds over the split one's pipelined step (None where either is unknown)."""
    a, b = colocated.step, split.step
    return None if a is None or b is None else a["seconds"] / b["pipelined_seconds"]


def _compare(colocated: _Placement, split: _Placement) -> str:
    step, other = split.step, colocated.step
    if step is None or other is None:
        return "colocated vs split: no time on paper (a CPU target, or a phase refused or not compiled)"
    return (f"colocated (engine_devices = 0) RL step {other['seconds']:.1f} s; split (engine on "
            f"{split.run.rollout.engine_devices}) sequential {step['sequential_seconds']:.1f} s, pipelined "
            f"{step['pipelined_seconds']:.1f} s: {_speedup(colocated, split):.2f}× the colocated step's speed")


def _candidates(run: Any, devices: list[Any]) -> list[tuple[int, str]]:
    """(k, "" or why not) for k = n/4, n/2, 3n/4 of the n `devices`: whole numbers in 1..n−1 whose trainer mesh
    (train.mesh_*) and decode layout (rollout.decode_tensor) fit."""
    out, n = [], len(devices)
    for num in (1, 2, 3):
        k = n * num // 4
        if n * num % 4 or not 0 < k < n or k in [c for c, _ in out]:
            continue
        why = ""
        if run.rollout.decode_tensor and k % run.rollout.decode_tensor:
            why = f"rollout.decode_tensor = {run.rollout.decode_tensor} does not divide {k}"
        else:
            try:
                placement_meshes(with_placement(run, k, max(1, run.rollout.max_staleness)), devices)
            except ValueError as err:
                why = str(err)
        out.append((k, why))
    return out


def _seconds_cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _suggest(fv: flags.FlagValues, info: aot.TargetInfo, hbm: int, run: Any, prompt_len: int,
             own: _Placement) -> str:
    """Plan the colocated placement and each candidate split (pipelined); the table as text."""
    colocated = own if not run.rollout.engine_devices else _plan(fv, info, hbm, with_placement(run, 0, 0),
                                                                 prompt_len)
    rows = [f"{'k':>2s} {'trainer':>7s} {'fits?':>20s} {'rollout s':>9s} {'engine s':>8s} {'train+sync s':>12s} "
            f"{'sequential s':>12s} {'pipelined s':>11s} {'speedup':>7s}"]
    base = colocated.step
    rows.append(f"{0:>2d} {info.num_devices:>7d} {_fits(colocated, hbm):>20s} "
                f"{_seconds_cell(base and base['parts']['rollout']):>9s} {'':>8s} {'':>12s} "
                f"{_seconds_cell(base and base['seconds']):>12s} {'':>11s} {'1.00' if base else '–':>7s}")
    planned = {}
    for k, why in _candidates(run, list(aot.devices(fv.target))):
        if why:
            rows.append(f"{k:>2d} {info.num_devices - k:>7d} no valid mesh: {why}")
            continue
        staleness = max(1, run.rollout.max_staleness)
        same = run.rollout.engine_devices == k and run.rollout.max_staleness == staleness
        try:
            split = own if same else _plan(fv, info, hbm, with_placement(run, k, staleness), prompt_len)
        except jax.errors.JaxRuntimeError as err:  # e.g. libtpu: the k devices are not a slice it compiles for
            print(f"the compiler refused the split k = {k}: {err}", flush=True)
            rows.append(f"{k:>2d} {info.num_devices - k:>7d} the compiler refused it: {str(err).splitlines()[0]}")
            continue
        step, speedup = split.step, _speedup(colocated, split)
        rows.append(f"{k:>2d} {info.num_devices - k:>7d} {_fits(split, hbm):>20s} "
                    f"{_seconds_cell(step and step['parts']['rollout']):>9s} "
                    f"{_seconds_cell(step and step['engine_seconds']):>8s} "
                    f"{_seconds_cell(step and step['trainer_seconds']):>12s} "
                    f"{_seconds_cell(step and step['sequential_seconds']):>12s} "
                    f"{_seconds_cell(step and step['pipelined_seconds']):>11s} "
                    f"{'–' if speedup is None else f'{speedup:.2f}':>7s}")
        planned[k] = split
    rows.insert(0, f"split suggestion for {fv.target} (on paper; k = the engine's devices, 0 = colocated; "
                   "engine s = rollout + evaluation share + sync merge; train+sync s = KL reference + train step "
                   "+ payload transfer; speedup = colocated step / pipelined step):")
    best = best_split({k: (split.status == 0, split.step) for k, split in planned.items()})
    fit = [k for k, split in planned.items() if split.status == 0]
    if best is not None:
        speedup = _speedup(colocated, planned[best])
        rows.append(f"best that fits: rollout.engine_devices = {best} with rollout.max_staleness >= 1, pipelined "
                    f"step {planned[best].step['pipelined_seconds']:.1f} s"
                    + ("" if speedup is None else f", {speedup:.2f}× the colocated step's speed"))
    else:
        rows.append(f"the splits that fit (k = {fit}) have no time on paper to choose by (a CPU target)" if fit
                    else "no split fits")
    return "\n".join(rows)


def _fits(placement: _Placement, hbm: int) -> str:
    return f"{'yes' if placement.status == 0 else 'no'} ({placement.peak / GIB:.2f}/{hbm / GIB:.2f} GiB)"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); `argv` without the program name (default sys.argv[1:])."""
    fv = parse_flags(sys.argv[1:] if argv is None else list(argv))
    info, hbm = _target(fv)
    config, spec = fv.config, fv["config"].config_filename
    run = planning_config(config)
    recipe_without_data = config.task.kind == "jsonl" and not config.task.jsonl_train
    # A JSONL recipe planned before its files exist runs at its own prompt length, not the placeholder task's.
    prompt_len = fv.prompt_len or (512 if recipe_without_data else job_prompt_length(run))
    try:
        placement_meshes(run, aot.devices(fv.target))
    except ValueError as err:
        _usage_error(str(err))
    own = _plan(fv, info, hbm, run, prompt_len)
    if fv.json:
        Path(fv.json).write_text(json.dumps({
            "config": spec, "target": fv.target, "hbm_bytes": hbm, "jax": jax.__version__,
            "mesh": list(own.mesh.devices.shape), "engine_devices": run.rollout.engine_devices,
            "prompt_len": prompt_len, "rl_step": own.step,
            "phases": [{**dataclasses.asdict(p), "total": p.total} for p in own.phases]}, indent=1))
    if fv.suggest_split:
        print(_suggest(fv, info, hbm, run, prompt_len, own))
    elif run.rollout.engine_devices and fv.compare_colocated:
        print(_compare(_plan(fv, info, hbm, with_placement(run, 0, 0), prompt_len), own))
    return own.status


if __name__ == "__main__":
    sys.exit(main())
