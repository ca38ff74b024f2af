"""Dataset rows -> prompt samples -> the rollout input batch of ``envloop run``.

Each row gives a prompt (a string, formatted with ``data.prompt_template``, or a list of
``{role, content}`` messages), an optional system prompt, its task, its ground truth and
optional metadata; ``extra_env_info`` is the metadata (null entries dropped, as columnar
formats fill absent struct fields with null) plus ``ground_truth``. With
``data.columns.images``, the row's images (:mod:`envloop.data.dataset_images`) come first in
the first user message, whose content becomes ``[{"type": "image", "image": <PIL image>},
..., {"type": "text", "text": ...}]``. Every problem of every row is reported at once, each
naming the row (and JSONL line) and the config key; no row is dropped silently.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envloop.config.errors import ConfigError
from envloop.data.dataset_config import DataConfig
from envloop.data.dataset_images import row_images
from envloop.data.dataset_sources import Source, read_source

if TYPE_CHECKING:
    from envloop.data.interfaces import LLMMessageLogType
    from envloop.distributed.batched_data_dict import BatchedDataDict

MAX_ROW_PROBLEMS = 10
"""Problems shown in full; the rows of the others are named on one line."""
MAX_NAMED_ROWS = 50


@dataclass(frozen=True)
class PromptSample:
    """One dataset row, ready to tokenize."""

    idx: int  # the row's index in the dataset
    task: str
    messages: list[dict[str, Any]]  # role/content messages as the policy sees them
    ground_truth: str | None
    extra_env_info: dict[str, Any]


def load_prompt_samples(data: DataConfig, tasks: Mapping[str, bool]) -> list[PromptSample]:
    """The selected rows (shuffled with ``data.seed`` if asked, then cut to ``data.limit``)
    as samples. ``tasks`` maps each task name to whether its rows need a ground truth.
    Raises :class:`ConfigError` listing every missing column or bad row."""
    source = read_source(data.path, data.format, data.split)
    if not source.rows:
        raise ConfigError("data", [f"data.path: {source.name} has no rows"])
    column_problems = _column_problems(data, source.columns, tasks)
    if column_problems:
        raise ConfigError("data", column_problems)
    indices = list(range(len(source.rows)))
    if data.shuffle:
        random.Random(data.seed).shuffle(indices)
    problems: list[str] = []
    samples, problem_rows = [], []  # the row of each problem
    for i in indices[: data.limit]:
        before = len(problems)
        samples.append(_sample(source, i, data, tasks, problems))
        problem_rows += [i] * (len(problems) - before)
    if problems:
        raise ConfigError(f"dataset {source.name}", _shown_problems(problems, problem_rows))
    return [s for s in samples if s is not None]


def prompt_token_ids(samples: Sequence[PromptSample], tokenizer: Any) -> list[list[list[int]]]:
    """Each sample's prompt, chat-templated with the generation prompt: per message, its
    token ids (what :func:`build_rollout_batch` puts in ``message_log``). Needs no torch."""
    from envloop.data.message_tokens import message_token_ids

    return [
        message_token_ids(s.messages, tokenizer, add_generation_prompt=True)[1] for s in samples
    ]


def prompt_message_logs(
    samples: Sequence[PromptSample],
    tokenizer: Any,
    token_ids: Sequence[list[list[int]]] | None = None,
) -> list[LLMMessageLogType]:
    """Each sample's prompt as a tokenized message log, chat-templated with the generation
    prompt: its messages with their ``token_ids`` (int64 [tokens]). With a multimodal
    processor as ``tokenizer``, ``get_formatted_message_log`` tokenizes them: image
    placeholders expanded, and a message with images carries its vision inputs (e.g.
    ``pixel_values`` and ``image_grid_thw``, each a one-item ``PackedTensor``). ``token_ids``:
    the prompts' :func:`prompt_token_ids` when already computed (text only). Imports torch."""
    import torch

    from envloop.data.llm_message_utils import get_formatted_message_log
    from envloop.data.multimodal_utils import is_processor

    if is_processor(tokenizer):
        return [
            get_formatted_message_log(s.messages, tokenizer, add_generation_prompt=True)
            for s in samples
        ]
    token_ids = token_ids if token_ids is not None else prompt_token_ids(samples, tokenizer)
    return [
        [{**m, "token_ids": torch.tensor(ids, dtype=torch.long)} for m, ids in zip(s.messages, t)]
        for s, t in zip(samples, token_ids)
    ]


