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
import functools
import io
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.core.extras import requires_extra

if TYPE_CHECKING:
    import grain
    from jax.sharding import NamedSharding

    from logra_jax.job.builders import Tasks
    from logra_jax.job.optimizer_plan import OptimizerPlan
    from logra_jax.job.train_step import TrainState
    from logra_jax.models.decoder import Decoder
    from logra_jax.models.tokenizer import Tokenizer
    from logra_jax.rl.advantages import AdvantageEstimator
    from logra_jax.rl.rewards import RewardStats
    from logra_jax.rl.tasks import Problem

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
    from logra_jax.job.phases import Trainer, job_mesh, reference_logprobs, rollout_experts
    from logra_jax.job.pipeline import Batch, RolloutPipeline, pending_record, pending_tree, restore_pending
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
    from logra_jax.rollout.process import CPUS_ENV, WorkerError
    from logra_jax.rollout.sampling import Rollout, SamplingConfig

# Metrics that must stay finite: a NaN/inf here stops the run naming the step and the metric.
GUARDED = ("loss", "reward_mean", "grad_norm", "sketch_norm", "kl_realised", "kl_q")
# A step the KL controller refuses (non-finite or negative q) changes nothing and is counted; this many in a row
# stop the run, naming the step.
MAX_CONSECUTIVE_REFUSALS = 3
_Closable = TypeVar("_Closable")  # anything with a close() method
_T = TypeVar("_T")


class KLRefusalError(RuntimeError):
    """The predicted-KL controller refused MAX_CONSECUTIVE_REFUSALS updates in a row (the message names the step)."""


def _rl_batch(rollout: Rollout, advantages: np.ndarray, tis_cap: float | None = None) -> dict[str, jax.Array]:
    """The train step's batch; tis_cap: every row's cap of its importance weights (a stale batch's)."""
    extra = {} if rollout.experts is None else {"experts": rollout.experts}  # an MoE rollout's (phases.rl_step)
    if tis_cap is not None:
        extra["tis_cap"] = jnp.full(rollout.lengths.shape, tis_cap, jnp.float32)
    return {"tokens": rollout.tokens, "attention_mask": rollout.attention_mask(),
            "response_mask": rollout.response_mask, "advantages": jnp.asarray(advantages, jnp.float32),
            "rollout_logprobs": rollout.logprobs, "finished": rollout.finished, **extra}


EXAMPLES_SHOWN = 3  # held-out problems whose greedy responses the log shows before and after RL


def _probe_batch(rollout: Rollout, rows: np.ndarray, step: int) -> dict[str, jax.Array]:
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
    needed = job_mesh(t, trainer_devices(run)).size  # raises when the sizes do not fit the devices
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
    engine_devices = run.rollout.engine_devices
    if engine_devices and needed + engine_devices > jax.device_count():
        raise ValueError(f"config.rollout.engine_devices = {engine_devices}: with the trainer's {sizes} = "
                         f"{needed} devices that needs {needed + engine_devices}, but this process sees "
                         f"{jax.device_count()} ({jax.default_backend()})")
    if processes > 1 and (engine_devices or run.rollout.max_staleness):
        raise ValueError(f"config.rollout.engine_devices = {engine_devices}, max_staleness = "
                         f"{run.rollout.max_staleness}: an engine on devices of its own and the rollout pipeline "
                         f"are for single-process runs; this run has {processes} processes")
    if processes > 1 and run.rollout.engine == "vllm":
        raise ValueError("config.rollout.engine = 'vllm': the vLLM engine serves single-process runs; with "
                         f"{processes} processes use rollout.engine = 'jax'")


def trainer_devices(run: RunConfig) -> list[jax.Device]:
    """The devices of the trainer's mesh: all but the last rollout.engine_devices (the engine's own)."""
    devices = jax.devices()
    return devices[:len(devices) - run.rollout.engine_devices] if run.rollout.engine_devices else devices


def _log_finished(log: metrics_lib.Logger, workdir: Path, summary: dict[str, Any], evidence: str) -> None:
    """Say that the run in `workdir` is finished, what it measured, and how to train again."""
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        log(f"held-out accuracy after RL: {after:.3f} (before: {before:.3f}), from {workdir / 'summary.json'}")
    log(f"stopped: the run in {workdir} already finished {summary.get('steps')} steps ({evidence}); nothing to do "
        f"(to train again, remove {workdir} or pass another --workdir; to train longer, raise train.steps)")


