"""Datasets for ``envloop run``: every format, column mapping, templates, clear row errors."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from envloop.config.errors import ConfigError
from envloop.data.dataset_config import ColumnsConfig, DataConfig
from envloop.data.dataset_sources import detect_format
from envloop.data.datasets import PromptSample, build_rollout_batch, load_prompt_samples
from envloop.data.llm_message_utils import get_formatted_message_log

ROWS = [
    {"question": "What is 2 + 3?", "answer": "5", "kind": "math", "extra": {"level": 1}},
    {"question": "Slide it.", "answer": None, "kind": "puzzle", "extra": {"board": [[1, 0]]}},
    {"question": "What is 7 * 6?", "answer": "42", "kind": "math", "extra": None},
]
COLUMNS = ColumnsConfig(prompt="question", ground_truth="answer", task="kind", metadata="extra")
TASKS = {"math": True, "puzzle": False}


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def data_config(path, **kwargs):
    return DataConfig(path=str(path), columns=kwargs.pop("columns", COLUMNS), **kwargs)


def load_error(config, tasks=TASKS) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_prompt_samples(config, tasks)
    return info.value.problems


EXPECTED = [
    PromptSample(0, "math", [{"role": "user", "content": "What is 2 + 3?"}], "5",
                 {"level": 1, "ground_truth": "5"}),
    PromptSample(1, "puzzle", [{"role": "user", "content": "Slide it."}], None,
                 {"board": [[1, 0]]}),
    PromptSample(2, "math", [{"role": "user", "content": "What is 7 * 6?"}], "42",
                 {"ground_truth": "42"}),
]  # fmt: skip


def test_jsonl_rows_become_samples(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_prompt_samples(data_config(path), TASKS) == EXPECTED


def test_parquet_and_saved_datasets_give_the_same_samples(tmp_path):
    from datasets import Dataset, DatasetDict

    table = pa.Table.from_pylist(ROWS)  # "extra" becomes a struct: absent fields read as null
    pq.write_table(table, tmp_path / "d.parquet")
    assert load_prompt_samples(data_config(tmp_path / "d.parquet"), TASKS) == EXPECTED
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert detect_format(str(tmp_path / "saved")) == "hf_disk"
    assert load_prompt_samples(data_config(tmp_path / "saved"), TASKS) == EXPECTED
    splits = DatasetDict({"test": Dataset.from_list(ROWS[:1]), "train": Dataset.from_list(ROWS)})
    splits.save_to_disk(str(tmp_path / "splits"))
    assert (
        load_prompt_samples(data_config(tmp_path / "splits", split="test"), TASKS) == EXPECTED[:1]
    )
    assert load_error(data_config(tmp_path / "splits", split="dev")) == [
        f"data.split: {tmp_path / 'splits'} has no split 'dev' (splits: test, train)"
    ]


def test_format_detection():
    assert [detect_format(p) for p in ("a.jsonl", "a.json", "a.parquet", "openai/gsm8k")] == [
        "jsonl", "jsonl", "parquet", "hf_hub",
    ]  # fmt: skip


def test_template_system_prompt_shuffle_and_limit(tmp_path):
    rows = [{"prompt": f"q{i}", "ground_truth": i, "topic": f"t{i}"} for i in range(10)]
    rows[4]["system"] = "Row system."
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    config = DataConfig(
        path=str(path),
        columns=ColumnsConfig(task=None, system_prompt="system"),
        prompt_template="[{topic}] {prompt}?",
        system_prompt="Be brief.",
        shuffle=True,
        seed=3,
        limit=4,
    )
    samples = load_prompt_samples(config, {"math": True})
    order = list(range(10))
    random.Random(3).shuffle(order)
    assert [s.idx for s in samples] == order[:4]
    assert all(s.task == "math" for s in samples)  # no task column: the only task
    assert [s.ground_truth for s in samples] == [str(i) for i in order[:4]]  # numbers as text
    for s in samples:
        system = "Row system." if s.idx == 4 else "Be brief."
        assert s.messages == [
            {"role": "system", "content": system},
            {"role": "user", "content": f"[t{s.idx}] q{s.idx}?"},
        ]


def test_message_list_prompts_are_used_as_given(tmp_path):
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U {x}"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": chat, "ground_truth": "1"}])
    config = DataConfig(path=str(path), columns=ColumnsConfig(task=None), system_prompt="other")
    assert load_prompt_samples(config, {"math": True})[0].messages == chat


def test_missing_columns_name_the_key_and_list_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    columns = ColumnsConfig(prompt="prompt", ground_truth="solution", task="task", metadata="md")
    config = data_config(path, columns=columns, prompt_template="{prompt} ({level})")
    known = "(columns: question, answer, kind, extra)"
    assert load_error(config) == [
        f"data.columns.prompt: no column 'prompt' in the dataset {known}",
        f"data.columns.ground_truth: no column 'solution' in the dataset {known}; task(s) math "
        "need it",
        f"data.columns.task: no column 'task' in the dataset {known}; with several tasks (math, "
        "puzzle) rows name theirs",
        f"data.columns.metadata: no column 'md' in the dataset {known}",
        f"data.prompt_template: {{level}} is not a column {known}",
    ]


def test_every_bad_row_is_named_with_its_line(tmp_path):
    rows = [
        {"question": "ok", "answer": "1", "kind": "math"},
        {"question": "no answer", "kind": "math"},
        {"question": "", "answer": "2", "kind": "math"},
        {"question": "typo", "answer": "3", "kind": "mth"},
        {"question": "bad metadata", "answer": "4", "kind": "math", "extra": [1]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n"
                    + "\n".join(json.dumps(r) for r in rows[2:]) + "\n")  # fmt: skip
    assert load_error(data_config(path)) == [
        "row 1 (line 2 of d.jsonl): no ground truth (column 'answer', "
        "data.columns.ground_truth), which task 'math' is scored against; fill it in or drop "
        "the row",
        "row 2 (line 4 of d.jsonl): no prompt (column 'question', data.columns.prompt)",
        "row 3 (line 5 of d.jsonl): task 'mth' (column 'kind') has no entry in envs (tasks: "
        "math, puzzle). Did you mean 'math'?",
        "row 4 (line 6 of d.jsonl): metadata (column 'extra') must be a dict, got [1]",
    ]


def test_malformed_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    assert load_error(data_config(tmp_path / "bad.jsonl"))[0].startswith(
        "data.path: line 2 of bad.jsonl is not valid JSON"
    )
    (tmp_path / "empty.jsonl").write_text("\n")
    assert load_error(data_config(tmp_path / "empty.jsonl")) == [
        "data.path: empty.jsonl has no rows"
    ]
    (tmp_path / "folder").mkdir()
    assert load_error(data_config(tmp_path / "folder")) == [
        f"data.path: {tmp_path / 'folder'} is a folder but not a saved dataset (save_to_disk)"
    ]


def test_rollout_batch_is_token_exact_and_grouped(tiny_tokenizer):
    samples = [
        EXPECTED[0],
        PromptSample(5, "puzzle", [{"role": "system", "content": "S"},
                                   {"role": "user", "content": "Slide."}], None, {"seed": 1}),
    ]  # fmt: skip
    batch = build_rollout_batch(samples, tiny_tokenizer, 3, {"puzzle": ["</action>"]})
    assert batch.size == 6
    assert batch["idx"] == [0, 0, 0, 5, 5, 5]
    assert batch["generation"] == [0, 1, 2, 0, 1, 2]
    assert batch["task_name"] == ["math"] * 3 + ["puzzle"] * 3
    assert batch["stop_strings"] == [None] * 3 + [["</action>"]] * 3
    assert batch["ground_truth"] == ["5"] * 3 + [None] * 3
    assert batch["extra_env_info"][3] == batch["initial_extra_env_info"][3] == {"seed": 1}
    assert batch["extra_env_info"][3] is not batch["extra_env_info"][4]  # no shared state
    assert batch["prompt_messages"][3] == samples[1].messages
    for i, sample in zip((0, 3), samples):
        log = batch["message_log"][i]
        ids = torch.cat([m["token_ids"] for m in log]).tolist()
        expected = tiny_tokenizer.apply_chat_template(
            sample.messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert ids == list(expected) and batch["length"][i] == len(ids)
        reference = get_formatted_message_log(
            sample.messages, tiny_tokenizer, add_generation_prompt=True
        )
        assert [m["content"] for m in log] == [m["content"] for m in reference]
