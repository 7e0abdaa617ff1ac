"""The engine on devices of its own (rollout.engine_devices = k): the plan puts the trainer's phases on the first
n − k of 8 fake CPU devices and the engine's on the last k, counts what each side holds against hand counts from
the model's shapes, and gives the sequential and the pipelined RL step from the phases' own times (XLA:CPU's
programs priced with TPU v5e's figures: `info`); the split suggestion takes the fastest that fits."""

from __future__ import annotations

import math

import jax
import pytest
from flax import nnx

from logra_jax import plan as plan_cli
from logra_jax.job.run_config import RunConfig
from logra_jax.models import preset
from logra_jax.models.decoder import abstract_model
from logra_jax.parallel.sharding import FAST_CPU_COMPILE
from logra_jax.planner import aot, plan

# One worker plans the module's splits once (a module fixture), not every worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("plan_split")

MODEL = {"preset": "tiny", "tokenizer": "char", "overrides": {"max_seq_len": 32, "dtype": "bfloat16"}}
TRAINER = ("start", "trainer init", "KL reference", "train step")
ENGINE = ("rollout", "policy sync", "evaluation")
V5E = aot.target_info("v5e:2x4")  # chip figures only: the programs are XLA:CPU's
SPLITS = (2, 6)


def split_run(k: int, staleness: int = 1) -> RunConfig:
    return RunConfig.from_dict({
        "model": MODEL, "sft": {"steps": 0}, "algorithm": {"kl_beta": 0.1},
        "rollout": {"prompts_per_step": 4, "num_samples": 2, "max_new_tokens": 8, "engine_devices": k,
                    "max_staleness": staleness},
        "optimizer": {"name": "logra", "rank": 4, "round_bf16": True}, "train": {"microbatches": 1, "eval_every": 2}})


def planned(run: RunConfig, only: tuple[str, ...] | None = None) -> dict[str, plan.PhaseBytes]:
    mesh, engine_mesh = plan.placement_meshes(run, jax.devices())
    return {p.name: p for p in plan.plan_phases(run, mesh, prompt_len=8, compiler_options=FAST_CPU_COMPILE,
                                                only=only, info=V5E, engine_mesh=engine_mesh)}


def _by_hand() -> dict[str, int]:
    """Bytes of the tiny model by hand from its shapes, every parameter at float32 (the trainer's weight dtype: the
    engine's masters): the matrices (kernels, embeddings) and the norm scales apart."""
    from logra_jax.core.tree_paths import flat_params

    leaves = flat_params(nnx.state(abstract_model(preset("tiny", max_seq_len=32)), nnx.Param))
    matrices = sum(x.size for p, x in leaves.items() if p.endswith(("kernel", "embedding")))
    return {"matrices": matrices * 4, "vectors": (sum(x.size for x in leaves.values()) - matrices) * 4}


@pytest.fixture(scope="module")
def splits() -> dict[int, dict[str, plan.PhaseBytes]]:
    """Every phase of the engine on k = 2 and 6 of the 8 devices, pipelined; the colocated job's policy sync."""
    return {0: planned(split_run(0, staleness=0), only=("policy sync",)),
            **{k: planned(split_run(k)) for k in SPLITS}}


@pytest.mark.slow
def test_the_trainer_plans_on_n_minus_k_devices_and_the_engine_on_k(splits):
    """k = 6: the trainer's phases on 2 devices, the engine's on 6. Nothing of the trainer's beside the engine's
    programs; beside the train step only the KL reference (FSDP over 2, norm scales whole); the engine holds the
    trainer's float32 masters whole on each device (decode layout with tensor 1 on CPU), not the bfloat16 copy the
    colocated engine makes: the merge's donated masters are that hand count."""
    phases = splits[6]
    assert {n: p.devices for n, p in phases.items()} == {**dict.fromkeys(TRAINER, 2), **dict.fromkeys(ENGINE, 6)}
    assert splits[0]["policy sync"].devices == 8
    assert [phases[n].others for n in ENGINE] == [0, 0, 0]
    hand = _by_hand()
    assert phases["train step"].others == hand["matrices"] // 2 + hand["vectors"]
    sync = phases["policy sync"]
    assert sync.program["alias"] == hand["matrices"] + hand["vectors"], (sync.program, hand)
    # colocated, the engine's copy is bfloat16 (half the matrices' float32 bytes, whole: tensor 1; XLA:CPU adds
    # 8 bytes per output leaf)
    assert 0 <= splits[0]["policy sync"].program["output"] - hand["matrices"] // 2 <= 8 * 16


@pytest.mark.slow
def test_the_payload_is_the_low_rank_factors(splits):
    """The sync's payload: a rank-4 factor per target, rows × 4 of each kernel (the axes A does not project) in
    bfloat16 (optimizer.round_bf16: the paper's wire format); over the v5e link in `transfer_seconds`."""
    from logra_jax.optim.targets import find_targets

    params = nnx.state(abstract_model(preset("tiny", max_seq_len=32)), nnx.Param)
    targets = find_targets(params).values()
    hand = sum(math.prod((*t.batch_shape, *t.rows_shape)) * 4 * 2 for t in targets)
    time = splits[6]["policy sync"].time
    assert time["payload_bytes"] == hand > 0
    assert time["transfer_seconds"] == pytest.approx(hand / V5E.link_bandwidth)
    assert time["est_seconds"] == pytest.approx(time["apply_seconds"] + time["transfer_seconds"])