@dataclasses.dataclass(frozen=True)
class _Context:
    """What the phases of one run share: its config and directory, the log, the stop requests, the reward
    function, the checkpoints, the stack that closes what the run opened, and the metrics writer (a NullWriter
    until `_run` has opened the real one, after the start phase)."""

    run: RunConfig
    workdir: Path
    log: metrics_lib.Logger
    stop: StopRequests
    reward_fn: RewardFn | None
    ckpt: CheckpointManager
    opened: contextlib.ExitStack
    writer: metrics_lib.MetricsWriter | metrics_lib.NullWriter = dataclasses.field(
        default_factory=metrics_lib.NullWriter)


def _resume_plan(ctx: _Context) -> tuple[list[int], dict[str, Any] | None]:
    """Which checkpoints to try (newest first) and, for a finished run, its summary (then nothing is to be done).

    Also checks the saved config against this one and records this start (config.json, config_history.jsonl).
    """
    run, workdir, ckpt, log = ctx.run, ctx.workdir, ctx.ckpt, ctx.log
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
    try:  # the checkpoint's own record of its config (older ones have none)
        saved = ckpt.read_extra(steps[-1]).get("config")
    except CheckpointError:  # unreadable: the restore names it (and falls back when asked to)
        saved = None
    if saved is not None:  # checkpoints moved beside another run's config.json, or without one, are caught here
        check_resume(saved, current, f"{workdir} (checkpoint {steps[-1]})")
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
    ckpt = CheckpointManager(workdir / "checkpoints", keep=run.train.keep_checkpoints, log=log,  # checks writable
                             save_every=run.train.checkpoint_every or run.train.steps + 1)
    with contextlib.ExitStack() as opened:  # closed in reverse order; quietly when an error is on its way out
        _closes(opened, ckpt)
        return _run(_Context(run, workdir, log, stop, reward_fn, ckpt, opened))


@dataclasses.dataclass
class _Start:
    """What the start phase made: the mesh, the model in its shards (abstract when a resumed run needs no starting
    weights), its tokenizer, the tasks and the prompt encoding."""

    mesh: jax.sharding.Mesh
    model: Decoder | None  # None once the trainer phase holds its weights
    tokenizer: Tokenizer
    tasks: Tasks
    fmt: PromptFormat
    prompt_len: int


def _start(ctx: _Context, resume_step: int | None) -> _Start:
    """Phase "start": the mesh over every device the config names (`phases.job_mesh`), and the model created or
    read straight into its shards (`builders.build_model`). A resumed run reads the starting weights only when the
    KL penalty's reference (the SFT weights) needs them; otherwise its weights come from its checkpoint."""
    run, log = ctx.run, ctx.log
    mesh = job_mesh(run.train, trainer_devices(run))
    weights = resume_step is None or run.algorithm.kl_beta > 0
    stats = LoadStats()
    model, tokenizer = build_model(run.model, mesh, weights=weights, stats=stats)
    if run.model.checkpoint and weights:
        log(f"loaded {run.model.checkpoint} into a {'×'.join(map(str, mesh.devices.shape))} (data×fsdp×tensor) "
            f"mesh: this process read {stats.bytes_read / 2**20:.1f} of {stats.bytes_total / 2**20:.1f} MiB",
            everywhere=True)
    fmt = PromptFormat(run.task.prompt_style)
    with multihost.primary_first("prepare the task data"):  # process 0 writes the tfds files, the others read
        tasks = build_tasks(run.task, run.sft, ctx.workdir / "data")
    prompt_len = max_prompt_length([*tasks.train_problems, *tasks.eval_problems, *tasks.sft_problems],
                                   tokenizer, fmt)
    check_optimizer_fits(run.optimizer, model)
    return _Start(mesh, model, tokenizer, tasks, fmt, prompt_len)


def _warm_start(ctx: _Context, job: _Start, resume_step: int | None) -> dict[str, Any] | None:
    """Phase "warm start": the SFT steps on the mesh (weights, AdamW moments and batch rows in their shards),
    or its cached weights. A resumed run repeats it (deterministic) only for the KL penalty's reference.

    Returns:
      The warm start's record (steps, final_loss, last_loss, cached) for summary.json and the checkpoints; None
      when it did not run.

    Raises:
      sft.WarmStartError: its final loss is above config.sft.max_final_loss (names the seed and the loss).
    """
    run, log, stop = ctx.run, ctx.log, ctx.stop
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


