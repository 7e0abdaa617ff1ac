"""RunConfig sections → the objects a run is made of: model + tokenizer, and the task's datasets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence, Set
from pathlib import Path

import grain
from jax.sharding import Mesh

from logra_jax.job.run_config import ModelSection, SFTSection, TaskSection
from logra_jax.models import (
    LoadStats,
    abstract_model,
    char_tokenizer,
    init_model,
    init_sharded_model,
    load,
    preset,
)
from logra_jax.models.decoder import Decoder
from logra_jax.models.expert_parallel import (
    expert_parallel_shardings,
    init_expert_parallel_model,
    install_expert_parallel,
)
from logra_jax.models.tokenizer import Tokenizer
from logra_jax.rl.data import GeneratedTasks, JsonlTasks, data_source, problem_batches, record_to_problem
from logra_jax.rl.tasks import Problem, generate_problem


def build_model(cfg: ModelSection, mesh: Mesh | None = None, *, weights: bool = True,
                stats: LoadStats | None = None) -> tuple[Decoder, Tokenizer]:
    """The decoder and its tokenizer: a checkpoint (HF directory or GGUF) or a preset with random weights.

    With `mesh`, the weights are created (random: `init_sharded_model`, under jit with the rules' out_shardings)
    or read (each process reading only its devices' slices) straight into their shards: no device ever holds a
    whole weight that the rules split. `weights=False`: the model is abstract (ShapeDtypeStruct leaves; a resumed
    run restores its weights). `stats` counts a checkpoint's bytes read. With model.expert_parallel the MoE
    layers' experts are split over the mesh's fsdp axis, created or read in that layout and computed where they
    live (`logra_jax.models.expert_parallel`).

    Raises:
      ValueError: the tokenizer's vocabulary does not fit the model's, or the checkpoint carries no tokenizer
        while model.tokenizer = "checkpoint", or model.expert_parallel with no experts or experts that the fsdp
        axis does not divide (names the config field).
    """
    overrides = dict(cfg.overrides)
    if cfg.checkpoint:
        shardings = mesh
        if cfg.expert_parallel and mesh is not None:  # read each device's own experts whole
            shardings = expert_parallel_shardings(load(cfg.checkpoint, weights=False, **overrides)[0], mesh)
        model, tokenizer, _ = load(cfg.checkpoint, shardings=shardings, stats=stats, weights=weights, **overrides)
        if cfg.tokenizer == "char":
            tokenizer = char_tokenizer()
        elif tokenizer is None:
            raise ValueError(f"config.model.tokenizer = 'checkpoint', but {cfg.checkpoint} has no tokenizer")
    else:
        config = preset(cfg.preset, **overrides)
        if not weights:
            model = abstract_model(config)
        elif mesh is None:
            model = init_model(config, seed=cfg.init_seed)
        elif cfg.expert_parallel:
            model = init_expert_parallel_model(config, mesh, seed=cfg.init_seed)
        else:
            model = init_sharded_model(config, mesh, seed=cfg.init_seed)
        tokenizer = char_tokenizer()
    if cfg.expert_parallel:
        install_expert_parallel(model, mesh)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"config.model: the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{model.config.vocab_size}")
    return model, tokenizer


@dataclasses.dataclass(frozen=True)
class Tasks:
    """train_batches(batch_size, seed): grain IterDataset of Problem lists (checkpointable iterator);
    eval_problems: the held-out set; sft_problems: the warm-start demonstrations (empty without SFT);
    train_problems: every RL training problem (fixes the prompt length). No question of eval_problems occurs
    in train_problems or sft_problems."""

    train_batches: Callable[..., grain.IterDataset]
    eval_problems: Sequence[Problem]
    sft_problems: Sequence[Problem]
    train_problems: Sequence[Problem]


def sft_problems(task: TaskSection, sft: SFTSection, held_out: Set[str]) -> list[Problem]:
    """The warm-start demonstrations: `sft.train_size` easier arithmetic problems (spec seed task.seed + 1) and
    `sft.task_examples` problems of the RL task (seed task.seed + 2), minus any whose question is in `held_out`.

    Raises:
      ValueError: every demonstration is a held-out problem (names config.sft).
    """
    easy = sft.spec(task.seed + 1)
    problems = [generate_problem(easy, i) for i in range(sft.train_size)]
    if sft.task_examples:
        hard = task.spec(task.seed + 2)
        problems += [generate_problem(hard, i) for i in range(sft.task_examples)]
    kept = [p for p in problems if p.question not in held_out]
    if not kept:
        raise ValueError(f"config.sft: all {len(problems)} demonstrations are held-out problems; use a different "
                         f"sft.difficulty/operations or more sft.train_size")
    return kept


def build_tasks(task: TaskSection, sft: SFTSection, data_dir: Path) -> Tasks:
    """Prepare the task's tfds builder (array_record, once per data_dir) and read it through grain.

    The held-out split stays as generated; training problems (RL and SFT) whose question equals a held-out
    question are dropped, so "held-out" means never trained on (a generator drawing with replacement from a
    small space, or a JSONL file with repeats, would otherwise leak evaluation problems into training).

    Raises:
      ValueError: every RL training problem is also a held-out problem (names config.task).
    """
    if task.kind == "jsonl":
        builder = JsonlTasks({"train": task.jsonl_train, "eval": task.jsonl_eval}, data_dir=data_dir)
    else:
        builder = GeneratedTasks(task.spec(), {"train": task.train_size, "eval": task.eval_size},
                                 data_dir=data_dir)
    train = data_source(builder, "train")
    eval_source = data_source(builder, "eval")
    eval_problems = [record_to_problem(eval_source[i]) for i in range(min(task.eval_size, len(eval_source)))]
    held_out = {p.question for p in eval_problems}
    every_train = [record_to_problem(train[i]) for i in range(len(train))]
    keep = [i for i, p in enumerate(every_train) if p.question not in held_out]
    if not keep:
        raise ValueError(f"config.task: all {len(every_train)} training problems are also held-out problems; "
                         f"increase task.train_size or reduce task.eval_size")
    if len(keep) < len(every_train):
        train = [train[i] for i in keep]
        every_train = [every_train[i] for i in keep]
    demos = sft_problems(task, sft, held_out) if sft.steps else []

    def train_batches(batch_size: int, *, seed: int, part: tuple[int, int] = (0, 1)) -> grain.IterDataset:
        return problem_batches(train, batch_size, seed=seed, part=part)

    return Tasks(train_batches, eval_problems, demos, every_train)
