"""The contract every environment fulfils: a batched ``step`` returning ``EnvironmentReturn``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Union

import torch

from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict

RewardsType = Union[torch.Tensor, dict[str, torch.Tensor]]  # noqa: UP007 - runtime alias on 3.10
"""[B] float rewards, or ``{"reward/<name>": [B] float}`` for several components."""


class EnvironmentReturn(NamedTuple):
    """What one ``step`` returns; every field has one entry per sample (B).

    Attributes:
        observations: B dicts ``{"role": str, "content": str}``, the environment's reply.
        metadata: B per-sample metadata dicts for the next turn; ``None`` keeps the old one.
        next_stop_strings: B entries, each a list of stop strings for the sample's next
            generation or ``None`` (EOS only).
        rewards: [B] float tensor, or a dict ``{"reward/<name>": [B] float tensor}``.
        terminateds: [B] bool tensor, True when the episode ended.
        answers: B extracted answers (or ``None`` each); ``None`` when not provided.
    """

    observations: list[dict[str, str]]
    metadata: list[Any]
    next_stop_strings: list[list[str] | None]
    rewards: RewardsType
    terminateds: torch.Tensor
    answers: list[Any] | None = None


class EnvironmentInterface(ABC):
    """An environment that scores a batch of conversations and answers each one.

    Subclasses implement :meth:`step` and :meth:`global_post_process_and_metrics`. The
    rollout engine handles batching, ordering, truncation, timeouts and retries; an
    environment only sees each message's ``role`` and ``content``.
    """

    @abstractmethod
    def step(
        self,
        message_log_batch: list[LLMMessageLogType],
        metadata: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> EnvironmentReturn:
        """Score each conversation (its last message is the policy's response) and reply."""

    @abstractmethod
    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
        """Post-process a finished rollout batch and return it with environment metrics."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Release resources (worker pools, models). The default does nothing."""