def _run(ctx: _Context) -> dict[str, Any]:
    """The job's phases in order (`python -m logra_jax.plan` measures the same ones): start, warm start, trainer
    (init or restore, rollout engine, evaluation), the RL loop, finish."""
    wall_start = time.perf_counter()
    candidates, finished = _resume_plan(ctx)
    multihost.barrier("resume plan")  # every process has read the saved config before process 0 rewrote it
    if finished is not None:
        return finished
    resume_step = candidates[0] if candidates else None
    job = _start(ctx, resume_step)
    ctx.log(metrics_lib.describe_device_balance("start"))
    writer = metrics_lib.MetricsWriter(ctx.workdir, log=ctx.log) if multihost.is_primary() else metrics_lib.NullWriter()
    ctx = dataclasses.replace(ctx, writer=_closes(ctx.opened, writer))
    if resume_step is None:
        writer.truncate_after(-1)  # lines of a run killed before its first checkpoint
    sft = _warm_start(ctx, job, resume_step)
    if sft is not None:
        ctx.log(metrics_lib.describe_device_balance("the warm start"))
    t = _trainer(ctx, job, candidates)
    if sft is not None:  # a resumed run that repeated it; otherwise the checkpoint's record stands
        t.warm_start = sft
    _rl_loop(ctx, t)
    return _finish(ctx, t, wall_start)


@dataclasses.dataclass
class _LoopState:
    """The trainer phase's products, which the RL loop advances: the train state on the mesh (state, rest, the
    advantage estimator's state), the data iterator, the jitted step with its shardings, the KL reference, the
    rollout engine and its policy sync, and the held-out evaluation."""

    job: _Start
    state: TrainState
    rest: nnx.State
    estimator: AdvantageEstimator
    est_state: Any  # the estimator's own pytree: () for the group estimators, a BaselineState for REINFORCE
    plan: OptimizerPlan
    step_fn: Callable[..., tuple[TrainState, dict[str, jax.Array], Any]]  # `RLStep.fn`
    batch_sh: dict[str, NamedSharding]
    probe_sh: dict[str, NamedSharding] | None
    mine: _ProcessRows
    data_iter: grain.DatasetIterator
    ref_logprobs: Callable[[Mapping[str, jax.Array]], jax.Array] | None
    engine: RolloutEngine
    pipeline: RolloutPipeline
    make_engine: Callable[[TrainState], RolloutEngine]  # a new engine on the trainer's weights (a restart)
    greedy: SamplingConfig
    start: int
    engine_failures: int = 0
    accuracy_before: float = float("nan")
    warm_start: dict[str, Any] | None = None  # `_warm_start`'s record (a resumed run: its checkpoint's)

    def evaluate(self, run: RunConfig, log: metrics_lib.Logger, show: str = "") -> float:
        """Held-out greedy accuracy with the trainer's current weights, decoded by the rollout engine (which holds
        them after every update); with `show`, log the first problems' greedy responses under that label."""
        job, rows = self.job, run.rollout.prompts_per_step * run.rollout.num_samples
        rows_sh = batch_shardings(jax.ShapeDtypeStruct((rows, job.prompt_len), jnp.int32), job.mesh)

        def greedy_on_mesh(prompts: np.ndarray, mask: np.ndarray, key: jax.Array) -> Rollout:
            prompts, mask = to_global((prompts, mask), (rows_sh, rows_sh))
            out = self.pipeline.generate_now(prompts, mask, key, config=self.greedy)
            return jax.device_put(out, replicated(job.mesh)) if jax.process_count() > 1 else out

        accuracy, responses = greedy_accuracy(greedy_on_mesh, job.tasks.eval_problems, job.tokenizer, job.fmt,
                                              job.prompt_len, rows)
        for problem, response in list(zip(job.tasks.eval_problems, responses))[:EXAMPLES_SHOWN] if show else ():
            log(f"  {show}: {problem.question!r} (answer {problem.answer}) → {response.strip()[:200]!r}")
        return accuracy


class _Restored(NamedTuple):
    """A checkpoint read back (`_restore`): its step, the data iterators' state, the record saved with it and the
    rollout pipeline's batches in flight (None: it saved none)."""

    step: int
    data_state: dict[str, Any]
    extra: dict[str, Any]
    pending: tuple[dict[str, jax.Array], ...] | None = None


