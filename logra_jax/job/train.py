"""The main job: RL post-training from a RunConfig — rollout → reward → advantages → jitted update.

  train_and_evaluate(config, workdir)

1. Model and tokenizer (preset + random init, or a checkpoint), tasks (tfds builders read through grain).
2. Optional SFT warm start on easier problems (skipped when resuming from an RL checkpoint, unless a reference-KL
   penalty needs the policy RL started from: SFT is deterministic, so it is repeated).
3. Held-out greedy accuracy, then `train.steps` RL updates: sample prompts_per_step × num_samples responses with
   the rollout engine, score them (time-limited, never eval'd), compute advantages, run the jitted train step
   (microbatched; LoGRA sketch-native or dense, predicted-KL control on a few probe responses), sync the
   policy to the rollout engine (low-rank payloads), log metrics (JSONL + TensorBoard + progress bar), stop on a
   non-finite loss/reward/norm, evaluate and checkpoint periodically.
4. Final held-out accuracy and a reward-curve PNG under workdir.
Every random choice derives from train.seed and the step number, so an interrupted run resumed from its last
checkpoint reproduces the uninterrupted run bit for bit.

Several processes (logra_jax.parallel.multihost, started by logra_jax.main) run the same loop on one global mesh: each
reads only its own part of every prompt batch, the prompts, rollouts, rewards and train batch are global arrays
whose rows each process holds (`_ProcessRows`), each process decodes and scores its own rows, the colocated
rollout engine updates each process's own weight shards, checkpoints carry every process's data-iterator state,
and process 0 alone writes the log, metrics, plots and summary. The loop is the same code in one process (where
"its own rows" are all rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.core.extras import requires_extra

with requires_extra("rl", "logra_jax.job.train"):
    from flax import nnx

    from logra_jax.job import metrics as metrics_lib
    from logra_jax.job.builders import build_model, build_tasks
    from logra_jax.job.checkpoint import CheckpointError, CheckpointManager
    from logra_jax.job.lifecycle import (
        RunPreempted,
        StopRequests,
        check_resume,
        describe_changes,
        read_json,
        record_config,
        write_json_atomic,
    )
    from logra_jax.job.optimizer_plan import check_optimizer_fits
    from logra_jax.job.phases import Trainer, job_mesh, reference_logprobs
    from logra_jax.job.run_config import RunConfig
    from logra_jax.job.sft import cached_warm_start, check_warm_start, final_window, supervised_warm_start
    from logra_jax.models import LoadStats
    from logra_jax.models.hf import export
    from logra_jax.parallel import multihost
    from logra_jax.parallel.sharding import (
        abstract_sharded,
        batch_shardings,
        global_rows,
        local_rows,
        process_rows,
        replicated,
        to_global,
    )
    from logra_jax.rl.advantages import advantage_estimator, dynamic_sampling_mask
    from logra_jax.rl.evaluation import greedy_accuracy
    from logra_jax.rl.objective import (
        probe_rows,
    )
    from logra_jax.rl.prompts import PromptFormat, decode_responses, encode_prompts, max_prompt_length
    from logra_jax.rl.rewards import RewardConfig, RewardFn, score_responses
    from logra_jax.rollout.engine import RolloutEngine, rollout_engine
    from logra_jax.rollout.sampling import SamplingConfig

# Metrics that must stay finite: a NaN/inf here stops the run naming the step and the metric.
GUARDED = ("loss", "reward_mean", "grad_norm", "sketch_norm", "kl_realised", "kl_q")
# A step the KL controller refuses (non-finite or negative q) changes nothing and is counted; this many in a row
# stop the run, naming the step.
MAX_CONSECUTIVE_REFUSALS = 3


class KLRefusalError(RuntimeError):
    """The predicted-KL controller refused MAX_CONSECUTIVE_REFUSALS updates in a row (the message names the step)."""


def _rl_batch(rollout, advantages: np.ndarray) -> dict[str, jax.Array]:
    return {"tokens": rollout.tokens, "attention_mask": rollout.attention_mask(),
            "response_mask": rollout.response_mask, "advantages": jnp.asarray(advantages, jnp.float32),
            "rollout_logprobs": rollout.logprobs, "finished": rollout.finished}


EXAMPLES_SHOWN = 3  # held-out problems whose greedy responses the log shows before and after RL


def _probe_batch(rollout, rows: np.ndarray, step: int) -> dict[str, jax.Array]:
    """The probe responses `rows` (see rl.objective.probe_rows); kl_mask marks the positions whose logits
    generated a response token. A probe without such a position is an error naming the step (the controller
    would otherwise take an unmeasured full step)."""
    tokens = rollout.tokens[rows]
    response = rollout.response_mask[rows]
    if not bool(jnp.any(response)):  # a replicated scalar: every process of a multi-process run agrees
        raise ValueError(f"RL step {step}: the predicted-KL probe responses (rollout rows {rows.tolist()}) hold no "
                         "generated token, so the step's KL cannot be predicted")
    prompt_len = rollout.prompt_mask.shape[1]
    kl_mask = jnp.zeros(tokens.shape, bool).at[:, prompt_len - 1:-1].set(response)
    return {"tokens": tokens, "attention_mask": rollout.attention_mask()[rows], "kl_mask": kl_mask}


def train_and_evaluate(config: RunConfig | Mapping[str, Any], workdir: str | Path, *,
                       reward_fn: RewardFn | None = None) -> dict[str, float]:
    """Run the configured RL post-training in `workdir` (created; resumed when it holds a checkpoint).

    reward_fn: (response text, Problem) -> float replacing the task's outcome reward (time-limited like it; a
    call that raises or runs too long scores 0 and is counted in the `reward_failures` metric).

    Resuming: the newest checkpoint (or `train.resume_step`; with `train.resume_fallback` the newest readable
    one, loudly) is restored when the config's RESUME_FIXED fields (logra_jax.job.lifecycle) equal the saved run's;
    other changed fields are logged. A finished run (summary.json and a checkpoint at `train.steps`) is not
    re-run. SIGTERM / SIGINT stop the run at the next step boundary after a checkpoint (RunPreempted). log.txt
    ends with a `stopped:` line saying why the run ended.

    Returns:
      Summary: accuracy_before / accuracy_after (held-out greedy; before = after the SFT warm start), steps,
      seconds, prompt_length, and sft: the warm start's record (steps, final_loss, last_loss, cached; None
      without one).

    Raises:
      ValueError: invalid config (names the field and value), a config change that a checkpoint cannot take,
        `train.steps` below the newest checkpoint, a mesh larger than the devices, or a KL probe without
        generated tokens (names the step).
      metrics.NonFiniteMetricError: a guarded metric became NaN/inf (names the step and metric).
      KLRefusalError: the KL controller refused 3 consecutive updates (non-finite or negative predicted q).
      sft.WarmStartError: the SFT warm start ended above config.sft.max_final_loss (names the seed and the loss).
      lifecycle.RunPreempted: a SIGTERM / SIGINT stopped the run (after checkpointing the step it names).
      checkpoint.CheckpointError / FileNotFoundError: an unwritable checkpoint directory, a failed save, or an
        unreadable checkpoint (names the directory, the step and what to set to resume from another one).
    """
    run = config if isinstance(config, RunConfig) else RunConfig.from_dict(config)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    multi = jax.process_count() > 1  # process 0 writes the log, metrics, plots and summary; all log errors
    log = metrics_lib.Logger(workdir, primary=multihost.is_primary(),
                             label=f"process {jax.process_index()}" if multi else "")
    with StopRequests() as stop:
        try:
            summary = _train_and_evaluate(run, workdir, log, stop, reward_fn)
        except RunPreempted as e:
            log(f"stopped: preempted: {e}; run the same command again to resume", everywhere=True)
            raise
        except metrics_lib.NonFiniteMetricError as e:
            log(f"stopped: {e}", everywhere=True)
            raise
        except BaseException as e:
            log(f"stopped: error: {type(e).__name__}: {e}", everywhere=True)
            raise
    return summary


def _check_devices(run: RunConfig) -> None:
    """The mesh must fit the devices this process sees; a multi-process run's mesh spans every process's
    devices, and its rollouts stay on that mesh (checked before any work)."""
    t = run.train
    needed = job_mesh(t).size  # raises when the sizes do not fit the devices
    sizes = f"config.train.mesh_data × mesh_fsdp × mesh_tensor = {t.mesh_data} × {t.mesh_fsdp} × {t.mesh_tensor}"
    processes = jax.process_count()
    if processes > 1 and needed != jax.device_count():
        raise ValueError(f"{sizes} = {needed} devices, but the {processes} processes of this run have "
                         f"{jax.device_count()} ({jax.local_device_count()} each); a multi-process run's mesh "
                         "must span all of them")
    if processes > 1 and run.rollout.workers:
        raise ValueError(f"config.rollout.workers = {run.rollout.workers}: a separate rollout worker process is "
                         f"for single-process runs; with {processes} processes use rollout.workers = 0 (the "
                         "colocated engine on the global mesh)")
    if processes > 1 and run.rollout.engine == "vllm":
        raise ValueError("config.rollout.engine = 'vllm': the vLLM engine serves single-process runs; with "
                         f"{processes} processes use rollout.engine = 'jax'")


def _log_finished(log: metrics_lib.Logger, workdir: Path, summary: dict[str, Any], evidence: str) -> None:
    """Say that the run in `workdir` is finished, what it measured, and how to train again."""
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        log(f"held-out accuracy after RL: {after:.3f} (before: {before:.3f}), from {workdir / 'summary.json'}")
    log(f"stopped: the run in {workdir} already finished {summary.get('steps')} steps ({evidence}); nothing to do "
        f"(to train again, remove {workdir} or pass another --workdir; to train longer, raise train.steps)")


def _resume_plan(run: RunConfig, workdir: Path, ckpt: CheckpointManager, log: metrics_lib.Logger
                 ) -> tuple[list[int], dict[str, Any] | None]:
    """Which checkpoints to try (newest first) and, for a finished run, its summary (then nothing is to be done).

    Also checks the saved config against this one and records this start (config.json, config_history.jsonl).
    """
    steps = ckpt.all_steps()
    summary_path = workdir / "summary.json"
    summary = read_json(summary_path, "run summary") if summary_path.exists() else None
    current = run.to_dict()
    record = record_config if multihost.is_primary() else (lambda *args, **kwargs: None)
    if not steps:
        if summary is not None:  # finished without checkpoints: nothing to continue from
            if summary.get("steps") == run.train.steps:
                _log_finished(log, workdir, summary, "summary.json")
                return [], summary
            raise ValueError(f"config.train.steps = {run.train.steps}: the run in {workdir} finished "
                             f"{summary.get('steps')} steps without checkpoints (train.checkpoint_every = 0), so it "
                             "cannot be continued; use a new workdir")
        record(workdir, current, start_step=0, changes=None)
        return [], None
    config_path = workdir / "config.json"
    changes = check_resume(read_json(config_path, "saved config"), current, str(workdir)) \
        if config_path.exists() else {}
    if run.train.resume_step >= 0:
        if run.train.resume_step not in steps:
            raise ValueError(f"config.train.resume_step = {run.train.resume_step}: no checkpoint of that step in "
                             f"{ckpt.directory} (steps on disk: {steps})")
        candidates = [run.train.resume_step]
    else:
        candidates = steps[::-1] if run.train.resume_fallback else [steps[-1]]
    if candidates[0] > run.train.steps:
        raise ValueError(f"config.train.steps = {run.train.steps} is below the step of the checkpoint to resume "
                         f"({ckpt.step_dir(candidates[0])}); raise train.steps, set train.resume_step, or use a "
                         "new workdir")
    if candidates[0] == run.train.steps and summary is not None and summary.get("steps") == run.train.steps:
        _log_finished(log, workdir, summary, f"summary.json, checkpoint {candidates[0]}")
        return [], summary
    if changes:
        log(f"resuming with a changed config: {describe_changes(changes)}")
    record(workdir, current, start_step=candidates[0], changes=changes)
    return candidates, None


def _train_and_evaluate(run: RunConfig, workdir: Path, log: metrics_lib.Logger, stop: StopRequests,
                        reward_fn: RewardFn | None) -> dict[str, float]:
    _check_devices(run)
    ckpt = CheckpointManager(workdir / "checkpoints", keep=run.train.keep_checkpoints,  # checks it is writable
                             save_every=run.train.checkpoint_every or run.train.steps + 1)
    with contextlib.ExitStack() as opened:  # closed in reverse order; quietly when an error is on its way out
        _closes(opened, ckpt)
        return _run(run, workdir, log, stop, reward_fn, ckpt, opened)


@dataclasses.dataclass
class _Start:
    """What the start phase made: the mesh, the model in its shards (abstract when a resumed run needs no starting
    weights), its tokenizer, the tasks and the prompt encoding."""

    mesh: jax.sharding.Mesh
    model: Any
    tokenizer: Any
    tasks: Any
    fmt: PromptFormat
    prompt_len: int


def _start(run: RunConfig, workdir: Path, log: metrics_lib.Logger, resume_step: int | None) -> _Start:
    """Phase "start": the mesh over every device the config names (`phases.job_mesh`), and the model created or
    read straight into its shards (`builders.build_model`). A resumed run reads the starting weights only when the
    KL penalty's reference (the SFT weights) needs them; otherwise its weights come from its checkpoint."""
    mesh = job_mesh(run.train)
    weights = resume_step is None or run.algorithm.kl_beta > 0
    stats = LoadStats()
    model, tokenizer = build_model(run.model, mesh, weights=weights, stats=stats)
    if run.model.checkpoint and weights:
        log(f"loaded {run.model.checkpoint} into a {'×'.join(map(str, mesh.devices.shape))} (data×fsdp×tensor) "
            f"mesh: this process read {stats.bytes_read / 2**20:.1f} of {stats.bytes_total / 2**20:.1f} MiB",
            everywhere=True)
    fmt = PromptFormat(run.task.prompt_style)
    with multihost.primary_first("prepare the task data"):  # process 0 writes the tfds files, the others read
        tasks = build_tasks(run.task, run.sft, workdir / "data")
    prompt_len = max_prompt_length([*tasks.train_problems, *tasks.eval_problems, *tasks.sft_problems],
                                   tokenizer, fmt)
    check_optimizer_fits(run.optimizer, model)
    return _Start(mesh, model, tokenizer, tasks, fmt, prompt_len)