def build_rollout_batch(
    samples: Sequence[PromptSample],
    tokenizer: Any,
    generations_per_prompt: int = 1,
    stop_strings: Mapping[str, list[str] | None] | None = None,
    token_ids: Sequence[list[list[int]]] | None = None,
    message_logs: Sequence[LLMMessageLogType] | None = None,
) -> BatchedDataDict[Any]:
    """The rollout input: ``DatumSpec`` columns plus ``prompt_messages`` (the original
    messages), ``ground_truth``, ``initial_extra_env_info`` (a copy the rollout leaves
    alone, for re-scoring) and ``generation`` (0 .. n-1 within each prompt's group),
    each prompt repeated ``generations_per_prompt`` times in a row (deep copies that share
    the prompt's images and vision tensors: ``repeat_interleave(...,
    share_immutable_media=True)``). ``stop_strings`` gives each task's first-turn
    stop strings; ``token_ids`` or ``message_logs``, the prompts' :func:`prompt_token_ids`
    or :func:`prompt_message_logs` when already computed. (Imports torch: reading rows
    does not.)"""
    from envloop.distributed.batched_data_dict import BatchedDataDict

    if message_logs is None:
        message_logs = prompt_message_logs(samples, tokenizer, token_ids)
    logs = list(message_logs)
    stops = stop_strings or {}
    batch: BatchedDataDict[Any] = BatchedDataDict(
        message_log=logs,
        length=[sum(len(m["token_ids"]) for m in log) for log in logs],
        extra_env_info=[copy.deepcopy(s.extra_env_info) for s in samples],
        initial_extra_env_info=[copy.deepcopy(s.extra_env_info) for s in samples],
        loss_multiplier=[1.0] * len(samples),
        idx=[s.idx for s in samples],
        task_name=[s.task for s in samples],
        stop_strings=[stops.get(s.task) for s in samples],
        prompt_messages=[s.messages for s in samples],
        ground_truth=[s.ground_truth for s in samples],
    )
    batch = batch.repeat_interleave(generations_per_prompt, share_immutable_media=True)
    batch["generation"] = list(range(generations_per_prompt)) * len(samples)
    return batch


def _column_problems(data: DataConfig, columns: list[str], tasks: Mapping[str, bool]) -> list[str]:
    cols, known = data.columns, f"(columns: {', '.join(columns)})"
    problems = []

    def check(key: str, name: str | None, why: str = "") -> None:
        if name is not None and name not in columns:
            problems.append(f"data.columns.{key}: no column {name!r} in the dataset {known}{why}")

    check("prompt", cols.prompt)
    needing = [t for t, needs in tasks.items() if needs]
    if needing:
        check("ground_truth", cols.ground_truth, f"; task(s) {', '.join(needing)} need it")
    if len(tasks) > 1:
        check("task", cols.task, f"; with several tasks ({', '.join(tasks)}) rows name theirs")
    check("system_prompt", cols.system_prompt)
    check("metadata", cols.metadata)
    check("images", cols.images)
    try:
        fields = [
            f for _, f, _, _ in string.Formatter().parse(data.prompt_template) if f is not None
        ]
    except ValueError as exc:
        return [*problems, f"data.prompt_template: {exc}"]
    for field in fields:
        base = field.split(".")[0].split("[")[0]
        if base != "prompt" and base not in columns:
            problems.append(f"data.prompt_template: {{{field}}} is not a column {known}")
    return problems