def _trainer(ctx: _Context, job: _Start, candidates: list[int]) -> _LoopState:
    """Phase "trainer": the optimizer state created in its shards from the (donated) weights, or a checkpoint
    restored into abstract shapes (nothing materialised first); the KL reference (a copy of the starting weights
    on the mesh); the rollout engine (the colocated one keeps its weights in the trainer's shardings) fed by
    low-rank policy sync; the held-out accuracy before RL."""
    run, mesh = ctx.run, job.mesh
    trainer = Trainer.build(run, job.model, mesh)
    estimator = advantage_estimator(run.algorithm.estimator, group_size=run.rollout.num_samples,
                                    **run.algorithm.estimator_options())
    ref_params = _reference_params(run, job.model, trainer)  # before the init takes the weights
    state, rest, est_state, restored = _init_or_restore(ctx, trainer, job, candidates,
                                                        to_global(estimator.init(), replicated(mesh)))
    job.model = None  # its weights are the state's now (donated), or were never read
    ctx.log(metrics_lib.describe_device_balance("the optimizer's init" if restored is None else "the restore"))
    rl_step = trainer.rl_step(run, mesh, job.prompt_len)
    # Each process reads, samples and scores only the prompts of its own rows of every global batch.
    mine = _ProcessRows(run, mesh, job.prompt_len)
    data_iter = iter(job.tasks.train_batches(run.rollout.prompts_per_step, seed=run.train.seed, part=mine.part))
    ref_logprobs = None if ref_params is None else _reference_logprobs(run, trainer, job, ref_params, rest)
    engine = _closes(ctx.opened, _rollout_engine(ctx, trainer, job, state, rest))
    start = 0 if restored is None else restored.step
    pipeline = _closes(ctx.opened, RolloutPipeline(engine, run.rollout.max_staleness, start))
    if restored is not None and restored.pending is not None:
        restore_pending(pipeline, restored.extra["pipeline"], restored.pending)
    greedy = run.rollout.sampling(job.tokenizer.eos_id, job.tokenizer.pad_id, greedy=True)
    t = _LoopState(job=job, state=state, rest=rest, estimator=estimator, est_state=est_state, plan=trainer.plan,
                   step_fn=rl_step.fn, batch_sh=batch_shardings(rl_step.batch, mesh),
                   probe_sh=None if rl_step.probe is None else batch_shardings(rl_step.probe, mesh), mine=mine,
                   data_iter=data_iter, ref_logprobs=ref_logprobs, engine=engine, pipeline=pipeline,
                   make_engine=lambda st: _rollout_engine(ctx, trainer, job, st, rest), greedy=greedy, start=start)
    _resume_or_evaluate(ctx, t, restored)
    return t


def _reference_params(run: RunConfig, model: Decoder, trainer: Trainer) -> nnx.State | None:
    """The KL penalty's reference policy (None without the penalty): the weights RL starts from (after any SFT),
    on the mesh, stored as the trainer stores its own (optimizer.weight_dtype): the policy at step 0, bit for bit,
    at the policy's bytes."""
    if run.algorithm.kl_beta <= 0:
        return None
    return jax.tree.map(lambda w, a: w.astype(a.dtype) if w.dtype != a.dtype else jnp.copy(w),
                        nnx.state(model, nnx.Param), trainer.abstract_state.params)


def _init_or_restore(ctx: _Context, trainer: Trainer, job: _Start, candidates: list[int], est_state: Any
                     ) -> tuple[TrainState, nnx.State, Any, _Restored | None]:
    """(state, rest, estimator state, what was restored): created in their shards from the model's (donated)
    weights when there is no checkpoint to resume, else the first readable of `candidates` restored into
    abstract shapes (nothing materialised first), beside the sketch probes and digests made afresh."""
    if not candidates:
        _, params, rest = nnx.split(job.model, nnx.Param, ...)
        state, rest = trainer.init(params, rest)
        return state, rest, est_state, None
    rest = trainer.rest_only()
    abstract = (abstract_sharded(trainer.abstract_state, trainer.state_sh),
                abstract_sharded(est_state, jax.tree.map(lambda _: replicated(job.mesh), est_state)))

    def abstract_at(step: int) -> tuple[Any, ...]:
        record = ctx.ckpt.read_extra(step).get("pipeline")  # a pipelined run saved its batches in flight
        if record is None:
            return abstract
        rollout = _abstract_rollout(ctx.run, trainer.model().config, job.prompt_len, job.mesh)
        return (*abstract, tuple(rollout for _ in record["batches"]))

    tree, restored = _restore(ctx, candidates, abstract_at)
    if len(tree) == 3:
        restored = restored._replace(pending=tree[2])
    return tree[0], rest, tree[1], restored