def _warm_start(run: RunConfig, job: _Start, log: metrics_lib.Logger, stop: StopRequests,
                resume_step: int | None) -> dict[str, Any] | None:
    """Phase "warm start": the SFT steps on the mesh (weights, AdamW moments and batch rows in their shards),
    or its cached weights. A resumed run repeats it (deterministic) only for the KL penalty's reference.

    Returns:
      The warm start's record (steps, final_loss, last_loss, cached) for summary.json and the checkpoints; None
      when it did not run.

    Raises:
      sft.WarmStartError: its final loss is above config.sft.max_final_loss (names the seed and the loss).
    """
    if not run.sft.steps or (resume_step is not None and run.algorithm.kl_beta <= 0):
        return None
    again = "" if resume_step is None else " again, for the KL penalty's reference policy"
    log(f"SFT warm start{again}: {run.sft.steps} steps on {len(job.tasks.sft_problems)} easier problems")
    sft_len = job.prompt_len + run.rollout.max_new_tokens

    def stop_during_sft(step: int, metrics: dict[str, float]) -> None:
        del metrics
        if stop.signum is not None:
            raise RunPreempted(stop.signum, None, f" during the SFT warm start (at SFT step {step + 1}; SFT is "
                                                  "not checkpointed, so the next run repeats it)")

    warm_start = lambda: supervised_warm_start(job.model, job.tokenizer, job.fmt, job.tasks.sft_problems, run.sft,
                                               sft_len, seed=run.train.seed, on_step=stop_during_sft, mesh=job.mesh)
    if run.sft.cache_dir:  # the warm start depends only on these: compute it once, start every run from it
        settings = run.to_dict()
        # Where the weights are stored and the check applied to them are not what they are.
        key = {"model": settings["model"], "task": settings["task"], "seed": run.train.seed, "length": sft_len,
               "sft": {k: v for k, v in settings["sft"].items() if k not in ("cache_dir", "max_final_loss")}}
        sft, cached = cached_warm_start(job.model, warm_start, run.sft.cache_dir, key)
        if cached:
            log(f"SFT weights loaded from the cache in {run.sft.cache_dir}")
    else:
        sft, cached = warm_start(), False
    record = {"steps": run.sft.steps, "final_loss": check_warm_start(sft, run.sft, run.train.seed),
              "last_loss": sft["sft_loss"], "cached": cached}
    log(f"SFT done: final loss {record['final_loss']:.4f} (mean of the last {final_window(run.sft.steps)} steps; "
        f"last step {record['last_loss']:.4f})")
    return record