@pytest.mark.slow
def test_the_pipelined_step_is_the_slower_side(splits):
    """From the phases' own times: the engine's side (rollout + the evaluation's share + the sync's merge) and the
    trainer's (KL reference + train step + the payload's transfer); sequential their sum, pipelined their max;
    the step the config runs follows rollout.max_staleness. Colocated: the sum, no pipelined step."""
    for k in SPLITS:
        phases = splits[k]
        est = {n: p.time["est_seconds"] for n, p in phases.items() if p.time}
        sync = phases["policy sync"].time
        engine = est["rollout"] + est["evaluation"] / 2 + sync["apply_seconds"]
        trainer = est["KL reference"] + est["train step"] + sync["transfer_seconds"]
        step = plan.rl_step_time(list(phases.values()), split_run(k))
        assert step["placement"] == "split"
        assert step["engine_seconds"] == pytest.approx(engine) and step["trainer_seconds"] == pytest.approx(trainer)
        assert step["pipelined_seconds"] == pytest.approx(max(engine, trainer)) == step["seconds"]
        assert step["sequential_seconds"] == pytest.approx(
            est["rollout"] + est["KL reference"] + est["train step"] + est["policy sync"] + est["evaluation"] / 2)
        assert plan.rl_step_time(list(phases.values()), split_run(k, staleness=0))["seconds"] == pytest.approx(
            step["sequential_seconds"])
    # colocated (the same phases' times read as one placement): the sum, no pipelined step
    colocated = plan.rl_step_time(list(splits[6].values()), split_run(0, staleness=0))
    assert colocated["pipelined_seconds"] is None and colocated["seconds"] == pytest.approx(
        sum(colocated["parts"].values())) == pytest.approx(step["sequential_seconds"])


@pytest.mark.slow
def test_the_suggestion_is_the_fastest_split_that_fits(splits):
    """The k of the shortest pipelined step among those that fit (a limit below one split's peak rules it out)."""
    steps = {k: plan.rl_step_time(list(splits[k].values()), split_run(k)) for k in SPLITS}
    peaks = {k: max(p.total for p in splits[k].values()) for k in steps}
    fastest = min(steps, key=lambda k: steps[k]["pipelined_seconds"])
    assert plan.best_split({k: (True, s) for k, s in steps.items()}) == fastest
    limit = peaks[fastest] - 1  # the fastest no longer fits
    fit = {k: peaks[k] <= limit for k in steps}
    hand = min((k for k in steps if fit[k]), key=lambda k: steps[k]["pipelined_seconds"], default=None)
    assert plan.best_split({k: (fit[k], s) for k, s in steps.items()}) == hand != fastest
    assert plan.best_split({k: (False, s) for k, s in steps.items()}) is None


def test_an_engine_on_every_device_is_refused(capsys):
    """k ≥ n leaves the trainer nothing: an error naming the field, from the planner and (exit 2) the CLI; an
    engine mesh that is not the config's is refused too."""
    with pytest.raises(ValueError, match=r"rollout.engine_devices = 8 leaves none of the 8 devices"):
        plan.placement_meshes(split_run(8), jax.devices())
    with pytest.raises(ValueError, match=r"rollout.engine_devices = 9"):
        plan.placement_meshes(split_run(9), jax.devices())
    mesh, _ = plan.placement_meshes(split_run(0, staleness=0), jax.devices())
    with pytest.raises(ValueError, match=r"engine_devices = 2 needs an engine_mesh of 2 devices"):
        plan.plan_phases(split_run(2), mesh, prompt_len=8)
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--config=configs/demo.py:runlocal", "--target=cpu:8", "--hbm_gib=1",
                       "--config.rollout.engine_devices=8"])
    assert e.value.code == 2 and "rollout.engine_devices = 8" in capsys.readouterr().err


@pytest.mark.slow
def test_suggest_split_prints_a_row_per_split(capsys):
    """--suggest_split on cpu:8 plans the colocated placement and k = 2, 4, 6 (here the rollout alone), prints a
    row for each with the devices each side takes; a CPU target has no time to choose by, and says so."""
    args = ["--config=configs/demo.py:runlocal", "--target=cpu:8", "--hbm_gib=1", "--prompt_len=8",
            "--config.sft.steps=0", "--phases=rollout", "--suggest_split"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("split suggestion for cpu:8"):].splitlines()
    assert [row.split()[:2] for row in table[2:6]] == [["0", "8"], ["2", "6"], ["4", "4"], ["6", "2"]], table
    assert "engine on the last 6" in out and "have no time on paper to choose by" in table[-1]