def _abstract_rollout(run: RunConfig, config: Any, prompt_len: int, mesh: jax.sharding.Mesh
                      ) -> dict[str, jax.ShapeDtypeStruct]:
    """A step's rollout as the checkpoint holds it (`pipeline.pending_tree`): its fields' shapes, replicated."""
    rows, new = run.rollout.prompts_per_step * run.rollout.num_samples, run.rollout.max_new_tokens
    sh = replicated(mesh)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    fields = {"tokens": sds((rows, prompt_len + new), jnp.int32), "prompt_mask": sds((rows, prompt_len), jnp.bool_),
              "response_mask": sds((rows, new), jnp.bool_), "logprobs": sds((rows, new), jnp.float32),
              "lengths": sds((rows,), jnp.int32), "finished": sds((rows,), jnp.bool_)}
    experts = rollout_experts(config, run.rollout.engine)
    if experts is not None:
        layers, k, dtype = experts
        fields["experts"] = sds((rows, prompt_len + new, layers, k), dtype)
    return fields


def _reference_logprobs(run: RunConfig, trainer: Trainer, job: _Start, ref_params: nnx.State, rest: nnx.State
                        ) -> Callable[[Mapping[str, jax.Array]], jax.Array]:
    """batch -> the responses' per-token log-probs under the reference policy `ref_params` (jitted, sharded like
    the trainer's weights and the batch rows)."""
    fn = reference_logprobs(trainer, run, job.mesh, job.prompt_len)
    return lambda batch: fn(ref_params, rest, {k: batch[k] for k in ("tokens", "attention_mask")})


def _rollout_engine(ctx: _Context, trainer: Trainer, job: _Start, state: TrainState, rest: nnx.State
                    ) -> RolloutEngine:
    """The configured rollout engine on the trainer's weights, which low-rank policy sync then keeps current."""
    run, tokenizer = ctx.run, job.tokenizer
    vllm = {}
    if run.rollout.engine == "vllm":  # vLLM builds its model from a Hugging Face folder; weights then come by sync
        folder = export(trainer.model(state.params, rest), None, ctx.workdir / "vllm_model", overwrite=True)
        vllm = {"vllm": run.rollout.vllm_settings(), "model_dir": str(folder)}
    placement: dict[str, Any] = dict(vllm)
    if run.rollout.engine_devices:
        placement["engine_devices"] = jax.devices()[len(jax.devices()) - run.rollout.engine_devices:]
    if run.rollout.engine_cpus:
        placement["env"] = {CPUS_ENV: run.rollout.engine_cpus}
    return rollout_engine(run.rollout.workers, trainer.model().config,
                          run.rollout.sampling(tokenizer.eos_id, tokenizer.pad_id), job.mesh, state.params, rest,
                          version=int(state.step), trained=trainer.plan.dense_paths(state.params),
                          decode_tensor=run.rollout.decode_tensor, per_layer=run.rollout.per_layer, **placement)


def _resume_or_evaluate(ctx: _Context, t: _LoopState, restored: _Restored | None) -> None:
    """A resumed run takes back its data iterator's place, its metrics up to the checkpoint, its accuracy before
    RL and its warm-start record; a new run measures the held-out accuracy before RL (logged, and written as the
    metrics of step 0)."""
    if restored is not None:
        t.data_iter.set_state(restored.data_state)
        ctx.writer.truncate_after(restored.step)
        t.accuracy_before = restored.extra["accuracy_before"]
        t.warm_start = restored.extra.get("sft")  # absent from checkpoints written before the record was kept
        ctx.log(f"resumed from checkpoint step {restored.step}")
        return
    t.accuracy_before = t.evaluate(ctx.run, ctx.log, show="before RL")
    ctx.log(f"held-out accuracy before RL: {t.accuracy_before:.3f} ({len(t.job.tasks.eval_problems)} problems)")
    ctx.writer.write(0, {"eval_accuracy": t.accuracy_before})