def _run(run: RunConfig, workdir: Path, log: metrics_lib.Logger, stop: StopRequests, reward_fn: RewardFn | None,
         ckpt: CheckpointManager, opened: contextlib.ExitStack) -> dict[str, Any]:
    """The job's phases in order (`python -m logra_jax.plan` measures the same ones): start, warm start, trainer
    (init or restore, rollout engine, evaluation), the RL loop, finish."""
    wall_start = time.perf_counter()
    candidates, finished = _resume_plan(run, workdir, ckpt, log)
    multihost.barrier("resume plan")  # every process has read the saved config before process 0 rewrote it
    if finished is not None:
        return finished
    resume_step = candidates[0] if candidates else None
    job = _start(run, workdir, log, resume_step)
    log(metrics_lib.describe_device_balance("start"))
    writer = metrics_lib.MetricsWriter(workdir) if multihost.is_primary() else metrics_lib.NullWriter()
    _closes(opened, writer)
    if resume_step is None:
        writer.truncate_after(-1)  # lines of a run killed before its first checkpoint
    sft = _warm_start(run, job, log, stop, resume_step)
    if sft is not None:
        log(metrics_lib.describe_device_balance("the warm start"))
    t = _trainer(run, job, ckpt, candidates, workdir, log, writer, opened)
    if sft is not None:  # a resumed run that repeated it; otherwise the checkpoint's record stands
        t.warm_start = sft
    _rl_loop(run, job, t, log, stop, reward_fn, ckpt, writer, opened)
    return _finish(run, workdir, t, log, writer, opened, wall_start)


