"""Entry point: python -m logra_jax.plan --config=configs/<name>.py[:variant] --target=<chip:topology> [...].

  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=v5e:2x4
  python -m logra_jax.plan --config=configs/paper_qwen2.5_math.py:7b --target=cpu:8 --hbm_gib=16 \
      --config.rollout.slots=64 --phases=rollout --phases="train step"

Plans the whole job, phase by phase, compile-only for the target (logra_jax.planner.plan says how). Config fields
are overridden as for logra_jax.main: `--config.<section>.<field>=<value>`. Exit status: 0 every phase fits, 3 one
does not (naming it and what to change), 2 bad flags, 1 other errors.
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
from logra_jax.planner.plan import GIB, PHASES, job_prompt_length, plan_phases, planning_config, report, rl_step_time

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


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); `argv` without the program name (default sys.argv[1:])."""
    fv = parse_flags(sys.argv[1:] if argv is None else list(argv))
    info, hbm = _target(fv)
    from logra_jax.job.phases import job_mesh
    from logra_jax.parallel.sharding import FAST_CPU_COMPILE

    config, spec = fv.config, fv["config"].config_filename
    run = planning_config(config)
    mesh = job_mesh(run.train, aot.devices(fv.target))
    recipe_without_data = config.task.kind == "jsonl" and not config.task.jsonl_train
    # A JSONL recipe planned before its files exist runs at its own prompt length, not the placeholder task's.
    prompt_len = fv.prompt_len or (512 if recipe_without_data else job_prompt_length(run))
    print(f"plan: {spec} on {fv.target} ({info.device_kind}, mesh data×fsdp×tensor "
          f"{'×'.join(map(str, mesh.devices.shape))}; {run.model.checkpoint or run.model.preset}, "
          f"{run.optimizer.name}; jax {jax.__version__})", flush=True)
    phases = plan_phases(run, mesh, prompt_len,
                         compiler_options=FAST_CPU_COMPILE if info.platform == "cpu" else None, only=fv.phases,
                         info=info, progress=lambda name: print(f"  compiling {name} ...", flush=True))
    text, status = report(phases, hbm, run)
    print(text)
    if fv.json:
        Path(fv.json).write_text(json.dumps({
            "config": spec, "target": fv.target, "hbm_bytes": hbm, "jax": jax.__version__,
            "mesh": list(mesh.devices.shape), "prompt_len": prompt_len, "rl_step": rl_step_time(phases, run),
            "phases": [{**dataclasses.asdict(p), "total": p.total} for p in phases]}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
