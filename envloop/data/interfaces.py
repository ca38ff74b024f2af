"""Message and datum types shared by every part of envloop.

A *message* is a plain dict so that it crosses process and Ray boundaries cheaply:

- ``role``: ``"system"``, ``"user"``, ``"assistant"``, ``"environment"``, ``"tool"``, ...
- ``content``: the text.
- ``token_ids``: 1-D int64 tensor, once tokenized. Concatenated over a log, these are
  exactly the tokens the policy saw and produced.
- ``generation_logprobs``: 1-D float32 tensor, one per token, on generated messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from typing_extensions import NotRequired

from envloop.distributed.packed_tensor import PackedTensor


class Message(TypedDict, total=False):
    """One chat message; ``role`` and ``content`` are always present."""

    role: str
    content: str
    token_ids: torch.Tensor  # [T] int64
    generation_logprobs: torch.Tensor  # [T] float32, generated messages only
    token_loss_mask: torch.Tensor  # [T] bool, added by add_loss_mask_to_message_log


LLMMessageLogType = list[dict[str, Any]]
"""A conversation: a list of messages (dicts), oldest first."""

FlatMessagesType = dict[str, list[Any] | torch.Tensor | PackedTensor]
"""A message log flattened per key: tensors concatenated, ``PackedTensor`` values (vision
inputs) joined into one item, other values listed."""


class DatumSpec(TypedDict):
    """One sample of a rollout batch.

    Attributes:
        message_log: the conversation so far, every message carrying ``token_ids``.
        length: number of prompt tokens (sum of ``token_ids`` lengths in ``message_log``).
        extra_env_info: per-sample environment metadata, e.g. ``{"ground_truth": "42"}``.
        loss_multiplier: 1.0 to train on the sample, 0.0 to mask it out.
        idx: the sample's index in its dataset.
        task_name: selects the environment that scores the sample.
        stop_strings: stop strings for the first generation turn (None: EOS only).
    """

    message_log: LLMMessageLogType
    length: int
    extra_env_info: dict[str, Any] | None
    loss_multiplier: float
    idx: int
    task_name: str
    stop_strings: NotRequired[list[str] | None]


@dataclass
class TaskDataSpec:
    """How a dataset's samples are prompted (the published interface's task spec).

    ``prompt_file`` and ``system_prompt_file`` are read on construction into ``prompt`` and
    ``system_prompt`` (None without a file). ``prompt`` is a format string applied to the
    first user message's text, e.g. ``"Solve: {}"``; ``get_formatted_message_log`` applies it.

    >>> spec = TaskDataSpec(task_name="math")
    >>> spec.prompt is None, spec.system_prompt is None
    (True, True)
    """

    task_name: str | None = None
    prompt_file: str | os.PathLike[str] | None = None
    system_prompt_file: str | os.PathLike[str] | None = None
    prompt: str | None = field(init=False, default=None)
    system_prompt: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.prompt = _read_prompt(self.prompt_file, "prompt_file")
        self.system_prompt = _read_prompt(self.system_prompt_file, "system_prompt_file")

    def copy_defaults(self, from_spec: TaskDataSpec) -> None:
        """Take ``prompt`` and ``system_prompt`` from ``from_spec`` where this spec has none."""
        if self.prompt is None:
            self.prompt = from_spec.prompt
        if self.system_prompt is None:
            self.system_prompt = from_spec.system_prompt


def _read_prompt(path: str | os.PathLike[str] | None, name: str) -> str | None:
    if path is None:
        return None
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"TaskDataSpec {name}={os.fspath(path)!r} does not exist; pass the path of a text "
            "file holding the prompt, or None."
        )
    with open(path, encoding="utf-8") as f:
        return f.read()