class _Scored(NamedTuple):
    """One step's rollout, scored: the rollout (rows over the batch axes), this process's rewards and the reward
    failures, and the advantages."""

    rollout: Rollout
    local_rewards: np.ndarray
    reward_stats: RewardStats
    advantages: jax.Array


def _request(ctx: _Context, t: _LoopState, through: int, base_key: jax.Array) -> None:
    """Ask the engine for every batch up to step `through` not yet asked for (and below train.steps): this
    process's prompts of each, in step order."""
    run, job = ctx.run, t.job
    while t.pipeline.next_request <= min(through, run.train.steps - 1):
        step = t.pipeline.next_request
        problems = next(t.data_iter)  # this process's prompts (all of them in a single-process run)
        prompts, mask = encode_prompts(problems, job.tokenizer, job.fmt, job.prompt_len)
        prompts, mask = t.mine.global_prompts(np.asarray(prompts)), t.mine.global_prompts(np.asarray(mask))
        t.pipeline.request(step, problems, prompts, mask, jax.random.fold_in(base_key, step))


def _score(ctx: _Context, t: _LoopState, batch: Batch, reward_cfg: RewardConfig) -> _Scored:
    """The batch's rollout on the trainer's mesh, its rewards (each process decodes and scores its own rows) and
    the advantages (estimator state advanced)."""
    run, job = ctx.run, t.job
    n = run.rollout.num_samples
    rollout = batch.rollout()
    rollout = jax.device_put(rollout, batch_shardings(rollout, job.mesh))  # rows over the batch axes
    texts = decode_responses(local_rows(rollout.tokens), local_rows(rollout.response_mask), job.tokenizer,
                             job.prompt_len)
    local_rewards, reward_stats = score_responses([job.fmt.scoring_text(x) for x in texts],
                                                  t.mine.row_problems(batch.problems), config=reward_cfg,
                                                  reward_fn=ctx.reward_fn)
    rewards = global_rows(np.asarray(local_rewards, np.float32), rollout.lengths.sharding,
                          (run.rollout.prompts_per_step * n,))
    lengths = {"lengths": rollout.lengths} if run.algorithm.whiten == "token" else {}
    advantages, t.est_state = t.estimator.update(rewards, t.est_state, **lengths)
    if run.algorithm.dynamic_sampling:
        advantages = advantages * dynamic_sampling_mask(rewards, n)
    return _Scored(rollout, np.asarray(local_rewards, np.float64), reward_stats, advantages)


def _admit(ctx: _Context, t: _LoopState, batch: Batch, step: int, base_key: jax.Array
           ) -> tuple[Batch, float | None, dict[str, float]]:
    """Staleness of step `step`'s batch in versions and in predicted KL (the sum of the controller's predicted KLs
    of the updates since its version); over rollout.max_stale_kl it is regenerated with the current policy, or
    trained with its importance weights capped at rollout.stale_tis_cap (stale_action). Returns the batch to
    train, the rows' importance-weight cap for the batch (None: the batch carries none) and the metrics
    (stale_kl_predicted: the batch's as it came, which the budget judged; versions_behind: the trained one's)."""
    run = ctx.run.rollout
    stale_kl = t.pipeline.stale_kl(batch, step)
    metrics = {"versions_behind": float(step - batch.version), "regenerated": 0.0, "stale_clipped": 0.0}
    if ctx.run.optimizer.kl_control:  # without the controller nothing predicts a step's KL (behaviour_kl: realised)
        metrics["stale_kl_predicted"] = stale_kl
    over = bool(run.max_stale_kl) and stale_kl > run.max_stale_kl
    cap = None
    if run.max_stale_kl and run.stale_action == "clip":
        cap = run.stale_tis_cap if over else ctx.run.algorithm.tis_cap
        metrics["stale_clipped"] = float(over)
    elif over:  # regenerate with the policy of this step (the engine has been sent every update before it)
        n, rollout = run.num_samples, batch.rollout()
        prompts, mask = rollout.tokens[::n, :t.job.prompt_len], rollout.prompt_mask[::n]
        key = jax.random.fold_in(jax.random.fold_in(base_key, step), 1)
        batch = t.pipeline.request(step, batch.problems, prompts, mask, key, regenerated=True)
        batch.rollout()
        metrics.update(regenerated=1.0, versions_behind=float(step - batch.version))
    return batch, cap, metrics


