"""The KL controller's inputs in the loop: a representative probe (distinct prompts), no silent step on an empty
probe, and refused steps that change nothing and stop the run when they repeat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import io_callback

import logra_jax.job.train_step as train_step_mod
from logra_jax.job.train import KLRefusalError, _probe_batch, train_and_evaluate
from logra_jax.job.train_step import KLProbeConfig, TrainState, make_train_step, next_token_loss
from logra_jax.models.config import preset
from logra_jax.models.decoder import init_model
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec, logra
from logra_jax.optim.predicted_kl import PredictedKLState
from logra_jax.rl.objective import probe_rows
from logra_jax.rollout.sampling import Rollout


@pytest.mark.parametrize(("prompts", "samples", "count"), [(16, 16, 8), (4, 16, 8), (3, 5, 15), (7, 2, 1),
                                                            (16, 16, 16), (5, 3, 4)])
def test_probe_rows_cover_distinct_prompts(prompts, samples, count):
    for seed in range(5):
        rows = probe_rows(prompts, samples, count, (seed, 11))
        assert len(rows) == count == len(set(rows.tolist()))  # distinct responses
        assert rows.min() >= 0 and rows.max() < prompts * samples
        covered = rows // samples
        assert len(set(covered.tolist())) == min(count, prompts)
        # Every prompt appears ⌊count/prompts⌋ or ⌈count/prompts⌉ times: no prompt dominates the probe.
        counts = np.bincount(covered, minlength=prompts)
        assert counts.max() - counts[counts > 0].min() <= 1
        np.testing.assert_array_equal(rows, probe_rows(prompts, samples, count, (seed, 11)))  # deterministic
    draws = {tuple(probe_rows(prompts, samples, count, (0, step)).tolist()) for step in range(8)}
    assert len(draws) > 1 or count == prompts * samples  # the choice varies with the step
    with pytest.raises(ValueError, match="count"):
        probe_rows(prompts, samples, prompts * samples + 1, 0)


def test_probe_without_generated_tokens_is_an_error_naming_the_step():
    n, p, g = 4, 3, 2
    rollout = Rollout(tokens=jnp.ones((n, p + g), jnp.int32), prompt_mask=jnp.ones((n, p), bool),
                      response_mask=jnp.zeros((n, g), bool), logprobs=jnp.zeros((n, g)),
                      lengths=jnp.zeros(n, jnp.int32), finished=jnp.zeros(n, bool))
    with pytest.raises(ValueError, match="RL step 17: the predicted-KL probe"):
        _probe_batch(rollout, np.array([0, 2]), 17)
    rollout = rollout._replace(response_mask=jnp.zeros((n, g), bool).at[2, 0].set(True))
    probe = _probe_batch(rollout, np.array([0, 2]), 17)
    np.testing.assert_array_equal(np.asarray(probe["kl_mask"]),
                                  [[False, False, False, False, False], [False, False, True, False, False]])


def _kl_controlled_step(undo_above=0.0):
    """A LoGRA + KL-control train step on the tiny model whose probe predicts (q_sum, 1) per update."""
    model = init_model(preset("tiny"))
    spec = SketchSpec(rank=4)
    attach_sketch_probes(model, spec)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = logra(4, update_ratio=1e-2, kl_control={"kl_budget": 1e-3})
    step = make_train_step(graphdef, next_token_loss, tx, mode="sketch_native",
                           kl_probe=KLProbeConfig(undo_above=undo_above))
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    step = jax.jit(step)  # one program (op by op the step compiles ~170 small ones)
    toks = jax.random.randint(jax.random.key(0), (4, 8), 1, 128)
    batch = {"tokens": toks, "attention_mask": jnp.ones_like(toks, bool), "loss_mask": jnp.ones_like(toks, bool)}
    probe = {"tokens": toks[:2], "attention_mask": jnp.ones_like(toks[:2], bool),
             "kl_mask": jnp.ones_like(toks[:2], bool)}
    return step, state, rest, batch, probe


@pytest.mark.slow
def test_refused_step_advances_no_state(monkeypatch):
    predictions = iter([1e-4, float("nan"), -1.0, 1e-4])

    def fake_probe(updates):  # the next prediction on each run of the jitted step (a callback, not a traced constant)
        q = io_callback(lambda: np.float32(next(predictions)), jax.ShapeDtypeStruct((), jnp.float32))
        return q, jnp.float32(1.0)

    monkeypatch.setattr(train_step_mod, "make_kl_probe", lambda *a, **k: fake_probe)
    step, state, rest, batch, probe = _kl_controlled_step()
    state, metrics = step(state, rest, batch, probe=probe)  # a normal step: everything moves
    assert float(metrics["kl_refused"]) == 0.0 and int(state.step) == 1
    for _ in range(2):  # NaN, then negative q: refused
        before = state
        state, metrics = step(state, rest, batch, probe=probe)
        assert float(metrics["kl_refused"]) == 1.0 and float(metrics["kl_realised"]) == 0.0
        assert int(state.step) == int(before.step)  # the projection step did not advance
        for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(state.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        is_kl = lambda x: isinstance(x, PredictedKLState)
        old_leaves = jax.tree.leaves(before.opt_state, is_leaf=is_kl)
        new_leaves = jax.tree.leaves(state.opt_state, is_leaf=is_kl)
        compared = 0
        for a, b in zip(old_leaves, new_leaves, strict=True):
            if is_kl(a):  # only the controller's record of the refusal moves
                assert int(b.kl_skipped) == int(a.kl_skipped) + 1 and float(b.kl_alpha) == 0.0
                assert int(b.kl_count) == int(a.kl_count) and float(b.kl_mismatch) == float(a.kl_mismatch)
            else:  # RowAdam moments, counters: unchanged bit for bit
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                compared += 1
        assert compared >= 3
    state, metrics = step(state, rest, batch, probe=probe)  # accepted again
    assert float(metrics["kl_refused"]) == 0.0 and int(state.step) == 2 and float(metrics["kl_skipped"]) == 2


@pytest.mark.parametrize("undo_above", [1e-9, 1e9])
def test_overshooting_step_is_undone(monkeypatch, undo_above):
    """A prediction that underestimates (q tiny → α at its cap) gives a realised KL far above the budget: with
    kl undo on, the step is undone (params back bit for bit, no state advanced); with a loose bound it stays."""
    monkeypatch.setattr(train_step_mod, "make_kl_probe",
                        lambda *a, **k: lambda updates: (jnp.float32(1e-12), jnp.float32(1.0)))
    step, state, rest, batch, probe = _kl_controlled_step(undo_above)
    new, metrics = step(state, rest, batch, probe=probe)
    assert float(metrics["kl_realised"]) > 0 and float(metrics["kl_alpha"]) == 3.0
    undone = undo_above < 1
    assert float(metrics["kl_undone"]) == float(undone) and int(new.step) == int(not undone)
    same = [np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params), strict=True)]
    assert all(same) if undone else not all(same)


@pytest.mark.slow
def test_three_consecutive_refusals_stop_the_run_naming_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(train_step_mod, "make_kl_probe",
                        lambda *a, **k: lambda updates: (jnp.float32(jnp.nan), jnp.float32(1.0)))
    config = {
        "model": {"preset": "tiny", "overrides": {"max_seq_len": 16}},
        "task": {"kind": "arithmetic", "difficulty": 1, "operations": "+", "train_size": 64, "eval_size": 4,
                 "prompt_style": "compact"},
        "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_new_tokens": 3},
        "optimizer": {"name": "logra", "rank": 4, "kl_control": True, "probe_responses": 2},
        "train": {"steps": 5},
    }
    with pytest.raises(KLRefusalError, match="RL step 3: the KL controller refused 3 consecutive"):
        train_and_evaluate(config, tmp_path)
    log = (tmp_path / "log.txt").read_text()
    assert "RL step 1: the KL controller refused the update" in log and "2 in a row" in log
