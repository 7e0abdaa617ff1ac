"""Task datasets on disk (tensorflow-datasets builders, array_record) served through grain.

Two builders write the same record schema {task, question, answer, numbers, solution} under a data directory
passed in (nothing is downloaded):
- `GeneratedTasks(spec, splits)`: procedural arithmetic / countdown problems, example i = generate_problem(spec, i)
  (train and test use disjoint index ranges).
- `JsonlTasks(files)`: GSM8K/MATH-style JSONL files, one JSON object per line (answers extracted when written).
Builders outside a dataset package build `tfds.core.DatasetInfo` directly; array_record + `as_data_source` works
without TensorFlow (the parquet format silently drops examples, so it is not offered).

`problem_dataset` wraps a split as a grain MapDataset of `Problem`s with a seeded global shuffle (a different
order per epoch, the same for the same seed) and per-host sharding; `problem_batches` batches it into an
IterDataset whose iterator has `get_state()` / `set_state()` (JSON-serialisable), so training resumes on the
exact next batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds
from absl import logging as absl_logging

from logra_jax.rl.tasks import Problem, TaskSpec, generate_problem, math_problem


def _features() -> tfds.features.FeaturesDict:
    text = tfds.features.Text
    return tfds.features.FeaturesDict({"task": text(), "question": text(), "answer": text(),
                                       "numbers": tfds.features.Sequence(np.int64), "solution": text()})


def _record(problem: Problem) -> dict[str, Any]:
    return {"task": problem.task, "question": problem.question, "answer": problem.answer,
            "numbers": list(problem.numbers), "solution": problem.solution}


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def record_to_problem(record: Mapping[str, Any]) -> Problem:
    """A `Problem` from a record read back from a builder's data source (bytes decoded as UTF-8)."""
    return Problem(task=_text(record["task"]), question=_text(record["question"]), answer=_text(record["answer"]),
                   numbers=tuple(int(n) for n in record["numbers"]), solution=_text(record["solution"]))


class GeneratedTasks(tfds.core.GeneratorBasedBuilder):
    """Procedural problems of one `TaskSpec`, written once under `data_dir/generated_tasks/<spec.name>/`.

    Example:
      >>> import tempfile
      >>> b = GeneratedTasks(TaskSpec(kind="arithmetic"), {"train": 8}, data_dir=tempfile.mkdtemp())
      >>> len(data_source(b, "train"))
      8
    """

    VERSION = tfds.core.Version("1.0.0")
    # A builder in a library module has no dataset folder (checksums, metadata); without this tfds looks for one
    # through `importlib_resources`, a package it uses but does not install.
    code_path = None

    def __init__(self, spec: TaskSpec, splits: Mapping[str, int], *, data_dir: str | os.PathLike[str]):
        if not splits or any(not isinstance(n, int) or n <= 0 for n in splits.values()):
            raise ValueError(f"GeneratedTasks: splits must map names to positive sizes, got {dict(splits)!r}")
        self._spec = spec
        self._splits = dict(splits)
        sizes = "-".join(f"{name}{n}" for name, n in self._splits.items())
        config = tfds.core.BuilderConfig(name=f"{spec.name}-{sizes}")
        with _quiet_tfds():
            super().__init__(data_dir=os.fspath(data_dir), config=config, file_format="array_record")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=f"Generated {self._spec}", features=_features())

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager
        splits, start = {}, 0
        for name, size in self._splits.items():
            splits[name] = self._generate_examples(start, size)
            start += size
        return splits

    def _generate_examples(self, start: int, size: int):
        for index in range(start, start + size):
            yield index, _record(generate_problem(self._spec, index))


def _file_digest(paths: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=6)
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class JsonlTasks(tfds.core.GeneratorBasedBuilder):
    """GSM8K/MATH-style JSONL files as splits, written under `data_dir/jsonl_tasks/<name>-<content digest>/`.

    Each non-blank line is a JSON object read by `tasks.math_problem` (question from question/problem/prompt,
    answer from `answer` or the final answer of `solution`). A new file content gets a new directory.

    Raises:
      ValueError: for a missing file, or (when preparing) a line that is not a JSON object or has no question or
        answer; the message names the file and line.
    """

    VERSION = tfds.core.Version("1.0.0")
    code_path = None  # see GeneratedTasks

    def __init__(self, files: Mapping[str, str | os.PathLike[str]], *, data_dir: str | os.PathLike[str],
                 name: str = "math"):
        if not files:
            raise ValueError("JsonlTasks: files must map at least one split name to a path")
        self._files = {split: os.fspath(path) for split, path in files.items()}
        for split, path in self._files.items():
            if not os.path.isfile(path):
                raise ValueError(f"JsonlTasks: file for split {split!r} not found: {path!r}")
        digest = _file_digest([self._files[s] for s in sorted(self._files)])
        config = tfds.core.BuilderConfig(name=f"{name}-{digest}")
        with _quiet_tfds():
            super().__init__(data_dir=os.fspath(data_dir), config=config, file_format="array_record")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description="GSM8K/MATH-style JSONL", features=_features())

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager
        return {split: self._generate_examples(path) for split, path in self._files.items()}

    def _generate_examples(self, path: str):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                    problem = math_problem(record)
                except ValueError as e:
                    raise ValueError(f"JsonlTasks: {path}:{line_no}: {e}") from e
                yield line_no, _record(problem)