@dataclasses.dataclass
class _LoopState:
    """The trainer phase's products, which the RL loop advances: the train state on the mesh (state, rest, the
    advantage estimator's state), the data iterator, the jitted step with its shardings, the KL reference, the
    rollout engine and its policy sync, and the held-out evaluation."""

    job: _Start
    state: Any
    rest: Any
    estimator: Any
    est_state: Any
    plan: Any
    step_fn: Any
    batch_sh: Any
    probe_sh: Any
    mine: _ProcessRows
    data_iter: Any
    ref_logprobs: Any
    engine: RolloutEngine
    greedy: SamplingConfig
    start: int
    accuracy_before: float = float("nan")
    warm_start: dict[str, Any] | None = None  # `_warm_start`'s record (a resumed run: its checkpoint's)

    def evaluate(self, run: RunConfig, log: metrics_lib.Logger, show: str = "") -> float:
        """Held-out greedy accuracy with the trainer's current weights, decoded by the rollout engine (which holds
        them after every update); with `show`, log the first problems' greedy responses under that label."""
        job, rows = self.job, run.rollout.prompts_per_step * run.rollout.num_samples
        rows_sh = batch_shardings(jax.ShapeDtypeStruct((rows, job.prompt_len), jnp.int32), job.mesh)

        def greedy_on_mesh(prompts: np.ndarray, mask: np.ndarray, key: jax.Array) -> Any:
            prompts, mask = to_global((prompts, mask), (rows_sh, rows_sh))
            out = self.engine.generate(prompts, mask, key, config=self.greedy)
            return jax.device_put(out, replicated(job.mesh)) if jax.process_count() > 1 else out

        accuracy, responses = greedy_accuracy(greedy_on_mesh, job.tasks.eval_problems, job.tokenizer, job.fmt,
                                              job.prompt_len, rows)
        for problem, response in list(zip(job.tasks.eval_problems, responses))[:EXAMPLES_SHOWN] if show else ():
            log(f"  {show}: {problem.question!r} (answer {problem.answer}) → {response.strip()[:200]!r}")
        return accuracy