def _train_and_publish(ctx: _Context, t: _LoopState, scored: _Scored, step: int, tis_cap: float | None = None
                       ) -> dict[str, float]:
    """The jitted train step on the scored rollout (KL reference and KL probe as configured), then the engine
    brought to the new weights; the step's metrics with the sync's. The engine releases its copy of the weights
    first (the colocated engine's bf16 copy need not sit beside the train step's peak; publish rebuilds it)."""
    run = ctx.run
    t.engine.release()
    repaired = t.pipeline.repair_if_needed(t.state.params)  # before the step takes the weights
    batch = _rl_batch(scored.rollout, scored.advantages, tis_cap)
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
    applied = not (out.get("kl_refused") or out.get("kl_undone"))
    try:
        report = t.pipeline.publish(updates, t.state.params, out.get("kl_predicted", 0.0) if applied else 0.0)
        delivered = t.pipeline.reports()
    except WorkerError as error:  # a new engine starts from these weights: the update needs no sending
        _restart_engine(ctx, t, step, error)
        report, delivered = None, []
    reports = [r for r in (repaired, report) if r is not None] + delivered
    if reports:  # a pipelined run's deliveries come later: those done by now
        out.update(sync_bytes=float(sum(r.nbytes for r in reports)), sync_time=sum(r.seconds for r in reports))
    out.update(sync_resyncs=float(t.engine.resyncs), engine_restarts=float(t.engine_failures))
    return out


def _restart_engine(ctx: _Context, t: _LoopState, step: int, error: WorkerError) -> None:
    """After the engine failed (its process died, or a request failed): a new one from the trainer's weights,
    and the batches it had not delivered asked again; after rollout.engine_restarts restarts, stop.

    Raises:
      WorkerError: one failure more than rollout.engine_restarts (the message names the engine and its output).
    """
    t.engine_failures += 1
    limit = ctx.run.rollout.engine_restarts
    if t.engine_failures > limit:
        raise WorkerError(f"RL step {step + 1}: the rollout engine failed {t.engine_failures} times "
                          f"(config.rollout.engine_restarts = {limit}); the last failure: {error}") from error
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    ctx.log(f"RL step {step + 1}: the rollout engine failed ({first}); restarting it from the trainer's weights "
            f"(restart {t.engine_failures} of at most {limit})")
    with contextlib.suppress(Exception):
        t.engine.close()
    t.engine = _closes(ctx.opened, t.make_engine(t.state))
    again = t.pipeline.restart(t.engine)
    ctx.log(f"RL step {step + 1}: the new engine holds the weights of version {t.pipeline.version}; {again} "
            "batch(es) asked again")


def _retrying(ctx: _Context, t: _LoopState, step: int, fn: Callable[[], _T]) -> _T:
    """fn() (a call that waits for the engine), the engine restarted and fn called again whenever it fails."""
    while True:
        try:
            return fn()
        except WorkerError as error:
            _restart_engine(ctx, t, step, error)


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


def _checkpoint_or_stop(ctx: _Context, t: _LoopState, step: int) -> None:
    """Called every step: the manager saves every `checkpoint_every` steps and on JAX's preemption notice; the
    final step and a stop request (SIGTERM / SIGINT, on any process: every process stops at this step) always
    save when checkpoints are on, and a stop request then raises RunPreempted. A pipelined run's checkpoint waits
    for the batches in flight and holds them (with their versions, problems and step KLs)."""
    run, stop, ckpt = ctx.run, ctx.stop, ctx.ckpt
    last = step + 1 == run.train.steps
    signum = int(multihost.gather(np.int32(stop.signum or 0)).max()) or None
    must = signum is not None or (last and run.train.checkpoint_every > 0)
    tree: tuple[Any, ...] = (t.state, t.est_state)
    extra = {"accuracy_before": t.accuracy_before, "sft": t.warm_start, "config": run.to_dict()}
    if t.pipeline.pending and (must or ckpt.should_save(step + 1)):  # the batches in flight go with it
        t.pipeline.drain()
        tree, extra["pipeline"] = (*tree, pending_tree(t.pipeline)), pending_record(t.pipeline)
    ckpt.save(step + 1, tree, data_state=t.data_iter.get_state(), extra=extra,
              force=must and not ckpt.should_save(step + 1))
    ckpt.check_for_errors()  # a failed background save stops the run here, naming the directory
    if signum is not None and not last:
        ckpt.wait_until_finished()
        raise RunPreempted(signum, step + 1)


