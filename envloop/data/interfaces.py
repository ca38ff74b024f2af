"""Message and datum types shared by every part of envloop.

A *message* is a plain dict so that it crosses process and Ray boundaries cheaply:

- ``role``: ``"system"``, ``"user"``, ``"assistant"``, ``"environment"``, ``"tool"``, ...
- ``content``: the text.
- ``token_ids``: 1-D int64 tensor, once tokenized. Concatenated over a log, these are
  exactly the tokens the policy saw and produced.
- ``generation_logprobs``: 1-D float32 tensor, one per token, on generated messages.
"""

from typing import Any, TypedDict

import torch
from typing_extensions import NotRequired


class Message(TypedDict, total=False):
    """One chat message; ``role`` and ``content`` are always present."""

    role: str
    content: str
    token_ids: torch.Tensor  # [T] int64
    generation_logprobs: torch.Tensor  # [T] float32, generated messages only
    token_loss_mask: torch.Tensor  # [T] bool, added by add_loss_mask_to_message_log


LLMMessageLogType = list[dict[str, Any]]
"""A conversation: a list of messages (dicts), oldest first."""

FlatMessagesType = dict[str, list[Any] | torch.Tensor]
"""A message log flattened per key: tensors concatenated, other values listed."""


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