def _trainer(run: RunConfig, job: _Start, ckpt: CheckpointManager, candidates: list[int], workdir: Path,
             log: metrics_lib.Logger, writer: Any, opened: contextlib.ExitStack) -> _LoopState:
    """Phase "trainer": the optimizer state created in its shards from the (donated) weights, or a checkpoint
    restored into abstract shapes (nothing materialised first); the KL reference (a copy of the starting weights
    on the mesh); the rollout engine (the colocated one keeps its weights in the trainer's shardings) fed by
    low-rank policy sync; the held-out accuracy before RL."""
    mesh, prompt_len = job.mesh, job.prompt_len
    trainer = Trainer.build(run, job.model, mesh)
    estimator = advantage_estimator(run.algorithm.estimator, group_size=run.rollout.num_samples,
                                    **run.algorithm.estimator_options())
    est_state = to_global(estimator.init(), replicated(mesh))
    ref_params = None
    if run.algorithm.kl_beta > 0:
        # The reference policy: the weights RL starts from (after any SFT), on the mesh, stored as the trainer
        # stores its own (optimizer.weight_dtype): the policy at step 0, bit for bit, at the policy's bytes.
        ref_params = jax.tree.map(lambda w, a: w.astype(a.dtype) if w.dtype != a.dtype else jnp.copy(w),
                                  nnx.state(job.model, nnx.Param), trainer.abstract_state.params)
    resume_step = candidates[0] if candidates else None
    if resume_step is None:
        _, params, rest = nnx.split(job.model, nnx.Param, ...)
        state, rest = trainer.init(params, rest)
        del params
    else:
        rest = trainer.rest_only()
        abstract = (abstract_sharded(trainer.abstract_state, trainer.state_sh),
                    abstract_sharded(est_state, jax.tree.map(lambda _: replicated(mesh), est_state)))
        (state, est_state), data_state, extra, resume_step = _restore(ckpt, candidates, abstract, workdir, log)
    job.model = None  # its weights are the state's now (donated), or were never read
    log(metrics_lib.describe_device_balance("the optimizer's init" if resume_step is None else "the restore"))
    step_fn, batch_shapes, probe_shapes = trainer.rl_step(run, mesh, prompt_len)
    # Each process reads, samples and scores only the prompts of its own rows of every global batch.
    mine = _ProcessRows(run, mesh, prompt_len)
    data_iter = iter(job.tasks.train_batches(run.rollout.prompts_per_step, seed=run.train.seed, part=mine.part))
    ref_logprobs = None
    if ref_params is not None:
        ref_fn = reference_logprobs(trainer, run, mesh, prompt_len)
        ref_logprobs = lambda b: ref_fn(ref_params, rest, {k: b[k] for k in ("tokens", "attention_mask")})
    tokenizer = job.tokenizer
    vllm = {}
    if run.rollout.engine == "vllm":  # vLLM builds its model from a Hugging Face folder; weights then come by sync
        folder = export(trainer.model(state.params, rest), None, workdir / "vllm_model", overwrite=True)
        vllm = {"vllm": run.rollout.vllm_settings(), "model_dir": str(folder)}
    engine = rollout_engine(run.rollout.workers, trainer.model().config,
                            run.rollout.sampling(tokenizer.eos_id, tokenizer.pad_id), mesh, state.params, rest,
                            version=int(state.step), trained=trainer.plan.dense_paths(state.params),
                            decode_tensor=run.rollout.decode_tensor, per_layer=run.rollout.per_layer, **vllm)
    _closes(opened, engine)
    greedy = run.rollout.sampling(tokenizer.eos_id, tokenizer.pad_id, greedy=True)
    t = _LoopState(job, state, rest, estimator, est_state, trainer.plan, step_fn,
                 batch_shardings(batch_shapes, mesh),
                 None if probe_shapes is None else batch_shardings(probe_shapes, mesh), mine, data_iter,
                 ref_logprobs, engine, greedy, start=resume_step or 0)
    if resume_step is not None:
        data_iter.set_state(data_state)
        writer.truncate_after(resume_step)
        t.accuracy_before = extra["accuracy_before"]
        t.warm_start = extra.get("sft")  # absent from checkpoints written before the record was kept
        log(f"resumed from checkpoint step {resume_step}")
    else:
        t.accuracy_before = t.evaluate(run, log, show="before RL")
        log(f"held-out accuracy before RL: {t.accuracy_before:.3f} ({len(job.tasks.eval_problems)} problems)")
        writer.write(0, {"eval_accuracy": t.accuracy_before})
    return t


