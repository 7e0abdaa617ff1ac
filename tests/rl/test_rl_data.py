"""tfds builders (array_record, no TensorFlow) and the grain pipeline: content, determinism, sharding, resume."""

import json

import pytest

from logra_jax.rl.data import (
    GeneratedTasks,
    JsonlTasks,
    data_source,
    problem_batches,
    problem_dataset,
    record_to_problem,
)
from logra_jax.rl.tasks import TaskSpec, generate_problem

SPEC = TaskSpec(kind="countdown", count=3, max_number=30, seed=4)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    builder = GeneratedTasks(SPEC, {"train": 24, "test": 6}, data_dir=tmp_path_factory.mktemp("tasks"))
    return data_source(builder, "train"), data_source(builder, "test")


def test_generated_records_are_the_generated_problems(generated):
    train, test = generated
    assert len(train) == 24 and len(test) == 6
    assert sorted(record_to_problem(train[i]).question for i in range(24)) == sorted(
        generate_problem(SPEC, i).question for i in range(24))
    assert {record_to_problem(test[i]) for i in range(6)} == {generate_problem(SPEC, i) for i in range(24, 30)}


def test_prepared_data_is_reused(generated, tmp_path):
    builder = GeneratedTasks(TaskSpec(), {"train": 3}, data_dir=tmp_path)
    first = data_source(builder, "train")
    again = data_source(GeneratedTasks(TaskSpec(), {"train": 3}, data_dir=tmp_path), "train")
    assert [first[i] for i in range(3)] == [again[i] for i in range(3)]
    assert len(list((tmp_path / "generated_tasks").iterdir())) == 1
    with pytest.raises(ValueError, match="split 'validation'"):
        data_source(builder, "validation")


def test_jsonl_builder_reads_gsm8k_and_math_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"question": "q1", "answer": "work\n#### 1,234"},
             {"problem": "q2", "solution": r"so $\boxed{\frac{1}{2}}$"},
             {"problem": "q3", "solution": r"\boxed{9}", "answer": "9"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    source = data_source(JsonlTasks({"test": path}, data_dir=tmp_path / "data"), "test")
    problems = {p.question.split()[0]: p for p in (record_to_problem(source[i]) for i in range(len(source)))}
    assert len(source) == 3
    assert problems["q1"].answer == "1,234" and problems["q2"].answer == r"\frac{1}{2}" and problems["q3"].answer == "9"
    assert all(p.task == "math" for p in problems.values())


def test_jsonl_builder_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "ok", "answer": "#### 1"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: math_problem: no answer"):
        data_source(JsonlTasks({"train": path}, data_dir=tmp_path / "data"), "train")
    with pytest.raises(ValueError, match="not found"):
        JsonlTasks({"train": tmp_path / "missing.jsonl"}, data_dir=tmp_path)


def _questions(ds, n):
    return [p.question for p in (ds[i] for i in range(n))]


def test_shuffle_is_seeded_and_reshuffles_each_epoch(generated):
    train, _ = generated
    a = problem_dataset(train, seed=1)
    assert _questions(a, 48) == _questions(problem_dataset(train, seed=1), 48)
    assert _questions(a, 24) != _questions(problem_dataset(train, seed=2), 24)
    epoch0, epoch1 = _questions(a, 24), [a[24 + i].question for i in range(24)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(_questions(problem_dataset(train, seed=0, shuffle=False), 24))
    assert epoch0 != epoch1
    assert len(problem_dataset(train, seed=0, num_epochs=2)) == 48


def test_shards_partition_the_data(generated):
    train, _ = generated
    shards = [_questions(problem_dataset(train, seed=0, num_epochs=1, shard_index=i, shard_count=3), 8)
              for i in range(3)]
    everything = _questions(problem_dataset(train, seed=0, shuffle=False), 24)
    assert sorted(q for shard in shards for q in shard) == sorted(everything)
    with pytest.raises(ValueError, match="shard_index"):
        problem_dataset(train, seed=0, shard_index=3, shard_count=3)


@pytest.mark.parametrize("prefetch", [0, 4])
def test_iterator_state_resumes_on_the_exact_next_batch(generated, tmp_path, prefetch):
    train, _ = generated
    it = iter(problem_batches(train, 5, seed=9, prefetch=prefetch))
    for _ in range(7):  # past the end of the first epoch (24 examples / 5 per batch)
        next(it)
    (tmp_path / "state.json").write_text(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    resumed = iter(problem_batches(train, 5, seed=9, prefetch=prefetch))
    resumed.set_state(json.loads((tmp_path / "state.json").read_text()))
    got = [next(resumed) for _ in range(4)]
    assert got == expected
    assert all(len(batch) == 5 for batch in got)
    fresh = [next(iter(problem_batches(train, 5, seed=9)))]
    assert fresh[0] != expected[0]


@pytest.mark.parametrize("count", [2, 4])
def test_process_parts_are_the_rows_of_the_single_process_batches(generated, count):
    """Process i of k reads rows [i·b/k, (i+1)·b/k) of every batch of the single-process order, across epochs;
    its own iterator state resumes it."""
    train, _ = generated
    full = iter(problem_batches(train, 8, seed=3))
    parts = [iter(problem_batches(train, 8, seed=3, part=(i, count))) for i in range(count)]
    for _ in range(2 * len(train) // 8 + 1):  # past an epoch boundary (reshuffled)
        assert next(full) == [p for it in parts for p in next(it)]
    state = parts[-1].get_state()
    expected = next(parts[-1])
    parts[-1].set_state(state)
    assert next(parts[-1]) == expected


@pytest.mark.parametrize("part", [(2, 2), (0, 3), (-1, 2)])
def test_a_bad_process_part_names_itself(generated, part):
    with pytest.raises(ValueError, match=r"problem_batches: part"):
        problem_batches(generated[0], 8, seed=0, part=part)