def _sample(
    source: Source, i: int, data: DataConfig, tasks: Mapping[str, bool], problems: list[str]
) -> PromptSample | None:
    row, where, cols = source.rows[i], source.where(i), data.columns
    before = len(problems)
    task = _task(row, cols.task, tasks, where, problems)
    prompt = row.get(cols.prompt)
    if prompt is None or prompt == "" or prompt == []:
        problems.append(f"{where}: no prompt (column {cols.prompt!r}, data.columns.prompt)")
    truth = row.get(cols.ground_truth)
    if task is not None and tasks[task] and (truth is None or truth == ""):
        problems.append(
            f"{where}: no ground truth (column {cols.ground_truth!r}, data.columns.ground_truth),"
            f" which task {task!r} is scored against; fill it in or drop the row"
        )
    metadata = _metadata(row, cols.metadata, where, problems)
    messages = _messages(prompt, row, data, where, problems) if prompt else []
    if cols.images is not None:
        images, image_problems = row_images(row.get(cols.images), cols.images, source.folder, where)
        problems += image_problems
        if messages and not image_problems:
            messages = _with_images(messages, images, cols.images, where, problems)
    if len(problems) > before or task is None:
        return None
    truth_text = None if truth is None else truth if isinstance(truth, str) else _text(truth)
    info = {**metadata, **({"ground_truth": truth_text} if truth_text is not None else {})}
    return PromptSample(i, task, messages, truth_text, info)


def _task(
    row: dict, column: str | None, tasks: Mapping[str, bool], where: str, problems: list[str]
) -> str | None:
    task = row.get(column) if column is not None else None
    if task is None and len(tasks) == 1:
        return next(iter(tasks))
    if task in tasks:
        return str(task)
    close = difflib.get_close_matches(str(task), list(tasks), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    problems.append(
        f"{where}: task {task!r} (column {column!r}) has no entry in envs "
        f"(tasks: {', '.join(tasks)}).{hint}"
    )
    return None


def _messages(
    prompt: Any, row: dict, data: DataConfig, where: str, problems: list[str]
) -> list[dict[str, str]]:
    if isinstance(prompt, list):
        ok = all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
        if not ok:
            problems.append(f"{where}: a prompt list must hold {{role, content}} string messages")
            return []
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        try:
            text = data.prompt_template.format_map({**row, "prompt": prompt})
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            problems.append(f"{where}: data.prompt_template cannot be filled ({exc!r})")
            return []
        messages = [{"role": "user", "content": text}]
    system = row.get(data.columns.system_prompt) if data.columns.system_prompt else None
    system = system or data.system_prompt
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": str(system)})
    return messages


def _with_images(
    messages: list[dict[str, Any]], images: list[Any], column: str, where: str, problems: list[str]
) -> list[dict[str, Any]]:
    """``messages`` with ``images`` before the text of the first user message."""
    if not images:
        return messages
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        problems.append(
            f"{where}: the prompt has no user message to hold the images of column {column!r} "
            "(data.columns.images); add one"
        )
        return messages
    text = messages[first_user]["content"]
    parts = [{"type": "image", "image": image} for image in images]
    out = list(messages)
    out[first_user] = {**out[first_user], "content": [*parts, {"type": "text", "text": text}]}
    return out


def _shown_problems(problems: list[str], rows: list[int]) -> list[str]:
    """The first :data:`MAX_ROW_PROBLEMS` problems, then one line naming the rows of the
    rest."""
    if len(problems) <= MAX_ROW_PROBLEMS:
        return problems
    rest = list(dict.fromkeys(rows[MAX_ROW_PROBLEMS:]))
    named = ", ".join(map(str, rest[:MAX_NAMED_ROWS]))
    named += ", ..." if len(rest) > MAX_NAMED_ROWS else ""
    extra = len(problems) - MAX_ROW_PROBLEMS
    return [*problems[:MAX_ROW_PROBLEMS], f"... and {extra} more, in rows {named}"]


def _metadata(row: dict, column: str | None, where: str, problems: list[str]) -> dict[str, Any]:
    value = row.get(column) if column is not None else None
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{where}: metadata (column {column!r}) must be a dict, got {value!r:.40}")
        return {}
    return {k: v for k, v in value.items() if v is not None}


def _text(value: Any) -> str:
    return str(value) if isinstance(value, (int, float, bool)) else json.dumps(value)