class _Scored(NamedTuple):
    """One step's rollout, scored: the rollout (rows over the batch axes), this process's rewards and the reward
    failures, and the advantages."""

    rollout: Any
    local_rewards: np.ndarray
    reward_stats: Any
    advantages: jax.Array


def _rollout_and_score(run: RunConfig, job: _Start, t: _LoopState, step: int, base_key: jax.Array,
                       reward_cfg: RewardConfig, reward_fn: RewardFn | None) -> _Scored:
    """The step's prompts (this process's), the engine's rollout, the rewards (each process decodes and scores its
    own rows) and the advantages (estimator state advanced)."""
    n = run.rollout.num_samples
    problems = next(t.data_iter)  # this process's prompts (all of them in a single-process run)
    prompts, mask = encode_prompts(problems, job.tokenizer, job.fmt, job.prompt_len)
    prompts, mask = t.mine.global_prompts(np.asarray(prompts)), t.mine.global_prompts(np.asarray(mask))
    rollout = t.engine.generate(prompts, mask, jax.random.fold_in(base_key, step))
    rollout = jax.device_put(rollout, batch_shardings(rollout, job.mesh))  # rows over the batch axes
    texts = decode_responses(local_rows(rollout.tokens), local_rows(rollout.response_mask), job.tokenizer,
                             job.prompt_len)
    local_rewards, reward_stats = score_responses([job.fmt.scoring_text(x) for x in texts],
                                                  t.mine.row_problems(problems), config=reward_cfg,
                                                  reward_fn=reward_fn)
    rewards = global_rows(np.asarray(local_rewards, np.float32), rollout.lengths.sharding,
                          (run.rollout.prompts_per_step * n,))
    lengths = {"lengths": rollout.lengths} if run.algorithm.whiten == "token" else {}
    advantages, t.est_state = t.estimator.update(rewards, t.est_state, **lengths)
    if run.algorithm.dynamic_sampling:
        advantages = advantages * dynamic_sampling_mask(rewards, n)
    return _Scored(rollout, np.asarray(local_rewards, np.float64), reward_stats, advantages)


def _train_and_publish(run: RunConfig, t: _LoopState, scored: _Scored, step: int) -> dict[str, float]:
    """The jitted train step on the scored rollout (KL reference and KL probe as configured), then the engine
    brought to the new weights; the step's metrics with the sync's. The engine releases its copy of the weights
    first (the colocated engine's bf16 copy need not sit beside the train step's peak; publish rebuilds it)."""
    t.engine.release()
    batch = _rl_batch(scored.rollout, scored.advantages)
    if t.ref_logprobs is not None:
        batch["ref_logprobs"] = t.ref_logprobs(batch)
    probe = None
    if t.plan.kl_probe is not None:
        rows = probe_rows(run.rollout.prompts_per_step, run.rollout.num_samples, run.optimizer.probe_responses,
                          (run.train.seed, step))
        probe = _probe_batch(scored.rollout, rows, step + 1)
    # Into the step's own shardings (rows over the batch axes): the eager gathers and reductions above leave
    # their results in shardings of XLA's choosing, and jit does not reshard a global array.
    batch = jax.device_put(batch, t.batch_sh)
    probe = None if probe is None else jax.device_put(probe, t.probe_sh)
    t.state, out, updates = t.step_fn(t.state, t.rest, batch, probe)
    # Wait for the step (its metrics) before timing the sync, so that sync_time is the sync's own.
    out = {k: float(v) for k, v in jax.device_get(out).items()}
    report = t.engine.publish(updates, t.state.params)
    out.update(sync_bytes=float(report.nbytes), sync_time=report.seconds, sync_resyncs=float(t.engine.resyncs))
    return out


def _rollout_metrics(run: RunConfig, t: _LoopState, scored: _Scored, reward_cfg: RewardConfig) -> dict[str, float]:
    """Reward, accuracy, response length, truncation and reward failures over every process's rows."""
    n_rows = run.rollout.prompts_per_step * run.rollout.num_samples
    rewards, rollout = scored.local_rewards, scored.rollout
    sums = multihost.gather(np.array([
        rewards.sum(), (rewards >= reward_cfg.correct).sum(), local_rows(rollout.lengths).sum(),
        local_rows(rollout.finished).sum(), scored.reward_stats.num_failed + scored.reward_stats.num_timed_out],
        np.float64) * t.mine.counts_rows).sum(axis=0)
    return {"reward_mean": float(sums[0] / n_rows), "accuracy": float(sums[1] / n_rows),
            "response_length": float(sums[2] / n_rows), "truncated": float(1.0 - sums[3] / n_rows),
            "reward_failures": float(sums[4])}


