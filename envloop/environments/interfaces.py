"""The contract every environment fulfils: a batched ``step`` returning ``EnvironmentReturn``.

Environment classes are plain classes (instantiate one to step it in-process) that also
start as Ray actors the way NeMo-RL's ``@ray.remote`` classes do: ``MathEnvironment.remote(cfg)``
or ``MathEnvironment.options(num_cpus=1).remote(cfg)`` (see :class:`EnvironmentClass`).
"""

from __future__ import annotations

import logging
from abc import ABC, ABCMeta, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, NamedTuple, TypeVar, Union

import torch

from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict

RewardsType = Union[torch.Tensor, dict[str, torch.Tensor]]  # noqa: UP007 - runtime alias on 3.10
"""[B] float rewards, or ``{"reward/<name>": [B] float}`` for several components."""

MetadataT = TypeVar("MetadataT")
"""An environment's per-sample metadata type, as in ``EnvironmentInterface[MyMetadata]``."""

DEFAULT_ACTOR_OPTIONS: dict[str, Any] = {"max_restarts": -1, "max_task_retries": 3}
"""Ray options every environment actor gets unless overridden: a dead actor is restarted
however often it dies (a crash, or the rollout killing it after a step timed out; a
constructor that raises is never restarted) and its in-flight ``step`` retried
(environments keep episode state in metadata, so a retried step gives the same answer)."""


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
        errors: B entries, each ``None`` or the text of why that sample's step failed
            (the engine records it on that sample alone and ends its episode); ``None``
            when no sample failed. A failed sample's other fields are placeholders: an
            empty observation, its metadata unchanged, reward 0, terminated.

    ``EnvironmentReturn[MyMetadata]``, NeMo-RL's spelling, also works (as for any tuple
    type) and builds this same class.
    """

    observations: list[dict[str, str]]
    metadata: list[Any]
    next_stop_strings: list[list[str] | None]
    rewards: RewardsType
    terminateds: torch.Tensor
    answers: list[Any] | None = None
    errors: list[str | None] | None = None


def actor_class(cls: type, **ray_options: Any) -> Any:
    """``cls`` as a Ray actor class, with :data:`DEFAULT_ACTOR_OPTIONS` overridden by
    ``ray_options`` (``num_cpus``, ``runtime_env``, ``max_restarts``, ...); call
    ``.remote(*args)`` on it to start an actor."""
    import ray

    with _quiet_remote_override_note():
        remote_cls: Any = ray.remote(cls)
    return remote_cls.options(**{**DEFAULT_ACTOR_OPTIONS, **ray_options})


class EnvironmentClass(ABCMeta):
    """The metaclass of environments: gives every environment class NeMo-RL's actor
    constructors, ``Env.remote(*args, **kwargs)`` and ``Env.options(**ray_options)``.

    They live on the metaclass, so they belong to the class only: instances and actor
    handles do not grow ``remote``/``options`` methods, and ``Env(cfg)`` stays an
    in-process environment.
    """

    def options(cls, **ray_options: Any) -> Any:
        """A Ray actor class for this environment (see :func:`actor_class`)."""
        return actor_class(cls, **ray_options)

    def remote(cls, *args: Any, **kwargs: Any) -> Any:
        """Start this environment as a Ray actor with :data:`DEFAULT_ACTOR_OPTIONS`;
        ``args``/``kwargs`` go to the constructor. Returns the actor handle."""
        return actor_class(cls).remote(*args, **kwargs)


class EnvironmentInterface(ABC, Generic[MetadataT], metaclass=EnvironmentClass):
    """An environment that scores a batch of conversations and answers each one.

    Subclasses implement :meth:`step` and :meth:`global_post_process_and_metrics`. The
    rollout engine handles batching, ordering, truncation, timeouts and retries; an
    environment only sees each message's ``role`` and ``content``. ``MetadataT`` (as in
    ``EnvironmentInterface[MyMetadata]``) only documents the metadata type.
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

    def shutdown(self) -> None:
        """Release resources (worker pools, models). The default does nothing."""

    @classmethod
    def actor_options(cls, config: Any) -> dict[str, Any]:
        """Ray actor options this environment needs for ``config`` (e.g. the GPUs of a
        reward model); ``create_env`` applies them under any options given explicitly.
        The default asks for nothing."""
        return {}

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (None: the defaults) beyond the types of the config
        TypedDict annotated on ``__init__``: ranges and contradictory options, one line each
        with its key relative to the config (``"max_turns: must be >= 1, got 0"``).

        ``envloop run`` reports them with the TypedDict's type problems before Ray starts;
        override it (and call it in ``__init__``) to have a bad config rejected there
        rather than in the actor. It runs in the driver, so keep it cheap. The default
        finds none."""
        return []


class _DropRemoteOverrideNote(logging.Filter):
    """Drops Ray's note that an actor class made from an environment class "overwrites
    attribute remote": that is intended (:class:`EnvironmentClass`'s ``remote`` starts
    the actor Ray's ``remote`` then stands for)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "overwrites attribute remote of that class" not in record.getMessage()


@contextmanager
def _quiet_remote_override_note() -> Iterator[None]:
    ray_actor_logger, note_filter = logging.getLogger("ray.actor"), _DropRemoteOverrideNote()
    ray_actor_logger.addFilter(note_filter)
    try:
        yield
    finally:
        ray_actor_logger.removeFilter(note_filter)
