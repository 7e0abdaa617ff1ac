"""The plan of colab/rl_tpu.ipynb's job (configs/colab_tpu.py) on one TPU v5e and one v6e chip, LoGRA + KL and AdamW.

  python -m experiments.colab.plan                       # every chip and optimizer, one plan at a time
  python -m experiments.colab.plan --chips v5e --optimizers logra_kl
  python -m experiments.colab.plan --record_only         # add the settings to plans already written
  python -m experiments.colab.plan --table               # the README's table from the plans

Each plan is `JAX_PLATFORMS=cpu .venv-tpu/bin/python -m logra_jax.plan --config=configs/colab_tpu.py[:adamw]
--target=<chip>:1x1 --json experiments/colab/plan_<chip>[_adamw].json` (the real TPU compiler, deviceless; exit
status 3 when a phase does not fit, as AdamW's train step does). Each JSON then gets the config's settings as the
plan read them (`settings`: the variant's get_config() as a dict) and the command, so that tests/colab can check that
the committed plans are of the notebook's job as the config file has it now.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = "configs/colab_tpu.py"
CHIPS = ("v5e", "v6e")
OPTIMIZERS = {"logra_kl": "", "adamw": "adamw"}  # → the config's variant


def plan_path(chip: str, optimizer: str) -> Path:
    return HERE / f"plan_{chip}{'' if optimizer == 'logra_kl' else '_' + optimizer}.json"


def settings(variant: str) -> dict:
    """The config's settings for `variant`, as JSON."""
    return json.loads(json.dumps(runpy.run_path(str(REPO / CONFIG))["get_config"](variant).to_dict()))


def command(chip: str, optimizer: str) -> list[str]:
    variant = OPTIMIZERS[optimizer]
    return [".venv-tpu/bin/python", "-m", "logra_jax.plan", f"--config={CONFIG}{':' + variant if variant else ''}",
            f"--target={chip}:1x1", "--json", str(plan_path(chip, optimizer).relative_to(REPO))]


def record(chip: str, optimizer: str) -> None:
    path = plan_path(chip, optimizer)
    plan = json.loads(path.read_text())
    plan.update(settings=settings(OPTIMIZERS[optimizer]),
                command="JAX_PLATFORMS=cpu " + " ".join(command(chip, optimizer)))
    path.write_text(json.dumps(plan, indent=1) + "\n")


def table() -> str:
    """The README's table: | chip | optimizer | peak GiB | peak phase | RL step on paper | fits |."""
    lines = ["| chip | optimizer | peak GiB per chip | peak phase | RL step on paper | fits |",
             "|---|---|---|---|---|---|"]
    for chip in CHIPS:
        for optimizer, label in (("logra_kl", "LoGRA + KL"), ("adamw", "AdamW")):
            plan = json.loads(plan_path(chip, optimizer).read_text())
            peak = max(plan["phases"], key=lambda p: p["total"])
            step = plan["rl_step"]
            fits = all(p["total"] <= plan["hbm_bytes"] for p in plan["phases"])
            lines.append(f"| {chip}:1x1 | {label} | {peak['total'] / 2**30:.2f}"
                         f"{' (refused by the compiler)' if peak['refused'] else ''} | {peak['name']} | "
                         f"{'–' if step is None else format(step['seconds'], '.1f') + ' s'} | "
                         f"{'yes' if fits else '**no**'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", nargs="+", default=list(CHIPS), choices=CHIPS)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--record_only", action="store_true", help="only add the settings to existing plans")
    parser.add_argument("--table", action="store_true", help="print the README's table and exit")
    args = parser.parse_args()
    if args.table:
        print(table())
        return
    for chip in args.chips:
        for optimizer in args.optimizers:
            if not args.record_only:
                done = subprocess.run(["nice", *command(chip, optimizer)], cwd=REPO,
                                      env={**os.environ, "JAX_PLATFORMS": "cpu"})
                if done.returncode not in (0, 3):
                    raise SystemExit(f"plan {chip} {optimizer} failed with exit status {done.returncode}")
            if plan_path(chip, optimizer).exists():
                record(chip, optimizer)


if __name__ == "__main__":
    main()