def _guard(out: dict[str, float], step: int, refusals: int, log: metrics_lib.Logger) -> int:
    """Stop on a non-finite metric (naming it) or on MAX_CONSECUTIVE_REFUSALS refused updates in a row; returns
    the refusals in a row after this step."""
    if not out.get("kl_refused"):
        metrics_lib.check_finite(step + 1, out, GUARDED)
        return 0
    refusals += 1
    log(f"RL step {step + 1}: the KL controller refused the update (predicted q = {out['kl_q']}); "
        f"nothing was changed ({refusals} in a row, {int(out['kl_skipped'])} in all)")
    if refusals >= MAX_CONSECUTIVE_REFUSALS:
        raise KLRefusalError(f"RL step {step + 1}: the KL controller refused {refusals} consecutive "
                             f"updates (last predicted q = {out['kl_q']}); stopping")
    metrics_lib.check_finite(step + 1, out, tuple(m for m in GUARDED if m != "kl_q"))
    return refusals


def _checkpoint_or_stop(run: RunConfig, t: _LoopState, step: int, stop: StopRequests,
                        ckpt: CheckpointManager) -> None:
    """Called every step: the manager saves every `checkpoint_every` steps and on JAX's preemption notice; the
    final step and a stop request (SIGTERM / SIGINT, on any process: every process stops at this step) always
    save when checkpoints are on, and a stop request then raises RunPreempted."""
    last = step + 1 == run.train.steps
    signum = int(multihost.gather(np.int32(stop.signum or 0)).max()) or None
    must = signum is not None or (last and run.train.checkpoint_every > 0)
    ckpt.save(step + 1, (t.state, t.est_state), data_state=t.data_iter.get_state(),
              extra={"accuracy_before": t.accuracy_before, "sft": t.warm_start},
              force=must and not ckpt.should_save(step + 1))
    ckpt.check_for_errors()  # a failed background save stops the run here, naming the directory
    if signum is not None and not last:
        ckpt.wait_until_finished()
        raise RunPreempted(signum, step + 1)


def _rl_loop(run: RunConfig, job: _Start, t: _LoopState, log: metrics_lib.Logger, stop: StopRequests,
             reward_fn: RewardFn | None, ckpt: CheckpointManager, writer: Any, opened: contextlib.ExitStack) -> None:
    """Phase "RL loop": per step, rollout → rewards → advantages → the jitted train step (KL probe) → policy
    sync → metrics (stop on a non-finite one) → periodic evaluation and checkpoint; a stop request checkpoints
    and raises RunPreempted."""
    base_key = jax.random.key(run.train.seed)
    start = t.start  # loop steps; state.step counts applied updates (a refused step applies none)
    progress = metrics_lib.Progress(run.train.steps, initial=start, desc="RL",
                                    **({} if multihost.is_primary() else {"stream": io.StringIO(), "tty": False}))
    _closes(opened, progress)
    reward_cfg = RewardConfig(correct=run.algorithm.reward_correct, incorrect=run.algorithm.reward_incorrect,
                              format_weight=run.algorithm.format_weight)
    refusals = 0
    for step in range(start, run.train.steps):
        t0 = time.perf_counter()
        scored = _rollout_and_score(run, job, t, step, base_key, reward_cfg, reward_fn)
        t_rollout = time.perf_counter() - t0
        out = _train_and_publish(run, t, scored, step)
        out.update(_rollout_metrics(run, t, scored, reward_cfg), rollout_time=t_rollout,
                   step_time=time.perf_counter() - t0, **metrics_lib.memory_stats())
        refusals = _guard(out, step, refusals, log)
        if run.train.eval_every and (step + 1) % run.train.eval_every == 0 and step + 1 < run.train.steps:
            out["eval_accuracy"] = t.evaluate(run, log)
        if (step + 1) % run.train.log_every == 0 or step + 1 == run.train.steps:
            writer.write(step + 1, out)
        progress.update(step + 1, out)
        if step == start:
            log(metrics_lib.describe_device_balance("the first RL step"))
        _checkpoint_or_stop(run, t, step, stop, ckpt)


def _finish(run: RunConfig, workdir: Path, t: _LoopState, log: metrics_lib.Logger, writer: Any,
            opened: contextlib.ExitStack,
            wall_start: float) -> dict[str, Any]:
    """Phase "finish": the held-out accuracy after RL, the last checkpoint and metrics closed, summary.json and
    the reward-curve PNG (process 0)."""
    accuracy_before, accuracy_after = t.accuracy_before, t.evaluate(run, log, show="after RL")
    steps_done = run.train.steps
    writer.write(steps_done, {"eval_accuracy": accuracy_after})
    opened.close()  # the final checkpoint written, the metrics file complete
    summary = {"accuracy_before": accuracy_before, "accuracy_after": accuracy_after, "steps": steps_done,
               "seconds": time.perf_counter() - wall_start, "prompt_length": t.job.prompt_len, "sft": t.warm_start}
    if multihost.is_primary():
        write_json_atomic(workdir / "summary.json", summary)
        metrics_lib.plot_curves(workdir / "metrics.jsonl", ["reward_mean", "accuracy", "eval_accuracy"],
                                workdir / "reward_curve.png",
                                title=f"RL with {run.optimizer.name}: held-out accuracy {accuracy_before:.2f} → "
                                      f"{accuracy_after:.2f}")
    multihost.barrier("summary written")  # a finished run is finished for every process
    log(f"held-out accuracy after RL: {accuracy_after:.3f} (before: {accuracy_before:.3f}); "
        f"{summary['seconds']:.0f} s")
    log(f"stopped: finished {steps_done} steps")
    return summary