@pytest.mark.slow
def test_a_decode_copy_sits_beside_the_masters(splits):
    """The what-if engine_decode_copy: the engine on 6 devices decodes from a bfloat16 copy of its float32 masters,
    so beside its rollout sit the masters' matrices (the float32 norm scales are the copy's own, not held twice),
    its decode step reads fewer bytes than from the masters, and its sync casts the copy after the merge (more
    time than the merge alone). Only for an engine on devices of its own."""
    run = split_run(6)
    mesh, engine_mesh = plan.placement_meshes(run, jax.devices())
    phases = {p.name: p for p in plan.plan_phases(run, mesh, prompt_len=8, compiler_options=FAST_CPU_COMPILE,
                                                  only=("rollout", "policy sync"), info=V5E,
                                                  engine_mesh=engine_mesh, engine_decode_copy=True)}
    assert phases["rollout"].others == _by_hand()["matrices"]
    floor = lambda p: p.per_decode_step["floor_bytes"]
    assert floor(phases["rollout"]) < floor(splits[6]["rollout"])
    sync, alone = phases["policy sync"].time, splits[6]["policy sync"].time
    assert "then cast into its bfloat16 copy" in phases["policy sync"].note
    assert sync["apply_seconds"] > alone["apply_seconds"]
    assert sync["est_seconds"] == pytest.approx(sync["apply_seconds"] + sync["transfer_seconds"])
    colocated, _ = plan.placement_meshes(split_run(0, staleness=0), jax.devices())
    with pytest.raises(ValueError, match="engine_decode_copy is for an engine on devices of its own"):
        plan.plan_phases(split_run(0, staleness=0), colocated, prompt_len=8, engine_decode_copy=True)


def test_the_suggestion_table_names_the_fastest_that_fits_and_a_refused_split(monkeypatch, capsys):
    """The table from given placements (each plan replaced by phases of known times): k = 4 has the shortest
    pipelined step but does not fit, so k = 2 is named with its speedup over the colocated step (20 s / 8 s); a
    split the compiler refuses (libtpu's answer for 6 of v5e:2x4's chips) is a row saying so, not a crash."""
    times = {0: (10.0, 10.0, 0), 2: (8.0, 3.0, 0), 4: (4.0, 5.0, 3)}  # rollout s, train step s, exit status

    def fake_plan(fv, info, hbm, run, prompt_len):
        k = run.rollout.engine_devices
        if k == 6:
            raise jax.errors.JaxRuntimeError("INTERNAL: chips: 2,3,1 does not evenly divide into chips_per_hosts")
        rollout, train, status = times[k]
        phases = [plan.PhaseBytes("rollout", {"total": 2**20}, 0, time={"est_seconds": rollout}),
                  plan.PhaseBytes("train step", {"total": 2**20}, 0, time={"est_seconds": train})]
        return plan_cli._Placement(run, None, None, phases, "", status)

    monkeypatch.setattr(plan_cli, "_plan", fake_plan)
    assert plan_cli.main(["--config=configs/demo.py:runlocal", "--target=cpu:8", "--hbm_gib=1", "--prompt_len=8",
                          "--config.sft.steps=0", "--suggest_split"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("split suggestion for cpu:8"):].splitlines()[2:]
    assert table[0].split()[:3] == ["0", "8", "yes"] and table[0].split()[-2:] == ["20.0", "1.00"], table
    assert table[1].split()[:3] == ["2", "6", "yes"] and table[1].split()[-2:] == ["8.0", "2.50"], table
    assert table[2].split()[:3] == ["4", "4", "no"] and table[2].split()[-2:] == ["5.0", "4.00"], table
    assert table[3].startswith(" 6       2 the compiler refused it: INTERNAL: chips: 2,3,1"), table
    assert table[4] == ("best that fits: rollout.engine_devices = 2 with rollout.max_staleness >= 1, pipelined "
                        "step 8.0 s, 2.50× the colocated step's speed"), table


def test_the_split_step_line_names_both_sides():
    """The report's line for a split step: each side's parts, sequential and pipelined, from rl_step_time."""
    run = split_run(4)
    time = lambda s, **kw: {"est_seconds": s, **kw}
    phases = [plan.PhaseBytes("rollout", {"total": 0}, 0, time=time(30.0)),
              plan.PhaseBytes("KL reference", {"total": 0}, 0, time=time(2.0)),
              plan.PhaseBytes("train step", {"total": 0}, 0, time=time(10.0)),
              plan.PhaseBytes("policy sync", {"total": 0}, 0, time=time(0.5, apply_seconds=0.3,
                                                                              transfer_seconds=0.2)),
              plan.PhaseBytes("evaluation", {"total": 0}, 0, time=time(8.0))]
    line = plan.step_line(plan.rl_step_time(phases, run), run)
    # engine: 30 + 8 / eval_every 2 + 0.3 = 34.3 s; trainer: 2 + 10 + 0.2 = 12.2 s
    assert line.startswith("RL step on paper, the engine on 4 devices of its own: engine 34.3 s (rollout 30.0 s + "
                           "evaluation 4.0 s + sync merge 300.0 ms), trainer 12.2 s (KL reference 2.0 s + train step "
                           "10.0 s + payload transfer 200.0 ms); sequential 46.5 s, pipelined 34.3 s"), line