def _rl_loop(ctx: _Context, t: _LoopState) -> None:
    """Phase "RL loop": per step, rollout → rewards → advantages → the jitted train step (KL probe) → policy
    sync → metrics (stop on a non-finite one) → periodic evaluation and checkpoint; a stop request checkpoints
    and raises RunPreempted."""
    run, log = ctx.run, ctx.log
    base_key = jax.random.key(run.train.seed)
    start = t.start  # loop steps; state.step counts applied updates (a refused step applies none)
    progress = metrics_lib.Progress(run.train.steps, initial=start, desc="RL",
                                    **({} if multihost.is_primary() else {"stream": io.StringIO(), "tty": False}))
    _closes(ctx.opened, progress)
    reward_cfg = RewardConfig(correct=run.algorithm.reward_correct, incorrect=run.algorithm.reward_incorrect,
                              format_weight=run.algorithm.format_weight)
    refusals, depth = 0, run.rollout.max_staleness
    for step in range(start, run.train.steps):
        t0 = time.perf_counter()
        _request(ctx, t, step, base_key)  # this step's batch (already asked for when pipelined)
        popped, waited = _retrying(ctx, t, step, functools.partial(t.pipeline.pop, step))
        batch, tis_cap, staleness = _retrying(ctx, t, step, functools.partial(_admit, ctx, t, popped, step, base_key))
        _request(ctx, t, step + depth, base_key)  # the engine generates ahead while the trainer trains
        t.pipeline.forget_kl_before(min([b.version for b in t.pipeline.pending], default=t.pipeline.version))
        scored = _score(ctx, t, batch, reward_cfg)
        t_rollout = time.perf_counter() - t0
        out = _train_and_publish(ctx, t, scored, step, tis_cap)
        out.update(_rollout_metrics(run, t, scored, reward_cfg), rollout_time=t_rollout, rollout_wait_time=waited,
                   step_time=time.perf_counter() - t0, **staleness, **metrics_lib.memory_stats())
        refusals = _guard(out, step, refusals, log)
        if run.train.eval_every and (step + 1) % run.train.eval_every == 0 and step + 1 < run.train.steps:
            out["eval_accuracy"] = t.evaluate(run, log)
        if (step + 1) % run.train.log_every == 0 or step + 1 == run.train.steps:
            ctx.writer.write(step + 1, out)
        progress.update(step + 1, out)
        if step == start:
            log(metrics_lib.describe_device_balance("the first RL step"))
        _checkpoint_or_stop(ctx, t, step)


def _finish(ctx: _Context, t: _LoopState, wall_start: float) -> dict[str, Any]:
    """Phase "finish": the held-out accuracy after RL, the last checkpoint and metrics closed, summary.json and
    the reward-curve PNG (process 0)."""
    run, workdir, log = ctx.run, ctx.workdir, ctx.log
    accuracy_before, accuracy_after = t.accuracy_before, t.evaluate(run, log, show="after RL")
    steps_done = run.train.steps
    ctx.writer.write(steps_done, {"eval_accuracy": accuracy_after})
    ctx.opened.close()  # the final checkpoint written, the metrics file complete
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

    def row_problems(self, problems: list[Problem]) -> list[Problem]:
        """The problem of each rollout row this process holds (`problems`: its prompts' problems)."""
        return [problems[row // self.n - self.prompts[0]] for row in range(*self.rollout)]


def _restore(ctx: _Context, candidates: list[int], abstract: Callable[[int], Any]) -> tuple[Any, _Restored]:
    """Restore the first readable checkpoint of `candidates` (newest first) into `abstract(step)`: (its tree, the
    rest of what it holds). Checkpoints newer than it are moved to workdir/checkpoints_set_aside (kept) so that the
    resumed run can write those steps again.

    Raises:
      CheckpointError: the (last) candidate is unreadable; the message says which config fields pick another.
    """
    ckpt, workdir, log = ctx.ckpt, ctx.workdir, ctx.log
    for i, step in enumerate(candidates):
        e: CheckpointError | None = None
        try:
            tree, data_state, extra = ckpt.restore(step, abstract=abstract(step))
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
        return tree, _Restored(step, data_state, extra)
    raise AssertionError("unreachable: no candidate checkpoints")


def _closes(stack: contextlib.ExitStack, resource: _Closable) -> _Closable:
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