class _ProcessRows:
    """Which rows of every global batch this process holds: its prompts (read by its own data iterator), and the
    rollout rows sampled from them (num_samples per prompt, adjacent). All rows in a single-process run.

    Raises:
      ValueError: a mesh whose device order gives a process a non-contiguous block of rows, or rollout rows
        whose prompts another process holds.
    """

    def __init__(self, run: RunConfig, mesh: jax.sharding.Mesh, prompt_len: int):
        self.batch = run.rollout.prompts_per_step
        self.n = run.rollout.num_samples
        self.prompt_shape = (self.batch, prompt_len)
        self.prompt_sh = batch_shardings(jax.ShapeDtypeStruct(self.prompt_shape, jnp.int32), mesh)
        self.prompts = process_rows(self.prompt_sh, self.prompt_shape)
        rollout_sh = batch_shardings(jax.ShapeDtypeStruct((self.batch * self.n,), jnp.int32), mesh)
        self.rollout = process_rows(rollout_sh, (self.batch * self.n,))
        start, stop = self.prompts
        size = stop - start
        if self.batch % size or start % size:
            raise ValueError(f"config.rollout.prompts_per_step = {self.batch}: process {jax.process_index()} "
                             f"holds prompt rows [{start}, {stop}), not an equal part of the batch")
        first, last = self.rollout[0] // self.n, (self.rollout[1] - 1) // self.n
        if first < start or last >= stop:
            raise ValueError(f"process {jax.process_index()} holds rollout rows [{self.rollout[0]}, "
                             f"{self.rollout[1]}) but only the prompts [{start}, {stop}) they come from; make "
                             f"config.rollout.prompts_per_step = {self.batch} a multiple of the mesh's "
                             "data × fsdp devices")
        self.part = (start // size, self.batch // size)
        # Processes whose devices hold the same rows (a mesh axis across processes that does not split rows, e.g.
        # tensor) all score them; the lowest of them counts them in the step's metrics.
        spans = multihost.gather(np.asarray(self.rollout))
        self.counts_rows = not any(tuple(spans[q]) == self.rollout for q in range(jax.process_index()))

    def global_prompts(self, local: np.ndarray) -> jax.Array:
        """The [prompts_per_step, P] global array of which `local` are this process's rows."""
        return global_rows(local, self.prompt_sh, self.prompt_shape)

    def row_problems(self, problems: list[Any]) -> list[Any]:
        """The problem of each rollout row this process holds (`problems`: its prompts' problems)."""
        return [problems[row // self.n - self.prompts[0]] for row in range(*self.rollout)]


def _restore(ckpt: CheckpointManager, candidates: list[int], abstract: Any, workdir: Path,
             log: metrics_lib.Logger) -> tuple[Any, dict[str, Any], dict[str, Any], int]:
    """Restore the first readable checkpoint of `candidates` (newest first); checkpoints newer than it are moved
    to workdir/checkpoints_set_aside (kept) so that the resumed run can write those steps again.

    Raises:
      CheckpointError: the (last) candidate is unreadable; the message says which config fields pick another.
    """
    for i, step in enumerate(candidates):
        e: CheckpointError | None = None
        try:
            tree, data_state, extra = ckpt.restore(step, abstract=abstract)
        except CheckpointError as error:
            e = error
        # Each process reads its own shards: all fall back (or stop) together when any could not read them.
        failing = np.flatnonzero(multihost.gather(np.int32(e is not None))).tolist()
        if failing:
            e = e or CheckpointError(f"checkpoint {ckpt.step_dir(step)} is unreadable on process(es) {failing}")
            others = [s for s in ckpt.all_steps() if s != step]
            if i + 1 < len(candidates):
                moved = ckpt.set_aside(step, workdir / "checkpoints_set_aside")
                log(f"WARNING: {e}; moved it to {moved} and falling back to checkpoint {candidates[i + 1]} "
                    "(config.train.resume_fallback)")
                continue
            hint = (f"; to resume from an older checkpoint set config.train.resume_step to one of {others} or "
                    "config.train.resume_fallback=True") if others else ""
            raise CheckpointError(f"{e}{hint}") from e
        for newer in [s for s in ckpt.all_steps() if s > step]:
            moved = ckpt.set_aside(newer, workdir / "checkpoints_set_aside")
            log(f"resuming from checkpoint {step}: the newer checkpoint {newer} was moved to {moved}")
        return tree, data_state, extra, step
    raise AssertionError("unreachable: no candidate checkpoints")


def _closes(stack: contextlib.ExitStack, resource: Any) -> Any:
    """Close `resource` when `stack` unwinds: normally on success, quietly while an error is on its way out (a
    second error, e.g. the failed save again, must not replace the first)."""
    def close(exc_type: Any, *_: Any) -> bool:
        if exc_type is None:
            resource.close()
        else:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                resource.close()
        return False

    stack.push(close)
    return resource


