"""colab/rl_tpu.ipynb runs the job that experiments/colab planned: configs/colab_tpu.py as it is now.

The committed plans (experiments/colab/plan_<chip>[_adamw].json, written by `python -m experiments.colab.plan`)
record the config file and variant they planned and its settings; the notebook loads the same file. The figures
the README there quotes are the plans'.
"""

import json
import runpy
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
PLANS = ROOT / "experiments" / "colab"
GIB = 2**30
CASES = [("v5e", "logra_kl", ""), ("v5e", "adamw", "adamw"), ("v6e", "logra_kl", ""), ("v6e", "adamw", "adamw")]


def _plan(chip: str, optimizer: str) -> dict:
    return json.loads((PLANS / f"plan_{chip}{'' if optimizer == 'logra_kl' else '_' + optimizer}.json").read_text())


def _peak(plan: dict) -> dict:
    return max(plan["phases"], key=lambda p: p["total"])


def test_the_notebook_runs_the_planned_config():
    source = "\n".join(c.source for c in nbformat.read(ROOT / "colab" / "rl_tpu.ipynb", as_version=4).cells)
    assert '"configs" / "colab_tpu.py"' in source
    assert "plan_{PLAN_CHIP}.json" in source and "plan_{PLAN_CHIP}_adamw.json" in source


@pytest.mark.parametrize(("chip", "optimizer", "variant"), CASES)
def test_committed_plan_is_of_the_config_as_it_is(chip: str, optimizer: str, variant: str):
    plan = _plan(chip, optimizer)
    assert plan["config"] == "configs/colab_tpu.py" + (f":{variant}" if variant else "")
    assert plan["target"] == f"{chip}:1x1" and plan["mesh"] == [1, 1, 1]
    config = runpy.run_path(str(ROOT / "configs" / "colab_tpu.py"))["get_config"](variant)
    assert plan["settings"] == json.loads(json.dumps(config.to_dict())), (
        "configs/colab_tpu.py changed since its plan: rerun python -m experiments.colab.plan")


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_logra_fits_one_chip_and_adamw_is_refused(chip: str):
    logra, adamw = _plan(chip, "logra_kl"), _plan(chip, "adamw")
    assert _peak(logra)["total"] <= logra["hbm_bytes"] and not any(p["refused"] for p in logra["phases"])
    assert logra["rl_step"] is not None
    assert _peak(adamw)["total"] > adamw["hbm_bytes"] and _peak(adamw)["refused"]


def test_readme_quotes_the_plans():
    """Its table: | chip | optimizer | peak GiB | peak phase | RL step on paper | fits |."""
    lines = (PLANS / "README.md").read_text().splitlines()
    rows = {tuple(cells[:2]): cells for line in lines if line.startswith("| v")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    labels = {"logra_kl": "LoGRA + KL", "adamw": "AdamW"}
    for chip in ("v5e", "v6e"):
        for optimizer, label in labels.items():
            plan = _plan(chip, optimizer)
            cells = rows[(f"{chip}:1x1", label)]
            assert cells[2].startswith(f"{_peak(plan)['total'] / GIB:.2f}"), (chip, optimizer, cells)
            assert cells[3] == _peak(plan)["name"]
            step = plan["rl_step"]
            assert cells[4] == ("–" if step is None else f"{step['seconds']:.1f} s"), (chip, optimizer, cells)


def test_the_notebook_states_the_planned_step_time():
    cells = nbformat.read(ROOT / "colab" / "rl_tpu.ipynb", as_version=4).cells
    text = " ".join(" ".join(c.source.split()) for c in cells if c.cell_type == "markdown")
    for chip in ("v5e", "v6e"):
        step = _plan(chip, "logra_kl")["rl_step"]
        assert f"{step['seconds']:.1f} s on {chip}" in text
        assert f"{step['hours'] * 60:.0f} min on {chip}" in text