@contextlib.contextmanager
def _quiet_tfds():
    """tfds reports routine work (custom builder configs, preparation) through absl warnings, stdout and tqdm
    bars; library callers and their progress output should see none of it. Errors still surface."""
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    tfds.display_progress_bar(False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        absl_logging.set_verbosity(level)


def data_source(builder: tfds.core.DatasetBuilder, split: str) -> Sequence[Any]:
    """Prepare `builder` (once: later calls reuse the files) and return the random-access source of `split`.

    Raises:
      ValueError: if the builder has no such split.
    """
    with _quiet_tfds():
        builder.download_and_prepare()
    if split not in builder.info.splits:
        raise ValueError(f"data_source: split {split!r} not in {sorted(builder.info.splits)}")
    return builder.as_data_source(split=split)


def problem_dataset(source: Sequence[Any], *, seed: int, shuffle: bool = True, num_epochs: int | None = None,
                    shard_index: int = 0, shard_count: int = 1) -> grain.MapDataset:
    """A grain MapDataset of `Problem`s over a builder's data source.

    Order: this host's shard (`source[shard_index::shard_count]`), globally shuffled by `seed` (reshuffled each
    epoch, deterministically), repeated `num_epochs` times (None: forever).

    Example:
      >>> import tempfile
      >>> source = data_source(GeneratedTasks(TaskSpec(), {"train": 4}, data_dir=tempfile.mkdtemp()), "train")
      >>> sorted(p.answer for p in problem_dataset(source, seed=0, num_epochs=1)) == sorted(
      ...     record_to_problem(source[i]).answer for i in range(4))
      True
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"problem_dataset: need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"problem_dataset: num_epochs must be >= 1 or None, got {num_epochs}")
    ds = grain.MapDataset.source(source)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    if len(ds) == 0:
        raise ValueError(f"problem_dataset: shard {shard_index}/{shard_count} of the source is empty")
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.map(record_to_problem)


def problem_batches(source: Sequence[Any], batch_size: int, *, seed: int, shuffle: bool = True,
                    num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1,
                    drop_remainder: bool = True, prefetch: int = 4, part: tuple[int, int] = (0, 1)
                    ) -> grain.IterDataset:
    """An IterDataset of lists of `batch_size` Problems; its iterator checkpoints with get_state/set_state.

    `part` = (i, k): this process's i-th of k equal parts of every batch — rows [i·b/k, (i+1)·b/k) of each
    batch of the single-process order — and nothing else is read (a multi-process run, each process reading
    only its own prompts while the global batches stay those of a single-process run).

    `prefetch` batches are read ahead by one thread (prompt records are small; grain's default of 16 threads and
    500 elements would decode far ahead of a sampler that needs one batch per step).

    Example:
      >>> import tempfile
      >>> source = data_source(GeneratedTasks(TaskSpec(), {"train": 8}, data_dir=tempfile.mkdtemp()), "train")
      >>> it = iter(problem_batches(source, 4, seed=0))
      >>> state = it.get_state(); batch = next(it)
      >>> it.set_state(state); next(it) == batch
      True
    """
    if batch_size < 1:
        raise ValueError(f"problem_batches: batch_size must be >= 1, got {batch_size}")
    ds = problem_dataset(source, seed=seed, shuffle=shuffle, num_epochs=num_epochs, shard_index=shard_index,
                         shard_count=shard_count)
    if prefetch < 0:
        raise ValueError(f"problem_batches: prefetch must be >= 0, got {prefetch}")
    index, count = part
    if not 0 <= index < count or batch_size % count:
        raise ValueError(f"problem_batches: part {part} must be (i, k) with 0 <= i < k and k dividing "
                         f"batch_size={batch_size}")
    batches = ds.batch(batch_size // count, drop_remainder=drop_remainder, batch_fn=list)
    if count > 1:
        batches = batches[index::count]
    return batches.to_iter_dataset(grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch))
