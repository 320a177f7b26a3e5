"""The user's data: a job's ``data:`` section, read with ``datasets`` and tokenized with a
local tokenizer; every bad input named in one line (file, row, key); the data position
visits every row once per epoch in a seeded order and can be restored."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("datasets")

from executor.data import (
    DataCursor,
    DataExhaustedError,
    build_dataset_task,
    left_padded,
)
from profiles.datafile import SpecError
from simulator.specs.data import DataSpec, parse_data
from simulator.specs.job import job_from_mapping
from tests.dataset_fixtures import addition_rows, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def spec(path: Path, **fields: object) -> DataSpec:
    return DataSpec(train_files=(str(path),), **fields)  # type: ignore[arg-type]


def test_prompts_are_tokenized_with_the_tokenizer_and_its_chat_template(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    plain = write_jsonl(tmp_path / "plain.jsonl", addition_rows(6))
    task = build_dataset_task(spec(plain), str(tokenizer_dir), max_prompt_length=32)
    assert len(task.train) == 6 and task.val is None
    first = task.train.rows[0]
    assert task.train.texts[0] == first["prompt"]
    assert task.tokenizer.decode(list(task.train.token_ids[0]),
                                 skip_special_tokens=True).split() == first["prompt"].split()
    assert first["_file"] == str(plain) and first["_row"] == 0
    chat = write_jsonl(tmp_path / "chat.jsonl", addition_rows(4, chat=True))
    rendered = build_dataset_task(spec(chat), str(tokenizer_dir), max_prompt_length=32)
    assert rendered.train.texts[0].startswith("<|user|> What is")
    assert rendered.train.texts[0].endswith("<|assistant|>")
    # A string prompt through the chat template too, when asked.
    templated = build_dataset_task(spec(plain, chat_template=True), str(tokenizer_dir),
                                   max_prompt_length=32)
    assert templated.train.texts[0] == f"<|user|> {first['prompt']} <|assistant|>"
    assert task.eos_token_id == task.tokenizer.eos_token_id
    assert task.pad_token_id == task.tokenizer.pad_token_id
    assert task.vocab_needed == 38


def test_a_batch_is_left_padded_and_remembers_its_rows(tmp_path: Path,
                                                       tokenizer_dir: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", addition_rows(5))
    task = build_dataset_task(spec(path, shuffle=False), str(tokenizer_dir),
                              max_prompt_length=32)
    batch = task.prompt_batch(3)
    lengths = [len(task.train.token_ids[i]) for i in range(3)]
    assert batch["prompts"].shape == (3, max(lengths))
    assert batch["prompt_mask"].sum(-1).tolist() == lengths
    for i, n in enumerate(lengths):  # pads on the left, real tokens at the end
        assert batch["prompt_mask"][i, -n:].all() and not batch["prompt_mask"][i, :-n].any()
    assert [r["id"] for r in task.rows(batch)] == [0, 1, 2]
    assert task.prompt_texts(batch)[1] == task.train.rows[1]["prompt"]
    eos, word = task.eos_token_id, task.tokenizer.convert_tokens_to_ids("7")
    assert task.response_texts(left_padded([[word, eos, word]], 0)[0]) == ["7"]


def test_prompts_over_the_limit_are_refused_truncated_or_left_out(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    rows = addition_rows(8)
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    limit = 8  # "What is a + b ?" is 6 words plus BOS-free: 3 terms make 8
    lengths = [len(r["prompt"].split()) for r in rows]
    longer = [i for i, n in enumerate(lengths) if n > limit - 1]
    assert longer, "the fixture must have prompts over the limit"
    with pytest.raises(SpecError, match=rf"row {longer[0]}: the prompt has \d+ tokens, more "
                                        rf"than max_prompt_length {limit - 1}"):
        build_dataset_task(spec(path), str(tokenizer_dir), max_prompt_length=limit - 1)
    kept = build_dataset_task(spec(path, prompt_too_long="filter"), str(tokenizer_dir),
                              max_prompt_length=limit - 1)
    assert len(kept.train) == len(rows) - len(longer) and kept.train.dropped == len(longer)
    cut = build_dataset_task(spec(path, prompt_too_long="truncate"), str(tokenizer_dir),
                             max_prompt_length=limit - 1)
    assert cut.train.truncated == len(longer) and cut.train.longest == limit - 1
    index = longer[0]
    words = rows[index]["prompt"].split()
    assert cut.tokenizer.decode(list(cut.train.token_ids[index])).split() == \
        words[-(limit - 1):]  # the end is kept
    # The job's max_prompt_length wins over the workload's prompt_length.
    own = build_dataset_task(spec(path, max_prompt_length=16), str(tokenizer_dir),
                             max_prompt_length=limit - 1)
    assert len(own.train) == len(rows)


@pytest.mark.parametrize(("content", "problem"), [
    ("", "no rows"),
    ('{"prompt": "What is 1 + 2 ?"}\n{"prompt": \n', "line 2: not valid JSON"),
    ('["What is 1 + 2 ?"]\n', "line 1: expected a JSON object per line"),
    ('{"question": "What is 1 + 2 ?"}\n', "row 0: no column 'prompt' (columns: question)"),
    ('{"prompt": 7}\n', "row 0: expected a string or a list of chat messages"),
    ('{"prompt": [{"role": "user"}]}\n', "row 0: expected a string or a list of chat"),
    ('{"prompt": ""}\n', "row 0: the prompt is empty"),
])
def test_bad_data_is_named_by_file_and_row(tmp_path: Path, tokenizer_dir: Path, content: str,
                                          problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecError) as caught:
        build_dataset_task(spec(path), str(tokenizer_dir), max_prompt_length=32)
    assert problem in str(caught.value) and str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_tokenizer_problems_are_one_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", addition_rows(2))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SpecError, match="has no tokenizer files"):
        build_dataset_task(spec(path), str(empty), max_prompt_length=32)
    (empty / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(SpecError, match=r"empty/tokenizer\.json: not valid JSON: line 1"):
        build_dataset_task(spec(path), str(empty), max_prompt_length=32)
    (empty / "tokenizer.json").write_text('{"valid json": "but no tokenizer"}',
                                          encoding="utf-8")
    with pytest.raises(SpecError, match="the tokenizer does not load"):
        build_dataset_task(spec(path), str(empty), max_prompt_length=32)


def test_the_cursor_visits_every_row_once_per_epoch_and_resumes(tmp_path: Path) -> None:
    cursor = DataCursor(rows=5, epochs=2, seed=3, shuffle=True)
    first = cursor.take(3) + cursor.take(2)
    assert sorted(first) == [0, 1, 2, 3, 4] and first != [0, 1, 2, 3, 4]
    assert cursor.state == {"epoch": 1, "offset": 0, "rows": 5, "seed": 3}
    second = cursor.take(4)
    saved = cursor.state
    rest = cursor.take(1)
    assert sorted(second + rest) == [0, 1, 2, 3, 4] and second + rest != first  # reshuffled
    with pytest.raises(DataExhaustedError, match="used up after 2 epoch"):
        cursor.take(1)
    short = DataCursor(rows=5, epochs=1, seed=0, shuffle=False)
    short.take(4)
    with pytest.raises(DataExhaustedError, match="1 left, 2 needed"):
        short.take(2)
    assert short.state["offset"] == 4  # a batch is never cut short, nothing is lost
    again = DataCursor(rows=5, epochs=2, seed=3, shuffle=True)
    again.restore(saved)
    assert again.take(1) == rest  # neither repeats nor skips
    with pytest.raises(SpecError, match="saved data position is for 5 rows and seed 3"):
        DataCursor(rows=6, epochs=1, seed=3, shuffle=True).restore(saved)
    ordered = DataCursor(rows=4, epochs=1, seed=0, shuffle=False)
    assert ordered.take(4) == [0, 1, 2, 3]


def test_the_data_section_of_a_job(tmp_path: Path, tokenizer_dir: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", addition_rows(2))
    base = {"algorithm": "grpo", "models": {"actor": "tiny-2l", "ref": "tiny-2l",
                                            "reward": "rule"},
            "cluster": {"nodes": 1, "gpus_per_node": 1},
            "workload": {"samples_per_prompt": 2}}
    job = job_from_mapping({**base, "data": {"train_files": "train.jsonl",
                                             "tokenizer": str(tokenizer_dir)}},
                           base_dir=tmp_path)
    assert job.data is not None
    assert job.data.train_files == (str((tmp_path / "train.jsonl").resolve()),)
    again = job_from_mapping(job.to_value())
    assert again.data == job.data
    for data, key, problem in [
        ({"train_files": []}, "data.train_files", "give at least one file"),
        ({"train_files": ["train.csv"]}, "data.train_files[0]", "expected a .jsonl"),
        ({"train_files": ["missing.jsonl"]}, "data.train_files[0]", "file not found"),
        ({"train_files": "train.jsonl", "epochs": 0}, "data.epochs", "must be at least 1"),
        ({"train_files": "train.jsonl", "prompt_too_long": "cut"}, "data.prompt_too_long",
         "must be one of error, truncate, filter"),
        ({"train_files": "train.jsonl", "tokenizer": "nowhere"}, "data.tokenizer",
         "not a directory"),
        ({"train_files": "train.jsonl", "shufle": True}, "data.shufle", "unknown key"),
    ]:
        with pytest.raises(SpecError) as caught:
            job_from_mapping({**base, "data": data}, base_dir=tmp_path)
        assert caught.value.key == key and problem in caught.value.problem
    with pytest.raises(SpecError, match="expected a mapping with train_files"):
        parse_data("train.jsonl", tmp_path)


def grpo_data_mapping(tmp_path: Path, model: str) -> dict:
    """A small GRPO job on four additions in tmp_path/train.jsonl, scored by a rule function
    in tmp_path/sums.py, with ``model`` as actor and reference."""
    write_jsonl(tmp_path / "train.jsonl", addition_rows(4))
    (tmp_path / "sums.py").write_text("def compute_score(p, r, row):\n    return 0.0\n")
    return {"algorithm": "grpo",
            "models": {"actor": model, "ref": model, "reward": "rule"},
            "cluster": {"nodes": 1, "gpus_per_node": 1},
            "workload": {"samples_per_prompt": 2, "prompts_per_iteration": 2,
                         "mini_batches_per_epoch": 1, "prompt_length": 16},
            "reward_function": {"path": "sums.py"},
            "data": {"train_files": "train.jsonl"}}


def test_a_model_given_as_a_checkpoint_directory_brings_weights_and_tokenizer(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    import shutil

    import torch

    from executor.model import build_model, write_hf_checkpoint
    from executor.run import ExecutionOptions, effective_checkpoints, validate_for_execution
    from simulator.default_plan import colocate_plan
    from simulator.specs.presets import MODEL_PRESETS
    from tests.dataset_fixtures import make_tokenizer

    spec = MODEL_PRESETS["tiny-2l"]
    model = build_model(spec, seed=3)
    checkpoint = write_hf_checkpoint(tmp_path / "my-model", spec, model.state_dict(),
                                     torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, checkpoint / name)
    mapping = grpo_data_mapping(tmp_path, "my-model")
    mapping["workload"]["response_length"] = 4
    job = job_from_mapping(mapping, base_dir=tmp_path)
    assert job.model_paths == {"actor": str(checkpoint.resolve()),
                               "ref": str(checkpoint.resolve())}
    assert job_from_mapping(job.to_value()).model_paths == job.model_paths  # round trip
    options = ExecutionOptions()
    assert effective_checkpoints(job, options) == job.model_paths
    task = validate_for_execution(job, colocate_plan(job), options)
    assert task.tokenizer_directory == str(checkpoint.resolve())
    # A reference whose checkpoint carries another tokenizer reads other words: refused.
    other = write_hf_checkpoint(tmp_path / "other", spec, model.state_dict(), torch.float32)
    make_tokenizer(other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace(
        '"What"', '"Which"'))
    mixed = job_from_mapping({**mapping, "models": {**mapping["models"], "ref": "other"}},
                             base_dir=tmp_path)
    with pytest.raises(SpecError, match=r"ref's tokenizer .* differs from the one the prompts"):
        validate_for_execution(mixed, colocate_plan(mixed), options)
    # No tokenizer anywhere: one line saying where one is expected.
    bare = job_from_mapping({**mapping, "models": {"actor": "tiny-2l", "ref": "tiny-2l",
                                                   "reward": "rule"}}, base_dir=tmp_path)
    with pytest.raises(SpecError, match=r"no tokenizer: give data\.tokenizer"):
        validate_for_execution(bare, colocate_plan(bare), options)


@pytest.mark.parametrize(("change", "options", "key", "problem"), [
    ({"algorithm": "safe-rlhf"}, {}, "data", "Safe-RLHF's cost rule"),
    ({"reward_function": None}, {}, "data", "give reward_function"),
    ({"models": {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "tiny-2l"},
      "reward_function": None}, {}, "models.reward", "must start from its trained weights"),
    ({}, {"validate_every": 2}, "--validate-every", "give data.val_files"),
])
def test_jobs_the_data_cannot_run_are_refused_before_workers_start(
        tmp_path: Path, tokenizer_dir: Path, change: dict, options: dict, key: str,
        problem: str) -> None:
    from executor.run import ExecutionOptions, validate_for_execution
    from simulator.default_plan import colocate_plan

    mapping = grpo_data_mapping(tmp_path, "tiny-2l")
    mapping["data"]["tokenizer"] = str(tokenizer_dir)
    mapping.update(change)
    if mapping["algorithm"] == "safe-rlhf":
        mapping["models"] = {r: "tiny-2l" for r in ("actor", "critic", "ref", "cost")}
        mapping["models"]["reward"] = "rule"
        mapping["workload"] = {k: v for k, v in mapping["workload"].items()
                               if k != "samples_per_prompt"}
    job = job_from_mapping({k: v for k, v in mapping.items() if v is not None},
                           base_dir=tmp_path)
    plan = colocate_plan(job)
    if "backends" in change:
        from dataclasses import replace
        plan = replace(plan, roles={r: replace(rp, training_backend="megatron")
                                    for r, rp in plan.roles.items()})
    with pytest.raises(SpecError) as caught:
        validate_for_execution(job, plan, ExecutionOptions(**options))
    assert caught.value.key == key and problem in str(caught.value)
